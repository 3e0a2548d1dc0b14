"""Build a rank's shard of a model stage and fill it from a Hugging Face folder, reading only its
slices of the tensors the stage holds."""

from __future__ import annotations

import json
from collections.abc import Callable
from contextlib import ExitStack
from pathlib import Path

import torch
from safetensors import safe_open

from shardspec.layers.parallel import TPGroup
from shardspec.models import registry
from shardspec.models.base import CausalLM, Stage, split_layers
from shardspec.models.config import ConfigError

Progress = Callable[[int, int], None]


def checkpoint_files(folder: Path) -> dict[str, Path]:
    """Map every tensor name of the checkpoint to the file that holds it."""
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        return {name: folder / file for name, file in weight_map.items()}
    single = folder / "model.safetensors"
    if not single.is_file():
        raise ConfigError(f"{folder} has neither model.safetensors nor model.safetensors.index.json")
    with safe_open(single, framework="pt") as f:
        return dict.fromkeys(f.keys(), single)


def has_mtp(folder: str | Path) -> bool:
    family, _ = registry.read(folder)
    return family.has_mtp(checkpoint_files(Path(folder)))


def stage_of(folder: str | Path, index: int, stages: int, layer_split: list[int] | None = None) -> Stage:
    """Stage `index` of `stages` of the model in `folder` (layer_split: layers per stage, or even)."""
    _, config = registry.read(folder)
    return split_layers(config.num_hidden_layers, stages, layer_split)[index]


def load_model(
    folder: str | Path,
    tp: TPGroup,
    dtype: torch.dtype,
    device: torch.device,
    with_mtp: bool | None = None,
    progress: Progress | None = None,
    stage: Stage | None = None,
) -> CausalLM:
    """This rank's shard of `stage` (default: the whole model), weights in `dtype` on `device`;
    peak host memory ≈ the shard, not the model."""
    folder = Path(folder)
    family, config = registry.read(folder)
    config.check_tp(tp.size)
    stage = stage or Stage.whole(config.num_hidden_layers)
    files = checkpoint_files(folder)
    mtp_present = family.has_mtp(files)
    if with_mtp and not mtp_present:
        raise ConfigError(f"{folder} has no MTP weights ({family.draft_prefix or 'its family has no MTP'}*)")
    mtp = mtp_present if with_mtp is None else with_mtp
    with torch.device("meta"):
        model = family.build(config, tp, stage, mtp)
        whole = family.build(config, TPGroup(), stage, mtp)  # one rank's view of every full tensor
    specs = {name: (getattr(param, "shard", None), getattr(param, "parts", None))
             for name, param in model.named_parameters()}
    model = model.to(dtype).to_empty(device=device)  # new parameter objects: give them their specs back
    for name, param in model.named_parameters():
        param.shard, param.parts = specs[name]  # type: ignore[attr-defined]

    # multimodal wrappers keep the text model under model.language_model.
    text_prefix = "model.language_model." if any(k.startswith("model.language_model.") for k in files) else "model."
    params = list(model.named_parameters())
    with ExitStack() as stack:
        handles: dict[Path, object] = {}

        def read(key: str, spec: tuple | None, shape: list[int]) -> torch.Tensor:
            """This rank's slice of checkpoint tensor `key`, whose full shape must be `shape`."""
            if key not in files:
                raise ConfigError(f"checkpoint in {folder} lacks tensor {key!r}")
            if files[key] not in handles:
                handles[files[key]] = stack.enter_context(safe_open(files[key], framework="pt"))
            full = handles[files[key]].get_slice(key)
            if list(full.get_shape()) != shape:
                raise ConfigError(f"tensor {key!r} has shape {list(full.get_shape())}, the config implies {shape}")
            return _read_shard(full, spec)

        def in_file(key: str) -> str:
            return text_prefix + key[len("model.") :] if key.startswith("model.") else key

        for done, (name, param) in enumerate(params, 1):
            spec, parts = specs[name]
            keys = [in_file(key) for key in sources(model, name, parts)]
            shape = list(whole.get_parameter(name).shape)
            if parts is None:
                tensor = read(keys[0], spec, shape)
            else:  # stacked rows of sibling tensors: .../in_proj.weight from .../in_proj_qkv.weight, ...
                sizes = whole.get_submodule(name.rsplit(".", 1)[0]).sizes
                tensor = torch.cat([read(key, (0, ranges), [rows, *shape[1:]])
                                    for key, (_, ranges), rows in zip(keys, parts, sizes, strict=True)])
            assert list(tensor.shape) == list(param.shape), (name, tensor.shape, param.shape)
            with torch.no_grad():
                param.copy_(tensor)
            if progress:
                progress(done, len(params))
    return model


def sources(model: CausalLM, name: str, parts: list | None) -> list[str]:
    """The checkpoint tensors (text layout) parameter `name` is read from: one, or one per part of
    a stacked parameter (layers.parallel.stack)."""
    key = model.checkpoint_key(name)
    if parts is None:
        return [key]
    module, leaf = key.rsplit(".", 2)[0], key.rsplit(".", 1)[1]
    return [f"{module}.{part}.{leaf}" for part, _ in parts]


def checkpoint_keys(model: CausalLM) -> set[str]:
    """Every checkpoint tensor (text layout) the model's parameters are read from."""
    return {key for name, param in model.named_parameters()
            for key in sources(model, name, getattr(param, "parts", None))}


def _read_shard(full, spec: tuple | None) -> torch.Tensor:
    """Read the rows/columns of a checkpoint tensor a parameter holds; ranges past the end (only
    the vocabulary's, padded up to a multiple of the group size) read as zeros."""
    if spec is None:
        return full[:]
    dim, ranges = spec
    size = full.get_shape()[dim]
    parts = []
    for start, end in ranges:
        index = [slice(None)] * len(full.get_shape())
        index[dim] = slice(min(start, size), min(end, size))
        part = full[tuple(index)]
        missing = end - start - part.shape[dim]
        if missing:
            pad_shape = list(part.shape)
            pad_shape[dim] = missing
            part = torch.cat([part, part.new_zeros(pad_shape)], dim)
        parts.append(part)
    return torch.cat(parts, dim) if len(parts) > 1 else parts[0]
