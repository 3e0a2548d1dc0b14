"""The ops of model transfer: a worker that lacks the model receives its stage's tensors from the
orchestrator (`shards`: what it lacks; `chunk`: a piece of one tensor). protocol.messages puts them
in the op set and re-exports them."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

from shardspec.protocol.fields import bounded, text

MAX_CHUNK_BYTES = 16 << 20  # one chunk of a tensor on the wire


@dataclass(frozen=True)
class ShardsRequest:
    """The orchestrator offers the model the next load names (`model`, contents `key`): which of its
    stage's tensors and of the small `files` does this rank lack? Tensor frames `config` (config.json)
    and `index` (the checkpoint index's JSON, its weight map complete), uint8."""

    OP: ClassVar[str] = "shards"
    model: str
    key: str = text(64)
    layer_split: list[int] = field(default_factory=list)
    mtp: str = "auto"  # as LoadRequest.mtp
    files: list[str] = field(default_factory=list)  # small files it can send (tokenizer.json, ...)

    def __post_init__(self) -> None:
        if len(self.key) != 64 or not set(self.key) <= set("0123456789abcdef"):
            raise ValueError("key must be a sha256 in hex")
        if self.mtp not in ("auto", "on", "off"):
            raise ValueError(f"mtp must be 'auto', 'on' or 'off', got {self.mtp!r}")


@dataclass(frozen=True)
class ItemNeed:
    """A tensor ("tensor:NAME") or small file ("file:NAME") a worker lacks, and the bytes of it it
    already holds from a transfer that stopped (sent again from there)."""

    item: str = text(1024)
    have: int = bounded(0, 1 << 50, 0)


@dataclass(frozen=True)
class ShardsReply:
    """Where the rank will load from: its "folder", its "cache", the "hub", or what the orchestrator
    must "send" first (`need`)."""

    OP: ClassVar[str] = "shards"
    source: str
    need: list[ItemNeed] = field(default_factory=list)


@dataclass(frozen=True)
class ChunkRequest:
    """Bytes [offset, offset + len) of item `item` (its blob: `total` bytes, sha256 `blob_sha256`,
    given on the last chunk) of model `key`, in tensor frame `data` (uint8, at most MAX_CHUNK_BYTES);
    `sha256`: the chunk's. A chunk starts where the worker's held bytes end (0: again from the start)."""

    OP: ClassVar[str] = "chunk"
    key: str = text(64)
    item: str = text(1024)
    offset: int = bounded(0, 1 << 50, 0)
    total: int = bounded(1, 1 << 50, 1)
    sha256: str = text(64)
    blob_sha256: str = text(64)

    def __post_init__(self) -> None:
        if self.offset >= self.total:
            raise ValueError(f"offset {self.offset} is not below total {self.total}")


@dataclass(frozen=True)
class ChunkReply:
    OP: ClassVar[str] = "chunk"
    item: str
    held: int  # bytes of the item the worker holds now
    done: bool  # the item is whole, checked and in the cache
