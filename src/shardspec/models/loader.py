"""Build a rank's shard of a model and fill it from a Hugging Face folder, reading only its slices."""

from __future__ import annotations

import json
from collections.abc import Callable
from contextlib import ExitStack
from pathlib import Path

import torch
from safetensors import safe_open

from shardspec.layers.parallel import TPGroup
from shardspec.models.config import ConfigError, ModelConfig
from shardspec.models.qwen3_5 import Qwen3_5Model, checkpoint_name

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
        return {name: single for name in f.keys()}


def has_mtp(folder: Path) -> bool:
    return any(name.startswith("mtp.") for name in checkpoint_files(folder))


def load_model(
    folder: str | Path,
    tp: TPGroup,
    dtype: torch.dtype,
    device: torch.device,
    with_mtp: bool | None = None,
    progress: Progress | None = None,
) -> Qwen3_5Model:
    """This rank's shard, weights in `dtype` on `device`; peak host memory ≈ the shard, not the model."""
    folder = Path(folder)
    config = ModelConfig.from_folder(folder)
    config.check_tp(tp.size)
    files = checkpoint_files(folder)
    mtp_present = any(name.startswith("mtp.") for name in files)
    if with_mtp and not mtp_present:
        raise ConfigError(f"{folder} has no MTP weights (mtp.*)")
    mtp = mtp_present if with_mtp is None else with_mtp
    with torch.device("meta"):
        model = Qwen3_5Model(config, tp, with_mtp=mtp)
        whole = Qwen3_5Model(config, TPGroup(), with_mtp=mtp)  # one rank's view of every full tensor
    specs = {name: (getattr(param, "shard", None), getattr(param, "parts", None))
             for name, param in model.named_parameters()}
    model = model.to(dtype).to_empty(device=device)  # new parameter objects: `specs` keeps them

    text_prefix = "model.language_model." if "model.language_model.embed_tokens.weight" in files else "model."
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

        for done, (name, param) in enumerate(params, 1):
            key = checkpoint_name(name, config)
            key = text_prefix + key[len("model.") :] if key.startswith("model.") else key
            spec, parts = specs[name]
            shape = list(whole.get_parameter(name).shape)
            if parts is None:
                tensor = read(key, spec, shape)
            else:  # stacked rows of sibling tensors: .../in_proj.weight from .../in_proj_qkv.weight, ...
                module, leaf = key.rsplit(".", 2)[0], key.rsplit(".", 1)[1]
                sizes = whole.get_submodule(name.rsplit(".", 1)[0]).sizes
                tensor = torch.cat([read(f"{module}.{part}.{leaf}", (0, ranges), [rows, *shape[1:]])
                                    for (part, ranges), rows in zip(parts, sizes, strict=True)])
            assert list(tensor.shape) == list(param.shape), (name, tensor.shape, param.shape)
            with torch.no_grad():
                param.copy_(tensor)
            if progress:
                progress(done, len(params))
    return model


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
