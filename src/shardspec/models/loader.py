"""Build a rank's shard of a model stage and fill it from a Hugging Face folder, reading only its
slices of the tensors the stage holds."""

from __future__ import annotations

import json
import math
import os
import struct
from collections.abc import Callable
from contextlib import ExitStack
from pathlib import Path, PurePosixPath
from typing import Any

import torch
from safetensors import safe_open

from shardspec import kernels
from shardspec.layers.fp8 import FP8, prepare_kernels
from shardspec.layers.parallel import TPGroup
from shardspec.models import fp8, registry
from shardspec.models.base import CausalLM, Stage, split_config, split_layers
from shardspec.models.config import MAX_CONFIG_BYTES, ConfigError, check_regular, open_regular, read_config, read_json

Progress = Callable[[int, int], None]
MAX_FP8_TP = 64  # the largest TP degree an FP8 refusal considers when it names the degrees that work
MAX_HEADER_BYTES = 100 * 2**20  # a safetensors header (the safetensors library's own limit)
DTYPE_BYTES = {"BOOL": 1, "U8": 1, "I8": 1, "F8_E5M2": 1, "F8_E4M3": 1, "F8_E8M0": 1, "I16": 2, "U16": 2,
               "F16": 2, "BF16": 2, "I32": 4, "U32": 4, "F32": 4, "I64": 8, "U64": 8, "F64": 8}


def checkpoint_files(folder: Path) -> dict[str, Path]:
    """Map every tensor name of the checkpoint to the file that holds it."""
    index = folder / "model.safetensors.index.json"
    if index.exists():
        contents = read_json(index, MAX_CONFIG_BYTES)
        weight_map = contents.get("weight_map") if isinstance(contents, dict) else None
        if not isinstance(weight_map, dict) or not all(isinstance(f, str) for f in weight_map.values()):
            raise ConfigError(f"{index} must hold a weight_map of tensor names to file names")
        return {name: _shard_file(folder, file) for name, file in weight_map.items()}
    single = folder / "model.safetensors"
    if not single.exists():
        raise ConfigError(f"{folder} has neither model.safetensors nor model.safetensors.index.json")
    return dict.fromkeys(read_header(single), single)


def read_header(file: Path) -> dict[str, list[int]]:
    """Every tensor's shape in a safetensors file (read_entries)."""
    return {name: shape for name, (shape, _) in read_entries(file).items()}


def read_entries(file: Path) -> dict[str, tuple[list[int], str]]:
    """Every tensor's (shape, dtype) in a safetensors file, from its header, read only if the file
    is a regular one whose header is bounded and whose tensors' bytes are all in the file."""
    with open_regular(file) as f:
        size = os.fstat(f.fileno()).st_size
        length_bytes = f.read(8)
        if len(length_bytes) < 8:
            raise ConfigError(f"{file} is not a safetensors file (shorter than its header length)")
        (length,) = struct.unpack("<Q", length_bytes)
        if length > min(MAX_HEADER_BYTES, size - 8):
            raise ConfigError(f"{file}: a safetensors header of {length} bytes in a file of {size} bytes")
        raw = f.read(length)
    try:
        header = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ConfigError(f"{file}: unreadable safetensors header ({exc})") from None
    if not isinstance(header, dict):
        raise ConfigError(f"{file}: the safetensors header is not a JSON object")
    header.pop("__metadata__", None)
    entries = {name: (_entry_shape(file, name, entry), entry["dtype"]) for name, entry in header.items()}
    end = max((entry["data_offsets"][1] for entry in header.values()), default=0)
    if 8 + length + end > size:
        raise ConfigError(f"{file} is {size} bytes, its header says its tensors need {8 + length + end}: truncated?")
    return entries


def _entry_shape(file: Path, name: str, entry: object) -> list[int]:
    """A header entry's shape, once its data offsets are seen to hold exactly that many bytes."""
    if isinstance(entry, dict):
        shape, dtype, offsets = entry.get("shape"), entry.get("dtype"), entry.get("data_offsets")
        if (isinstance(shape, list) and all(type(n) is int and n >= 0 for n in shape) and dtype in DTYPE_BYTES
                and isinstance(offsets, list) and len(offsets) == 2 and all(type(n) is int for n in offsets)
                and offsets[0] >= 0 and offsets[1] - offsets[0] == math.prod(shape) * DTYPE_BYTES[dtype]):
            return shape
    raise ConfigError(f"{file}: tensor {name!r} has a malformed safetensors header entry (its shape, dtype and "
                      "data offsets must agree)")


