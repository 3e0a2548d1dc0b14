"""Build a rank's shard of a model stage and fill it from a Hugging Face folder, reading only its
slices of the tensors the stage holds."""

from __future__ import annotations

from collections.abc import Callable
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from torch import nn

from shardspec import kernels
from shardspec.layers.fp8 import FP8, BlockSplitError
from shardspec.layers.linear import after_loading
from shardspec.layers.parallel import WHOLE, SliceSpec, TPGroup, slice_specs
from shardspec.layers.quantization import QuantConfig
from shardspec.models import fp8
from shardspec.models.base import CausalLM, Stage, split_config
from shardspec.models.checkpoint import Checkpoint, fp8_degrees_note
from shardspec.models.config import ConfigError, check_regular

Progress = Callable[[int, int, int, int], None]  # (tensors read, of, bytes read, of)


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
    layout = _Layout(files)
    with torch.device("meta"):
        whole = family.build(config, TPGroup(), stage, mtp, None)  # one rank's view of every full tensor
    read_keys = {key for reads, _ in _reads(whole, whole, layout).values() for key, _, _ in reads}
    entries = checkpoint.entries(read_keys | {fp8.scale_key(key) for key in read_keys})
    quantized = fp8.quantized_keys(entries, checkpoint.quantization, checkpoint.folder)
    keep_fp8 = bool(quantized) and (fp8_native_default(device) if fp8_native is None else fp8_native)
    quant = QuantConfig({layout.text_key(key): tuple(entries[key][0]) for key in quantized}) if keep_fp8 else None
    model = _build(family, config, tp, stage, mtp, expert_parallel, quant, quantized)
    plan = _reads(model, whole, layout)
    # before allocating: the checkpoint really holds every tensor the config implies
    _check_shapes(plan, entries, files, checkpoint.folder)
    _cast(model, dtype)
    model = model.to_empty(device=device)  # the layers' slice specs stay theirs: nothing to re-attach
    raw = {key for name, (reads, _) in plan.items() if model.get_parameter(name).dtype == FP8
           for key, _, _ in reads}  # read as they are; other FP8 tensors are dequantised

    params = list(model.named_parameters())
    total_bytes, done_bytes = sum(p.numel() * p.element_size() for _, p in params), 0
    experts = {name for name, spec in slice_specs(model).items() if spec.experts is not None}
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
            done_bytes += param.numel() * param.element_size()
            if progress:
                progress(done, len(params), done_bytes, total_bytes)
    after_loading(model)
    return model


def stage_keys(checkpoint: Checkpoint, stage: Stage, mtp: bool) -> set[str]:
    """The checkpoint tensors (as the files name them) that `stage` reads at any TP rank, with the
    block scales of its FP8 weights: what a worker of that stage needs on its disk."""
    layout = _Layout(checkpoint.files)
    with torch.device("meta"):
        whole = checkpoint.family.build(checkpoint.config, TPGroup(), stage, mtp, None)
    keys = {key for reads, _ in _reads(whole, whole, layout).values() for key, _, _ in reads}
    return keys | {fp8.scale_key(key) for key in keys if fp8.scale_key(key) in checkpoint.files}


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


class _Layout:
    """Where a checkpoint keeps its text model: `model.`, or `model.language_model.` in the
    multimodal wrappers."""

    def __init__(self, files: dict[str, Path]):
        self.files = files
        wrapped = any(key.startswith("model.language_model.") for key in files)
        self.prefix = "model.language_model." if wrapped else "model."

    def file_key(self, key: str) -> str:
        return self.prefix + key.removeprefix("model.") if key.startswith("model.") else key

    def text_key(self, key: str) -> str:
        return "model." + key.removeprefix(self.prefix) if key.startswith(self.prefix) else key


def _build(family, config, tp: TPGroup, stage: Stage, mtp: bool, ep: int, quant: QuantConfig | None,
           quantized: set[str]) -> CausalLM:
    """A rank's model (its experts over ep groups of the ranks) on the meta device; ConfigError
    naming the TP degrees that keep whole FP8 blocks where its slice of one would split them."""
    try:
        with torch.device("meta"):
            return family.build(split_config(config, tp.size, ep) if ep != 1 else config, tp, stage, mtp, quant)
    except BlockSplitError as exc:
        raise ConfigError(f"tensor-parallel degree {tp.size} {exc}; {fp8_degrees_note(config, quantized)}") from None


