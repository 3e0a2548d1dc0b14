"""A Hugging Face checkpoint folder, opened once: its family and parsed config, config.json itself,
its dtype and quantization; its safetensors files, their headers and whether it holds MTP weights,
each read the first time it is asked for. The orchestrator validates a model from it without
building one; the worker assigns its stage and loads from it (models.loader)."""

from __future__ import annotations

import json
import math
import os
import struct
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path, PurePosixPath
from typing import Any

import torch

from shardspec.models import fp8, registry
from shardspec.models.base import Stage, split_config, split_layers
from shardspec.models.config import MAX_CONFIG_BYTES, ConfigError, open_regular, read_config, read_json, text_config
from shardspec.models.registry import Family

MAX_HEADER_BYTES = 100 * 2**20  # a safetensors header (the safetensors library's own limit)
DTYPE_BYTES = {"BOOL": 1, "U8": 1, "I8": 1, "F8_E5M2": 1, "F8_E4M3": 1, "F8_E8M0": 1, "I16": 2, "U16": 2,
               "F16": 2, "BF16": 2, "I32": 4, "U32": 4, "F32": 4, "I64": 8, "U64": 8, "F64": 8}
DTYPES = ("float32", "bfloat16", "float16")  # the weights' dtypes the engine runs in
Entries = dict[str, tuple[list[int], str]]  # checkpoint key -> (shape, safetensors dtype)


@dataclass(frozen=True, eq=False)
class Checkpoint:
    folder: Path
    raw: dict[str, Any]  # config.json
    family: Family
    config: Any  # the family's config (models.base.ModelConfig)
    quantization: fp8.Fp8Format | None  # None: unquantised
    _headers: dict[Path, Entries] = field(default_factory=dict, repr=False)  # each file's, read once

    @classmethod
    def open(cls, folder: str | Path) -> Checkpoint:
        """The checkpoint in `folder`: ConfigError where config.json is missing, unreadable, names a
        family shardspec does not run, or a quantization it does not support."""
        raw = read_config(folder)
        family = registry.resolve(raw)
        return cls(Path(folder), raw, family, family.parse_config(raw), fp8.read_format(raw))

    @property
    def dtype(self) -> torch.dtype:
        """The dtype config.json names (text_config first); float32 where it names none of DTYPES."""
        text = text_config(self.raw)
        name = text.get("dtype") or text.get("torch_dtype") or self.raw.get("torch_dtype")
        return getattr(torch, name) if name in DTYPES else torch.float32

    @cached_property
    def files(self) -> dict[str, Path]:
        """Every tensor name of the checkpoint -> the file that holds it."""
        return checkpoint_files(self.folder, self._header)

    @cached_property
    def has_mtp(self) -> bool:
        """Whether the checkpoint holds its family's MTP weights (tensor names only)."""
        return self.family.has_mtp(self.files)

    def entries(self, keys: Iterable[str]) -> Entries:
        """(shape, dtype) of each of `keys` the checkpoint holds, from its files' headers; a key it
        lacks is left out (the loader names it)."""
        found = {}
        for key in sorted(set(keys) & self.files.keys()):
            header = self._header(self.files[key])
            if key in header:
                found[key] = header[key]
        return found

    def stage(self, index: int, stages: int, layer_split: list[int] | None = None) -> Stage:
        """Stage `index` of `stages` (layer_split: layers per stage, or as even as can be)."""
        return split_layers(self.config.num_hidden_layers, stages, layer_split)[index]

    def check_split(self, stages: int, layer_split: list[int] | None, tp: int, ep: int = 1) -> None:
        """ConfigError, naming what works, unless the layers split into the stages and each stage
        over tp ranks in ep expert groups."""
        split_layers(self.config.num_hidden_layers, stages, layer_split)
        split_config(self.config, tp, ep)

    def fp8_weights(self, keys: Iterable[str] | None = None) -> set[str]:
        """The FP8 weights among `keys` (default: all), each checked to have its block scales."""
        keys = self.files.keys() if keys is None else keys
        keys = set(keys) | {fp8.scale_key(key) for key in keys}
        return fp8.quantized_keys(self.entries(keys), self.quantization, self.folder)

    def check_quantization(self, tp: int, fp8_native: bool) -> None:
        """A quantised checkpoint's FP8 weights have their scales and, kept FP8 (`fp8_native`, a
        GPU), each rank's slice of them is whole 128 × 128 blocks. ConfigError otherwise."""
        if self.quantization is None:
            return
        quantized = self.fp8_weights()
        problem = fp8.split_problem(self.config, tp, quantized) if fp8_native else None
        if problem is not None:
            raise ConfigError(f"{problem}; {fp8_degrees_note(self.config, quantized)}")

    def _header(self, file: Path) -> Entries:
        if file not in self._headers:
            self._headers[file] = read_entries(file)
        return self._headers[file]


def fp8_degrees_note(config: Any, quantized: set[str]) -> str:
    """The TP degrees that keep the FP8 weights' blocks whole, in words, for a refusal."""
    degrees = fp8.whole_block_degrees(config, quantized)
    listed = "" if degrees is None else f", the TP degrees that keep whole blocks are {degrees}"
    return f"on a GPU, where FP8 weights stay FP8{listed} (on a CPU any degree works: it dequantises at load)"


def checkpoint_files(folder: Path, header: Callable[[Path], Entries] | None = None) -> dict[str, Path]:
    """Map every tensor name of the checkpoint to the file that holds it (a single file's names
    from `header`, default read_entries)."""
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
    return dict.fromkeys((header or read_entries)(single), single)


def read_entries(file: Path) -> Entries:
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
