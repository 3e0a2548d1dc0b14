"""Build a rank's shard of a model stage and fill it from a Hugging Face folder, reading only its
slices of the tensors the stage holds."""

from __future__ import annotations

from collections.abc import Callable
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from shardspec import kernels
from shardspec.layers.fp8 import FP8, prepare_kernels
from shardspec.layers.parallel import TPGroup
from shardspec.models import fp8
from shardspec.models.base import CausalLM, Stage, split_config
from shardspec.models.checkpoint import Checkpoint, fp8_degrees_note
from shardspec.models.config import ConfigError, check_regular

Progress = Callable[[int, int], None]


def load_model(
    checkpoint: Checkpoint | str | Path,
    tp: TPGroup,
    dtype: torch.dtype,
    device: torch.device,
    with_mtp: bool | None = None,
    progress: Progress | None = None,
    stage: Stage | None = None,
    fp8_native: bool | None = None,
    expert_parallel: int = 1,
) -> CausalLM:
    """This rank's shard of `stage` (default: the whole model) of a checkpoint (or the folder that
    holds one), weights in `dtype` on `device`, its experts (if any) split over `expert_parallel`
    groups of the ranks (layers.moe); peak host memory ≈ the shard, not the model. The FP8 weights
    of an FP8 checkpoint stay FP8 where fp8_native (default: on a GPU with FP8, compute capability
    8.9 or later), else are dequantised."""
    if not isinstance(checkpoint, Checkpoint):
        checkpoint = Checkpoint.open(checkpoint)
    family, config, files = checkpoint.family, checkpoint.config, checkpoint.files
    split_config(config, tp.size, expert_parallel)  # ConfigError naming the degrees that work
    stage = stage or Stage.whole(config.num_hidden_layers)
    if with_mtp and not checkpoint.has_mtp:
        raise ConfigError(f"{checkpoint.folder} has no MTP weights "
                          f"({family.draft_prefix or 'its family has no MTP'}*)")
    mtp = checkpoint.has_mtp if with_mtp is None else with_mtp
    model, specs, plan = _plan(family, config, tp, stage, mtp, files, expert_parallel)
    experts = {name: param.experts for name, param in model.named_parameters() if hasattr(param, "experts")}
    read_keys = {key for reads, _ in plan.values() for key, _, _ in reads}
    entries = checkpoint.entries(read_keys | {fp8.scale_key(key) for key in read_keys})
    quantized = fp8.quantized_keys(entries, checkpoint.quantization, checkpoint.folder)
    model = model.to(dtype)
    if quantized and (fp8_native_default(device) if fp8_native is None else fp8_native):
        plan = _keep_fp8(model, plan, quantized, tp.size, config)
    # before allocating: the checkpoint really holds every tensor the config implies
    _check_shapes(plan, entries, files, checkpoint.folder)
    model = model.to_empty(device=device)  # new parameter objects: give them their specs back
    for name, param in model.named_parameters():
        param.shard, param.parts = specs.get(name, (None, None))  # type: ignore[attr-defined]
        if name in experts:
            param.experts = experts[name]  # type: ignore[attr-defined]
    raw = {key for name, (reads, _) in plan.items() if model.get_parameter(name).dtype == FP8
           for key, _, _ in reads}  # read as they are; other FP8 tensors are dequantised

    params = list(model.named_parameters())
    with ExitStack() as stack:
        read = _CheckpointReader(files, stack, quantized - raw, dtype).read
        for done, (name, param) in enumerate(params, 1):
            reads, stacked = plan[name]
            tensor = torch.cat([read(key, spec) for key, spec, _ in reads]) if stacked else read(*reads[0][:2])
            if name in experts:  # experts one after the other, read from either layout
                tensor = tensor.view(param.shape)
            assert list(tensor.shape) == list(param.shape), (name, tensor.shape, param.shape)
            with torch.no_grad():
                param.copy_(tensor)
            if progress:
                progress(done, len(params))
    if raw:
        prepare_kernels(model)
    return model