def _shard_file(folder: Path, name: str) -> Path:
    """A file named by the index: a plain name inside the folder, never a path out of it."""
    parts = PurePosixPath(name).parts
    if not parts or PurePosixPath(name).is_absolute() or ".." in parts:
        raise ConfigError(f"the checkpoint index names {name!r}; shard files must be inside the model folder")
    return folder / name


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
    fp8_native: bool | None = None,
    expert_parallel: int = 1,
) -> CausalLM:
    """This rank's shard of `stage` (default: the whole model), weights in `dtype` on `device`, its
    experts (if any) split over `expert_parallel` groups of the ranks (layers.moe); peak host memory
    ≈ the shard, not the model. The FP8 weights of an FP8 checkpoint stay FP8 where fp8_native
    (default: on a GPU with FP8, compute capability 8.9 or later), else are dequantised."""
    folder = Path(folder)
    family, config = registry.read(folder)
    split_config(config, tp.size, expert_parallel)  # ConfigError naming the degrees that work
    stage = stage or Stage.whole(config.num_hidden_layers)
    files = checkpoint_files(folder)
    mtp_present = family.has_mtp(files)
    if with_mtp and not mtp_present:
        raise ConfigError(f"{folder} has no MTP weights ({family.draft_prefix or 'its family has no MTP'}*)")
    mtp = mtp_present if with_mtp is None else with_mtp
    model, specs, plan = _plan(family, config, tp, stage, mtp, files, expert_parallel)
    experts = {name: param.experts for name, param in model.named_parameters() if hasattr(param, "experts")}
    entries = _entries(plan, files)
    quantized = fp8.quantized_keys(entries, fp8.read_format(read_config(folder)), folder)
    model = model.to(dtype)
    if quantized and (fp8_native_default(device) if fp8_native is None else fp8_native):
        plan = _keep_fp8(model, plan, quantized, tp.size, (family, config, stage, mtp, files))
    # before allocating: the checkpoint really holds every tensor the config implies
    _check_shapes(plan, entries, files, folder)
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


def check_quantization(folder: str | Path, tp_size: int, fp8_native: bool, expert_parallel: int = 1) -> None:
    """The checks load_model makes of an FP8 checkpoint, for every rank, without reading a tensor:
    a supported quantization, and (kept FP8) slices of whole blocks. ConfigError otherwise."""
    folder = Path(folder)
    family, config = registry.read(folder)
    split_config(config, tp_size, expert_parallel)
    files = checkpoint_files(folder)
    stage, mtp = Stage.whole(config.num_hidden_layers), family.has_mtp(files)
    fmt = fp8.read_format(read_config(folder))
    for rank in range(tp_size if fp8_native else 1):
        model, _, plan = _plan(family, config, TPGroup(rank, tp_size), stage, mtp, files, expert_parallel)
        quantized = fp8.quantized_keys(_entries(plan, files), fmt, folder)
        if not quantized or not fp8_native:
            return
        _keep_fp8(model, plan, quantized, tp_size, (family, config, stage, mtp, files))


def _plan(family, config, tp: TPGroup, stage: Stage, mtp: bool, files: dict[str, Path], ep: int = 1):
    """A rank's model (its experts over ep groups of the ranks) on the meta device, its parameters'
    slice specs, and where each is read from."""
    with torch.device("meta"):
        model = family.build(split_config(config, tp.size, ep) if ep != 1 else config, tp, stage, mtp)
        whole = family.build(config, TPGroup(), stage, mtp)  # one rank's view of every full tensor
    specs = {name: (getattr(param, "shard", None), getattr(param, "parts", None))
             for name, param in model.named_parameters()}
    return model, specs, _reads(model, whole, specs, files)


def _keep_fp8(model: CausalLM, plan: dict, quantized: set[str], tp_size: int, build: tuple) -> dict:
    """fp8.convert, naming the TP degrees that keep whole blocks where this one does not."""
    try:
        return fp8.convert(model, plan, quantized, tp_size)
    except fp8.BlockSplitError as exc:
        raise ConfigError(f"{exc}; on a GPU, where FP8 weights stay FP8, the TP degrees that keep whole blocks are "
                          f"{_whole_block_degrees(quantized, *build)} (on a CPU any degree works: it dequantises "
                          "at load)") from None


def _whole_block_degrees(quantized: set[str], family, config, stage: Stage, mtp: bool, files) -> list[int]:
    degrees = []
    for size in range(1, MAX_FP8_TP + 1):
        try:
            config.check_tp(size)
            for rank in range(size):
                model, _, plan = _plan(family, config, TPGroup(rank, size), stage, mtp, files)
                fp8.convert(model, plan, quantized, size)
        except ConfigError:
            continue
        degrees.append(size)
    return degrees


def _entries(plan: dict, files: dict[str, Path]) -> dict[str, tuple[list[int], str]]:
    """(shape, dtype) from the safetensors headers of every tensor the plan reads, and of their
    FP8 scales; a tensor the checkpoint lacks is left out (_check_shapes names it)."""
    keys = {key for reads, _ in plan.values() for key, _, _ in reads}
    keys |= {fp8.scale_key(key) for key in keys}
    headers: dict[Path, dict] = {}
    entries = {}
    for key in sorted(keys & files.keys()):
        if files[key] not in headers:
            headers[files[key]] = read_entries(files[key])
        if key in headers[files[key]]:
            entries[key] = headers[files[key]][key]
    return entries


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