def _cast(model: nn.Module, dtype: torch.dtype) -> None:
    """Every parameter in `dtype` but those whose layer fixed theirs (`fixed_dtypes`: FP8 weights,
    their fp32 scales)."""
    for module in model.modules():
        fixed = getattr(module, "fixed_dtypes", ())
        for leaf, param in list(module.named_parameters(recurse=False)):
            if leaf not in fixed and param.dtype != dtype:
                setattr(module, leaf, nn.Parameter(param.to(dtype), requires_grad=False))


# a checkpoint tensor, this rank's slice of it ((dim, ranges), or a tuple of them), its full shape
Read = tuple[str, tuple | None, list[int]]


def _reads(model: CausalLM, whole: CausalLM, layout: _Layout) -> dict[str, tuple[list[Read], bool]]:
    """Per parameter: the checkpoint tensors it is read from, and whether they are stacked rows
    of sibling tensors (.../in_proj.weight from .../in_proj_qkv.weight, ...). `whole`, the stage
    unquantised at TP 1, holds every tensor's full shape."""
    plan = {}
    for name, spec in slice_specs(model).items():
        module, _, leaf = name.rpartition(".")
        source = f"{module}.{spec.source or leaf}"
        keys = [layout.file_key(key) for key in sources(model, name, spec)]
        shape = list(whole.get_parameter(source).shape)
        if spec.experts is not None:
            plan[name] = _expert_reads(keys[0], spec, shape, _part_rows(whole, source), layout.files)
        elif spec.parts is None:
            plan[name] = ([(keys[0], spec.cut, _in_blocks(shape, spec.block))], False)
        else:
            rows = _part_rows(whole, source)
            plan[name] = ([(key, (0, ranges), _in_blocks([rows[part], *shape[1:]], spec.block))
                           for key, (part, ranges) in zip(keys, spec.parts, strict=True)], True)
    return plan


def _in_blocks(shape: list[int], block: int) -> list[int]:
    """The shape of the block scales of a weight of `shape` (block 0: the weight's own)."""
    return [-(-n // block) for n in shape] if block else shape


def _part_rows(whole: CausalLM, source: str) -> dict[str, int]:
    """The full rows of each part of a stacked parameter, by part name ({} for another)."""
    module, _, leaf = source.rpartition(".")
    layer = whole.get_submodule(module)
    parts = getattr(layer, "slice_specs", {}).get(leaf, WHOLE).parts or ()
    return dict(zip((part for part, _ in parts), layer.sizes)) if parts else {}


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


def _expert_reads(key: str, spec: SliceSpec, shape: list[int], rows: dict[str, int],
                  files: dict[str, Path]) -> tuple[list[Read], bool]:
    """The reads of a parameter holding whole experts (layers.moe.Experts), whose spec's cut or
    parts slice one expert's matrix (`rows`: each part's): one read of the fused 3-D tensor `key`
    [E, ...] where the checkpoint has it, else one per expert of `{module}.{e}.{part}.weight`, stacked."""
    experts = spec.experts
    if key in files:
        if spec.parts:  # the parts' rows lie one after the other in the fused tensor (gate rows first)
            starts = [sum(list(rows.values())[:i]) for i in range(len(rows))]
            cut = (1, [(start + a, start + b) for start, (_, ranges) in zip(starts, spec.parts) for a, b in ranges])
        else:
            cut = (spec.cut[0] + 1, spec.cut[1])
        return [(key, ((0, [experts]), cut), shape)], False
    module, leaf = key.rsplit(".", 1)
    if spec.parts:
        return [(f"{module}.{e}.{part}.weight", (0, ranges), [rows[part], *shape[2:]])
                for e in range(*experts) for part, ranges in spec.parts], True
    return [(f"{module}.{e}.{leaf}.weight", spec.cut, shape[1:]) for e in range(*experts)], True


def sources(model: CausalLM, name: str, spec: SliceSpec) -> list[str]:
    """The checkpoint tensors (text layout) parameter `name` is read from: one, or one per part of
    a stacked parameter; for experts, their fused tensor's name; for block scales, the scales'."""
    module, _, leaf = name.rpartition(".")
    key = model.checkpoint_key(f"{module}.{spec.source or leaf}")
    keys = [key]
    if spec.parts is not None and spec.experts is None:
        parent, leaf = key.rsplit(".", 2)[0], key.rsplit(".", 1)[1]
        keys = [f"{parent}.{part}.{leaf}" for part, _ in spec.parts]
    return [fp8.scale_key(key) for key in keys] if spec.block else keys


def checkpoint_keys(model: CausalLM) -> set[str]:
    """Every checkpoint tensor (text layout) the model's parameters are read from."""
    return {key for name, spec in slice_specs(model).items() for key in sources(model, name, spec)}


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