class _CheckpointReader:
    """Slices of a checkpoint's tensors, each file opened once (and closed with `stack`); the FP8
    weights in `dequantize` times their block scales, in `dtype`."""

    def __init__(self, files: dict[str, Path], stack: ExitStack, dequantize: set[str], dtype: torch.dtype):
        self.files, self.stack, self.dequantize, self.dtype = files, stack, dequantize, dtype
        self.handles: dict[Path, Any] = {}

    def read(self, key: str, spec: tuple | None) -> torch.Tensor:
        """This rank's slice `spec` of checkpoint tensor `key` (_read_shard)."""
        full = self._handle(key).get_slice(key)
        tensor = _read_shard(full, spec)
        if key in self.dequantize:
            scale = self._handle(fp8.scale_key(key)).get_tensor(fp8.scale_key(key))
            tensor = fp8.dequantize_slice(tensor, scale, spec, full.get_shape(), self.dtype)
        return tensor

    def _handle(self, key: str) -> Any:
        file = self.files[key]
        if file not in self.handles:
            check_regular(file)  # safetensors opens it by name
            self.handles[file] = self.stack.enter_context(safe_open(file, framework="pt"))
        return self.handles[file]


def fp8_native_default(device: torch.device) -> bool:
    """Whether FP8 weights stay FP8 on `device`: a GPU whose kernels read FP8 (8.9 or later)."""
    return device.type == "cuda" and kernels.HAVE_TRITON and torch.cuda.get_device_capability(device) >= (8, 9)


def _plan(family, config, tp: TPGroup, stage: Stage, mtp: bool, files: dict[str, Path], ep: int = 1):
    """A rank's model (its experts over ep groups of the ranks) on the meta device, its parameters'
    slice specs, and where each is read from."""
    with torch.device("meta"):
        model = family.build(split_config(config, tp.size, ep) if ep != 1 else config, tp, stage, mtp)
        whole = family.build(config, TPGroup(), stage, mtp)  # one rank's view of every full tensor
    specs = {name: (getattr(param, "shard", None), getattr(param, "parts", None))
             for name, param in model.named_parameters()}
    return model, specs, _reads(model, whole, specs, files)


def _keep_fp8(model: CausalLM, plan: dict, quantized: set[str], tp_size: int, config: Any) -> dict:
    """fp8.convert, naming the TP degrees that keep whole blocks where this one does not."""
    try:
        return fp8.convert(model, plan, quantized, tp_size)
    except fp8.BlockSplitError as exc:
        raise ConfigError(f"{exc}; {fp8_degrees_note(config, quantized)}") from None


# a checkpoint tensor, this rank's slice of it ((dim, ranges), or a tuple of them), its full shape
Read = tuple[str, tuple | None, list[int]]


def _reads(model: CausalLM, whole: CausalLM, specs: dict, files: dict[str, Path]) -> dict[str, tuple[list[Read], bool]]:
    """Per parameter: the checkpoint tensors it is read from, and whether they are stacked rows
    of sibling tensors (.../in_proj.weight from .../in_proj_qkv.weight, ...)."""
    # multimodal wrappers keep the text model under model.language_model.
    text_prefix = "model.language_model." if any(k.startswith("model.language_model.") for k in files) else "model."

    def in_file(key: str) -> str:
        return text_prefix + key[len("model.") :] if key.startswith("model.") else key

    plan = {}
    for name, (spec, parts) in specs.items():
        experts = getattr(model.get_parameter(name), "experts", None)
        keys = [in_file(key) for key in sources(model, name, parts, experts)]
        shape = list(whole.get_parameter(name).shape)
        if experts is not None:
            sizes = whole.get_submodule(name.rsplit(".", 1)[0]).sizes if parts else []
            plan[name] = _expert_reads(keys[0], spec, parts, experts, shape, sizes, files)
        elif parts is None:
            plan[name] = ([(keys[0], spec, shape)], False)
        else:
            sizes = whole.get_submodule(name.rsplit(".", 1)[0]).sizes
            plan[name] = ([(key, (0, ranges), [rows, *shape[1:]])
                           for key, (_, ranges), rows in zip(keys, parts, sizes, strict=True)], True)
    return plan


