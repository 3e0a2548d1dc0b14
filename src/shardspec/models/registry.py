"""Model families, keyed on config.json's `architectures` and `model_type`.

A family says how to parse its config and build a stage of its model (a models.base.CausalLM).
The families shipped with shardspec register when this module first resolves a config; others
come from the modules named in SHARDSPEC_MODEL_PLUGINS (comma-separated, imported then in the
worker and the orchestrator alike), which call `register`.
"""

from __future__ import annotations

import importlib
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from shardspec.layers.parallel import TPGroup
from shardspec.models.base import CausalLM, ModelConfig, Stage
from shardspec.models.config import ConfigError, text_config

BUILTIN = ("shardspec.models.qwen3_5",)
PLUGINS_ENV = "SHARDSPEC_MODEL_PLUGINS"


@dataclass(frozen=True)
class Family:
    name: str
    architectures: tuple[str, ...]  # config.json `architectures` entries it runs
    model_types: tuple[str, ...]  # `model_type` values (top level or text_config) it runs
    parse_config: Callable[[dict[str, Any]], ModelConfig]  # raises ConfigError
    # (config, tp, stage, with_mtp, quant): quant a layers.quantization.QuantConfig or None
    build: Callable[[Any, TPGroup, Stage, bool, Any], CausalLM]
    draft_prefix: str = ""  # checkpoint keys of the MTP module ("mtp."); "": the family has none

    def has_mtp(self, keys: Any) -> bool:
        return bool(self.draft_prefix) and any(key.startswith(self.draft_prefix) for key in keys)


_families: dict[str, Family] = {}
_imported: set[str] = set()  # modules of BUILTIN and SHARDSPEC_MODEL_PLUGINS imported so far


def register(family: Family) -> Family:
    """Add a family; an architecture or model type may belong to one family only."""
    for other in _families.values():
        if other.name != family.name and (set(other.architectures) & set(family.architectures)
                                          or set(other.model_types) & set(family.model_types)):
            raise ValueError(f"model family {family.name!r} claims names of {other.name!r}")
    _families[family.name] = family
    return family


def families() -> list[Family]:
    _load()
    return list(_families.values())


def resolve(raw: dict[str, Any]) -> Family:
    """The family of a config.json: by `architectures` first, then by `model_type`."""
    architectures = raw.get("architectures") or []
    model_types = {raw.get("model_type"), text_config(raw).get("model_type")} - {None}
    for family in families():
        if set(architectures) & set(family.architectures):
            return family
    for family in families():
        if model_types & set(family.model_types):
            return family
    named = ", ".join([*map(repr, architectures), *(f"model_type {t!r}" for t in sorted(model_types, key=str))])
    raise ConfigError(f"unsupported model ({named or 'config.json names no architectures or model_type'}); "
                      f"supported: {supported()}")


def supported() -> str:
    return "; ".join(f"{f.name} ({', '.join([*f.architectures, *f.model_types])})" for f in families())


def _load() -> None:
    plugins = [name.strip() for name in os.environ.get(PLUGINS_ENV, "").split(",") if name.strip()]
    for module in [*BUILTIN, *plugins]:
        if module in _imported:
            continue
        try:
            importlib.import_module(module)
        except ImportError as exc:
            raise ConfigError(f"cannot import model plugin {module!r} ({PLUGINS_ENV}): {exc}") from None
        _imported.add(module)
