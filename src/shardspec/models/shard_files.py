"""A checkpoint's tensors one at a time, as the orchestrator sends them to a worker that lacks them
(one safetensors file per tensor: a blob), and the checkpoint a worker loads from the blobs it
holds (`CachedCheckpoint`). Also a model's key: what identifies its contents in a worker's cache."""

from __future__ import annotations

import hashlib
import json
import struct
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path

from shardspec.models.checkpoint import Checkpoint
from shardspec.models.config import MAX_CONFIG_BYTES, ConfigError, open_regular, read_json

INDEX_FILE = "model.safetensors.index.json"


@dataclass(frozen=True)
class TensorSpan:
    """Where a tensor's bytes lie in its safetensors file, and the header of its blob."""

    file: Path
    start: int  # absolute offset in the file
    end: int
    header: bytes  # the blob's: 8-byte length, then JSON naming this one tensor

    @property
    def blob_bytes(self) -> int:
        return len(self.header) + self.end - self.start


def tensor_spans(file: Path) -> dict[str, TensorSpan]:
    """Every tensor of a safetensors file, where its bytes are (checkpoint.read_entries has checked
    the header and the file's length)."""
    with open_regular(file) as f:
        (length,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(length))
    header.pop("__metadata__", None)
    base = 8 + length
    return {name: TensorSpan(file, base + entry["data_offsets"][0], base + entry["data_offsets"][1],
                             blob_header(name, entry["dtype"], entry["shape"], *entry["data_offsets"]))
            for name, entry in header.items()}


def blob_header(name: str, dtype: str, shape: list[int], start: int, end: int) -> bytes:
    """The header of a safetensors file holding tensor `name` alone (padded to 8 bytes, as safetensors writes)."""
    text = json.dumps({name: {"dtype": dtype, "shape": shape, "data_offsets": [0, end - start]}},
                      separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text


def weight_map(checkpoint: Checkpoint) -> dict[str, str]:
    """Tensor name -> the file name that holds it, for every tensor of the checkpoint."""
    return {name: path.name for name, path in checkpoint.files.items()}


def folder_key(checkpoint: Checkpoint) -> str:
    """The key of a model folder's contents: config.json and, per safetensors file, its name, size,
    modification time and header (hashing every byte of a large model would take minutes; a file
    rewritten in place changes its time)."""
    digest = hashlib.sha256(json.dumps(checkpoint.raw, sort_keys=True).encode())
    for path in sorted(set(checkpoint.files.values())):
        info = path.stat()
        digest.update(f"\0{path.name}\0{info.st_size}\0{info.st_mtime_ns}\0".encode())
        with open_regular(path) as f:
            (length,) = struct.unpack("<Q", f.read(8))
            digest.update(f.read(min(length, 100 << 20)))
    return digest.hexdigest()


def hub_key(pinned: str) -> str:
    """The key of a Hub model pinned to a commit (ORG/NAME@COMMIT): its commit fixes every byte."""
    return hashlib.sha256(f"hub:{pinned}".encode()).hexdigest()


class CachedCheckpoint(Checkpoint):
    """A checkpoint in a worker's shard cache (shard_worker.shard_cache): config.json and the index
    in its folder, the tensors it holds in blobs (`blobs`: tensor name -> blob path); a tensor it
    does not hold maps to a path that does not exist, read only if asked for."""

    @classmethod
    def open_cached(cls, folder: Path, blobs: dict[str, Path]) -> CachedCheckpoint:
        checkpoint = cls.open(folder)
        checkpoint.__dict__["blobs"] = blobs
        return checkpoint

    @cached_property
    def files(self) -> dict[str, Path]:
        index = read_json(self.folder / INDEX_FILE, MAX_CONFIG_BYTES)
        names = index.get("weight_map") if isinstance(index, dict) else None
        if not isinstance(names, dict):
            raise ConfigError(f"{self.folder / INDEX_FILE} must hold a weight_map")
        blobs = self.__dict__.get("blobs", {})
        return {name: blobs.get(name, self.folder / "absent" / str(file)) for name, file in names.items()}