def _check_shapes(plan: dict[str, tuple[list[Read], bool]], entries: dict[str, tuple[list[int], str]],
                  files: dict[str, Path], folder: Path) -> None:
    """Every tensor the plan reads is in the checkpoint, with the shape the config implies (from
    the safetensors headers, whose sizes match the files' bytes)."""
    for reads, _ in plan.values():
        for key, _, shape in reads:
            if key not in files:
                raise ConfigError(f"checkpoint in {folder} lacks tensor {key!r}")
            if key not in entries:
                raise ConfigError(f"{files[key]} lacks tensor {key!r}, which the checkpoint index puts there")
            found = entries[key][0]
            if found != shape:
                raise ConfigError(f"tensor {key!r} has shape {found}, the config implies {shape}")


def _expert_reads(key: str, spec: tuple | None, parts: list | None, experts: tuple[int, int], shape: list[int],
                  sizes: list[int], files: dict[str, Path]) -> tuple[list[Read], bool]:
    """The reads of a parameter holding experts [first, end) (layers.moe.Experts), whose spec and
    parts slice one expert's matrix: one read of the fused 3-D tensor `key` [E, ...] where the
    checkpoint has it, else one per expert of `{module}.{e}.{part}.weight`, stacked."""
    if key in files:
        if parts:  # the parts' rows lie one after the other in the fused tensor (gate rows first)
            starts = [sum(sizes[:i]) for i in range(len(sizes))]
            cut = (1, [(start + a, start + b) for start, (_, ranges) in zip(starts, parts) for a, b in ranges])
        else:
            cut = (spec[0] + 1, spec[1])
        return [(key, ((0, [experts]), cut), shape)], False
    module, leaf = key.rsplit(".", 1)
    if parts:
        return [(f"{module}.{e}.{part}.weight", (0, ranges), [rows, *shape[2:]])
                for e in range(*experts) for (part, ranges), rows in zip(parts, sizes, strict=True)], True
    return [(f"{module}.{e}.{leaf}.weight", spec, shape[1:]) for e in range(*experts)], True


def sources(model: CausalLM, name: str, parts: list | None, experts: tuple | None = None) -> list[str]:
    """The checkpoint tensors (text layout) parameter `name` is read from: one, or one per part of
    a stacked parameter (layers.parallel.stack); for experts, their fused tensor's name."""
    key = model.checkpoint_key(name)
    if parts is None or experts is not None:
        return [key]
    module, leaf = key.rsplit(".", 2)[0], key.rsplit(".", 1)[1]
    return [f"{module}.{part}.{leaf}" for part, _ in parts]


def checkpoint_keys(model: CausalLM) -> set[str]:
    """Every checkpoint tensor (text layout) the model's parameters are read from."""
    return {key for name, param in model.named_parameters()
            for key in sources(model, name, getattr(param, "parts", None), getattr(param, "experts", None))}


def _read_shard(full, spec: tuple | None) -> torch.Tensor:
    """Read the rows/columns of a checkpoint tensor a parameter holds: spec is (dim, ranges), or a
    tuple of them for cuts along several dims; ranges past the end (only the vocabulary's, padded up
    to a multiple of the group size) read as zeros."""
    if spec is None:
        return full[:]
    cuts = spec if isinstance(spec[0], tuple) else (spec,)
    return _read_cuts(full, list(cuts), [slice(None)] * len(full.get_shape()))


def _read_cuts(full, cuts: list[tuple[int, list]], index: list[slice]) -> torch.Tensor:
    if not cuts:
        return full[tuple(index)]
    (dim, ranges), rest = cuts[0], cuts[1:]
    size = full.get_shape()[dim]
    parts = []
    for start, end in ranges:
        index = [*index[:dim], slice(min(start, size), min(end, size)), *index[dim + 1 :]]
        part = _read_cuts(full, rest, index)
        missing = end - start - part.shape[dim]
        if missing:
            pad_shape = list(part.shape)
            pad_shape[dim] = missing
            part = torch.cat([part, part.new_zeros(pad_shape)], dim)
        parts.append(part)
    return torch.cat(parts, dim) if len(parts) > 1 else parts[0]
