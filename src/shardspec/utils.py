"""Small helpers shared by the worker, the orchestrator and the CLI."""

from __future__ import annotations

import logging
import re
import sys
from pathlib import Path

import torch

DTYPE_CHOICES = ("auto", "float32", "bfloat16", "float16")
_ADDRESS = re.compile(r"^(tcp://(\[[0-9a-fA-F:]+\]|[A-Za-z0-9_.-]+):\d{1,5}|ipc://.+)$")


def default_device() -> str:
    """Where spawned workers run unless told: "cuda" (a GPU each) where torch sees a GPU, else "cpu"."""
    return "cuda" if torch.cuda.is_available() else "cpu"


def parse_device(spec: str) -> torch.device:
    """'cpu', 'cuda' or 'cuda:N', checked against what this machine has."""
    if not re.fullmatch(r"cpu|cuda(:\d+)?", spec):
        raise ValueError(f"device must be cpu, cuda or cuda:N, got {spec!r}")
    device = torch.device(spec)
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"device {spec!r} asked for, but this machine has no CUDA GPU")
        index = device.index or 0
        if index >= torch.cuda.device_count():
            raise ValueError(f"device {spec!r} asked for, but this machine has {torch.cuda.device_count()} GPUs")
        device = torch.device("cuda", index)
    return device


def check_address(address: str) -> str:
    """A ZeroMQ endpoint shardspec accepts: tcp://HOST:PORT or ipc://PATH."""
    if not _ADDRESS.match(address):
        raise ValueError(f"address must be tcp://HOST:PORT or ipc://PATH, got {address!r}")
    if address.startswith("tcp://") and not 0 < int(address.rsplit(":", 1)[1]) < 65536:
        raise ValueError(f"port out of range in {address!r}")
    return address


def resolve_dtype(name: str, checkpoint_dtype: torch.dtype, device: torch.device) -> torch.dtype:
    """'auto' is the checkpoint's dtype (models.checkpoint.Checkpoint.dtype) on CPU and bfloat16 on a GPU."""
    if name not in DTYPE_CHOICES:
        raise ValueError(f"dtype must be one of {DTYPE_CHOICES}, got {name!r}")
    if name != "auto":
        return getattr(torch, name)
    return torch.bfloat16 if device.type == "cuda" else checkpoint_dtype


def memory_stats() -> dict[str, int]:
    """Resident memory of this process (Linux /proc), in bytes; zeros where unavailable."""
    stats = {"rss_bytes": 0, "rss_anon_bytes": 0}
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            key, _, value = line.partition(":")
            if key in ("VmRSS", "RssAnon"):
                stats["rss_bytes" if key == "VmRSS" else "rss_anon_bytes"] = int(value.split()[0]) * 1024
    except OSError:
        pass
    return stats


def setup_logging(name: str, level: str = "INFO") -> None:
    logging.basicConfig(
        stream=sys.stderr,
        level=level.upper(),
        format=f"%(asctime)s.%(msecs)03d %(levelname)s {name} %(message)s",
        datefmt="%Y-%m-%d %H:%M:%S",
    )


SIZE_UNITS = {"": 1, "b": 1, "k": 10**3, "kb": 10**3, "kib": 2**10, "m": 10**6, "mb": 10**6, "mib": 2**20,
              "g": 10**9, "gb": 10**9, "gib": 2**30, "t": 10**12, "tb": 10**12, "tib": 2**40}


def parse_size(text: str) -> int:
    """'16MiB', '2GiB', '512MB', '1e9' -> bytes; ValueError naming the units otherwise."""
    number = text.strip().lower().rstrip("abcdefghijklmnopqrstuvwxyz")
    unit = text.strip().lower()[len(number) :].strip()
    try:
        value = float(number)
    except ValueError:
        value = -1.0
    if unit not in SIZE_UNITS or not value > 0 or value * SIZE_UNITS[unit] >= 2**60:
        raise ValueError(f"{text!r} is not a size: a positive number of bytes, or with a unit such as 512MiB or "
                         "2GiB (KiB, MiB, GiB, TiB; KB, MB, GB, TB)")
    return int(value * SIZE_UNITS[unit])


IPC_PATH = re.compile(r"ipc://(?:\S*/)?([^/\s]+)")
FILE_PATH = re.compile(r"(?<![\w.:/~-])/(?:[^\s/'\"]+/)*")  # an absolute path's folders (not a URL's)


def public(text: str) -> str:
    """`text` with each ipc:// address cut to its socket's file name: what an operator's view shows
    (no folder of this machine)."""
    return IPC_PATH.sub(r"ipc:\1", text)


def public_reason(text: str, limit: int = 200) -> str:
    """A failure's first line, bounded, with no folder of this machine (an ipc:// address or a file
    shows its name only): what a client is told (no log tails, no tracebacks, no paths)."""
    line = FILE_PATH.sub("", public(text.strip().split("\n", 1)[0])).rstrip(":").strip()
    return line if len(line) <= limit else line[: limit - 3] + "..."
