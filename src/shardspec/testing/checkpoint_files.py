"""Hugging Face checkpoint folders: the two name layouts, config.json, and safetensors files
written as tensors stream in (sharded, with an index, for large ones)."""

from __future__ import annotations

import json
import math
import os
import struct
import sys
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch
from torch import Tensor

LAYOUTS = ("model", "language_model")
PROGRESS_MIN_BYTES = 1 << 30  # report write progress on stderr from this checkpoint size up

_ST_DTYPES = {
    torch.float8_e4m3fn: "F8_E4M3",
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
}


def layout_name(name: str, layout: str) -> str:
    """Rename a text-layout parameter name for a checkpoint layout."""
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    if layout == "language_model" and name.startswith("model."):
        return "model.language_model." + name.removeprefix("model.")
    return name


def text_layout_name(name: str) -> str:
    """Undo `layout_name`: map a checkpoint name of either layout to the text layout."""
    if name.startswith("model.language_model."):
        return "model." + name.removeprefix("model.language_model.")
    return name


def checkpoint_config(config: dict, layout: str) -> dict:
    """The config.json contents for a text config written in `layout`."""
    text = {k: v for k, v in config.items() if k not in ("architectures", "quantization_config")}
    top = {"quantization_config": config["quantization_config"]} if "quantization_config" in config else {}
    moe = "Moe" if "num_experts" in config else ""
    if layout == "model":
        return {**text, "architectures": [f"Qwen3_5{moe}ForCausalLM"], **top}
    if layout == "language_model":
        return {
            "model_type": "qwen3_5_moe" if moe else "qwen3_5",
            "architectures": [f"Qwen3_5{moe}ForConditionalGeneration"],
            "text_config": text,
            "tie_word_embeddings": text.get("tie_word_embeddings", False),
            **top,
        }
    raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")


def _split(sizes: list[int], shards: int) -> list[int]:
    """Shard index of each tensor: contiguous groups of roughly equal byte size."""
    if not 1 <= shards <= len(sizes):
        raise ValueError(f"shards must be in [1, {len(sizes)}], got {shards}")
    total, done, shard, out = sum(sizes), 0, 0, []
    for i, size in enumerate(sizes):
        target = min(done * shards // total, shard + 1, shards - 1)
        # but leave at least one tensor for every later shard
        shard = max(shard, target, shards - (len(sizes) - i))
        out.append(shard)
        done += size
    return out


def _write_safetensors(
    file: Path,
    entries: list[tuple[str, tuple[int, ...], torch.dtype]],
    get: Callable[[], Iterator[Tensor | None]],
    progress: Callable[[int], None],
) -> None:
    """Stream tensors into a safetensors file in the order `get` yields them; None leaves a hole (the
    tensor reads as zeros and takes no disk space)."""
    header: dict = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name, shape, dtype in entries:
        nbytes = math.prod(shape) * dtype.itemsize
        header[name] = {
            "dtype": _ST_DTYPES[dtype],
            "shape": list(shape),
            "data_offsets": [offset, offset + nbytes],
        }
        offset += nbytes
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)
    with open(file, "wb") as f:
        f.write(struct.pack("<Q", len(blob)) + blob)
        for (name, shape, dtype), tensor in zip(entries, get(), strict=True):
            if tensor is None:
                f.seek(math.prod(shape) * dtype.itemsize, os.SEEK_CUR)
                continue
            if tuple(tensor.shape) != shape or tensor.dtype != dtype:
                raise ValueError(
                    f"{name}: expected {shape} {dtype}, got {tuple(tensor.shape)} {tensor.dtype}"
                )
            f.write(tensor.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().data)
            progress(tensor.numel() * dtype.itemsize)
        f.truncate()  # a hole at the end still counts in the file's length


def write_folder(
    path: str | Path,
    config: dict,
    entries: list[tuple[str, tuple[int, ...], torch.dtype]],
    tensor_of: Callable[[str], Tensor | None],
    layout: str,
    shards: int,
) -> None:
    """Write config.json and weights; `entries` are text-layout (name, shape, dtype) triples."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    sizes = [math.prod(s) * d.itemsize for _, s, d in entries]
    total = sum(sizes)
    shard_of = _split(sizes, shards)
    files = (
        ["model.safetensors"]
        if shards == 1
        else [f"model-{i + 1:05d}-of-{shards:05d}.safetensors" for i in range(shards)]
    )
    verbose, written, reported = total >= PROGRESS_MIN_BYTES, 0, 0

    def progress(nbytes: int) -> None:
        nonlocal written, reported
        written += nbytes
        if verbose and (written - reported >= total // 50 or written == total):
            reported = written
            print(
                f"random_checkpoint: {written / 2**30:.1f}/{total / 2**30:.1f} GiB -> {path}",
                file=sys.stderr,
                flush=True,
            )

    weight_map = {}
    for k, file in enumerate(files):
        group = [e for e, s in zip(entries, shard_of, strict=True) if s == k]
        named = [(layout_name(n, layout), shape, dtype) for n, shape, dtype in group]
        _write_safetensors(
            path / file, named, lambda g=group: _ahead(tensor_of, [n for n, _, _ in g]), progress
        )
        weight_map |= {n: file for n, _, _ in named}
    if shards > 1:
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        (path / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    # last: a folder with config.json is complete (a write cut short leaves none)
    (path / "config.json").write_text(json.dumps(checkpoint_config(config, layout), indent=2) + "\n")


def _ahead(make: Callable[[str], Tensor | None], names: Iterable[str]) -> Iterator[Tensor | None]:
    """make(name) for each name, in order, computed a few at a time on threads (torch's CPU ops
    release the GIL) while the caller writes the earlier ones: random 27B weights take minutes on
    one core."""
    workers = min(8, os.cpu_count() or 1)
    with ThreadPoolExecutor(workers) as pool:
        pending: deque = deque()
        for name in names:
            pending.append(pool.submit(make, name))
            if len(pending) > workers:
                yield pending.popleft().result()
        while pending:
            yield pending.popleft().result()


def write_checkpoint(
    path: str | Path,
    config: dict,
    state_dict: dict[str, Tensor],
    layout: str = "model",
    shards: int = 1,
) -> None:
    """Write a text-layout state dict and its config as a Hugging Face checkpoint folder."""
    entries = [(n, tuple(t.shape), t.dtype) for n, t in state_dict.items()]
    write_folder(path, config, entries, state_dict.__getitem__, layout, shards)


