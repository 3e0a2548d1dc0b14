"""Reading a checkpoint folder's files: config.json (each model family parses its own fields), and
the JSON files beside it, opened only as bounded regular files.

A model folder's path can come over the wire (a `load` request) and its files may be anything: a
FIFO would block the reader forever, /dev/zero would fill its memory, a config can imply tensors
of any size. So every file is opened without blocking and read only if it is a regular file no
larger than its bound, and config.json's sizes must lie within DIMENSION_LIMITS.
"""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path
from typing import Any, BinaryIO


class ConfigError(ValueError):
    """A checkpoint folder or config the engine cannot run."""


MAX_CONFIG_BYTES = 16 * 2**20  # config.json, tokenizer_config.json, model.safetensors.index.json
MAX_TOKENIZER_BYTES = 512 * 2**20  # tokenizer.json: large vocabularies with merges run to tens of MB
MAX_EMBEDDING_ELEMENTS = 2**33  # vocab_size × hidden_size (a 262k vocabulary at hidden 16k is 2**32)

# [lo, hi] of config.json's size fields (top level and text_config): generous, far beyond any
# released model, yet small enough that building the model's layer list cannot exhaust memory
DIMENSION_LIMITS: dict[str, tuple[int, int]] = {
    "vocab_size": (1, 2**22),
    "hidden_size": (1, 2**17),
    "intermediate_size": (1, 2**19),
    "num_hidden_layers": (1, 1024),
    "num_attention_heads": (1, 4096),
    "num_key_value_heads": (1, 4096),
    "head_dim": (1, 2**14),
    "linear_num_key_heads": (1, 4096),
    "linear_num_value_heads": (1, 4096),
    "linear_key_head_dim": (1, 2**14),
    "linear_value_head_dim": (1, 2**14),
    "linear_conv_kernel_dim": (1, 1024),
    "mtp_num_hidden_layers": (0, 64),
    "num_experts": (1, 2**16),
    "num_experts_per_tok": (1, 2**16),
    "moe_intermediate_size": (1, 2**19),
    "shared_expert_intermediate_size": (1, 2**19),
    "max_position_embeddings": (1, 2**24),
}


def check_regular(path: str | Path) -> os.stat_result:
    """`path`'s stat if it is a regular file (after symlinks); ConfigError for a FIFO, a device, a
    folder or nothing. For files that a library opens by name (safetensors)."""
    try:
        info = os.stat(path)
    except OSError as exc:
        raise ConfigError(f"cannot read {path}: {exc.strerror or exc}") from None
    _require_regular(path, info)
    return info


def open_regular(path: str | Path) -> BinaryIO:
    """`path` opened for reading, if it is a regular file: opened non-blocking (a FIFO's open
    returns at once) and checked with fstat on that descriptor, so a file swapped after a check
    cannot be read instead."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as exc:
        raise ConfigError(f"cannot read {path}: {exc.strerror or exc}") from None
    file = os.fdopen(fd, "rb")
    try:
        _require_regular(path, os.fstat(fd))
    except ConfigError:
        file.close()
        raise
    return file


def read_bytes(path: str | Path, limit: int) -> bytes:
    """The whole file, if it is a regular file (open_regular) of at most `limit` bytes."""
    with open_regular(path) as file:
        size = os.fstat(file.fileno()).st_size
        if size > limit:
            raise ConfigError(f"{path} is {size} bytes; at most {limit} are read from such a file")
        data = file.read(limit + 1)  # it may grow while being read
    if len(data) > limit:
        raise ConfigError(f"{path} is over {limit} bytes; at most {limit} are read from such a file")
    return data


def read_json(path: str | Path, limit: int = MAX_CONFIG_BYTES) -> Any:
    """A bounded regular JSON file's value; ConfigError naming the file otherwise."""
    try:
        return json.loads(read_bytes(path, limit))
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as exc:
        raise ConfigError(f"cannot read {path}: not valid JSON ({exc})") from None


def read_config(folder: str | Path) -> dict[str, Any]:
    """config.json of a model folder, as a dict whose size fields are within DIMENSION_LIMITS."""
    config_file = Path(folder) / "config.json"
    if not config_file.exists():
        raise ConfigError(f"{folder} is not a model folder: {config_file} not found")
    raw = read_json(config_file)
    if not isinstance(raw, dict):
        raise ConfigError(f"{config_file} must hold a JSON object")
    check_dimensions(raw, config_file)
    return raw


def check_dimensions(raw: dict[str, Any], where: str | Path = "config.json") -> None:
    """Each size field (top level and text_config) an integer within DIMENSION_LIMITS, and the
    embedding they imply within MAX_EMBEDDING_ELEMENTS."""
    for part in (raw, text_config(raw)):
        for name, (lo, hi) in DIMENSION_LIMITS.items():
            value = part.get(name)
            if value is not None and (type(value) is not int or not lo <= value <= hi):
                raise ConfigError(f"{where}: {name}={value!r} is out of range; it must be an integer in [{lo}, {hi}]")
        vocab, hidden = part.get("vocab_size"), part.get("hidden_size")
        if vocab is not None and hidden is not None and vocab * hidden > MAX_EMBEDDING_ELEMENTS:
            raise ConfigError(f"{where}: vocab_size × hidden_size = {vocab} × {hidden} is over "
                              f"{MAX_EMBEDDING_ELEMENTS} embedding elements")


def text_config(raw: dict[str, Any]) -> dict[str, Any]:
    """The language model's part of a config: `text_config` in multimodal wrappers, else all of it."""
    text = raw.get("text_config") or raw
    if not isinstance(text, dict):
        raise ConfigError("text_config must be a JSON object")
    return text


def _require_regular(path: str | Path, info: os.stat_result) -> None:
    if not stat.S_ISREG(info.st_mode):
        kind = ("a folder" if stat.S_ISDIR(info.st_mode) else "a FIFO" if stat.S_ISFIFO(info.st_mode)
                else "a device" if stat.S_ISCHR(info.st_mode) or stat.S_ISBLK(info.st_mode)
                else "a socket" if stat.S_ISSOCK(info.st_mode) else "a special file")
        raise ConfigError(f"cannot read {path}: it is {kind}, not a regular file")
