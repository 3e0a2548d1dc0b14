"""Reading a checkpoint folder's config.json (each model family parses its own fields)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


class ConfigError(ValueError):
    """A checkpoint folder or config the engine cannot run."""


def read_config(folder: str | Path) -> dict[str, Any]:
    """config.json of a model folder, as a dict."""
    config_file = Path(folder) / "config.json"
    if not config_file.is_file():
        raise ConfigError(f"{folder} is not a model folder: {config_file} not found")
    try:
        raw = json.loads(config_file.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ConfigError(f"cannot read {config_file}: {exc}") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"{config_file} must hold a JSON object")
    return raw


def text_config(raw: dict[str, Any]) -> dict[str, Any]:
    """The language model's part of a config: `text_config` in multimodal wrappers, else all of it."""
    text = raw.get("text_config") or raw
    if not isinstance(text, dict):
        raise ConfigError("text_config must be a JSON object")
    return text
