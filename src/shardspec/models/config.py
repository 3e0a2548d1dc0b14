"""Qwen3.5 text-model configuration, read from a Hugging Face `config.json`."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

LAYER_TYPES = ("linear_attention", "full_attention")


class ConfigError(ValueError):
    """A checkpoint folder or config the engine cannot run."""


@dataclass(slots=True)
class ModelConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    layer_types: list[str]
    linear_num_key_heads: int
    linear_num_value_heads: int
    linear_key_head_dim: int
    linear_value_head_dim: int
    linear_conv_kernel_dim: int = 4
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10_000_000.0
    partial_rotary_factor: float = 0.25
    max_position_embeddings: int = 32768
    tie_word_embeddings: bool = False
    hidden_act: str = "silu"
    mtp_num_hidden_layers: int = 0
    eos_token_ids: list[int] = field(default_factory=list)
    dtype: str = "bfloat16"

    def __post_init__(self) -> None:
        if len(self.layer_types) != self.num_hidden_layers:
            raise ConfigError(
                f"layer_types has {len(self.layer_types)} entries, num_hidden_layers is {self.num_hidden_layers}"
            )
        bad = sorted(set(self.layer_types) - set(LAYER_TYPES))
        if bad:
            raise ConfigError(f"unsupported layer types {bad}; supported: {list(LAYER_TYPES)}")
        if self.hidden_act != "silu":
            raise ConfigError(f"hidden_act {self.hidden_act!r} is not supported (only 'silu')")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ConfigError("num_attention_heads must be a multiple of num_key_value_heads")
        if self.linear_num_value_heads % self.linear_num_key_heads:
            raise ConfigError("linear_num_value_heads must be a multiple of linear_num_key_heads")

    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def has_full_attention(self) -> bool:
        return "full_attention" in self.layer_types

    def check_tp(self, tp: int) -> None:
        """Raise ConfigError unless the model can be split tp ways."""
        heads = {
            "num_attention_heads": self.num_attention_heads,
            "linear_num_key_heads": self.linear_num_key_heads,
            "linear_num_value_heads": self.linear_num_value_heads,
        }
        for name, count in heads.items():
            if count % tp:
                raise ConfigError(f"tensor-parallel degree {tp} does not divide {name}={count}")
        kv = self.num_key_value_heads
        if kv % tp and tp % kv:  # tp > kv works by replicating each KV head tp/kv times
            raise ConfigError(f"tensor-parallel degree {tp} and num_key_value_heads={kv} must divide one another")
        if self.intermediate_size % tp:
            raise ConfigError(f"tensor-parallel degree {tp} does not divide intermediate_size={self.intermediate_size}")

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> ModelConfig:
        text = raw.get("text_config") or raw
        if text.get("model_type", "qwen3_5_text") not in ("qwen3_5_text", "qwen3_5", "qwen3_next"):
            raise ConfigError(f"model_type {text.get('model_type')!r} is not a Qwen3.5 text model")
        rope = text.get("rope_parameters") or text.get("rope_scaling") or {}
        if rope.get("rope_type", "default") not in ("default", "mrope"):
            raise ConfigError(f"rope_type {rope.get('rope_type')!r} is not supported")
        n_layers = text["num_hidden_layers"]
        layer_types = text.get("layer_types") or [
            "full_attention" if (i + 1) % text.get("full_attention_interval", 4) == 0 else "linear_attention"
            for i in range(n_layers)
        ]
        eos = text.get("eos_token_id", raw.get("eos_token_id"))
        tie = text.get("tie_word_embeddings", raw.get("tie_word_embeddings", False))
        try:
            return cls(
                vocab_size=text["vocab_size"],
                hidden_size=text["hidden_size"],
                intermediate_size=text["intermediate_size"],
                num_hidden_layers=n_layers,
                num_attention_heads=text["num_attention_heads"],
                num_key_value_heads=text["num_key_value_heads"],
                head_dim=text.get("head_dim") or text["hidden_size"] // text["num_attention_heads"],
                layer_types=list(layer_types),
                linear_num_key_heads=text["linear_num_key_heads"],
                linear_num_value_heads=text["linear_num_value_heads"],
                linear_key_head_dim=text["linear_key_head_dim"],
                linear_value_head_dim=text["linear_value_head_dim"],
                linear_conv_kernel_dim=text.get("linear_conv_kernel_dim", 4),
                rms_norm_eps=text.get("rms_norm_eps", 1e-6),
                rope_theta=rope.get("rope_theta", text.get("rope_theta", 10_000_000.0)),
                partial_rotary_factor=rope.get("partial_rotary_factor", text.get("partial_rotary_factor", 0.25)),
                max_position_embeddings=text.get("max_position_embeddings", 32768),
                tie_word_embeddings=bool(tie),
                hidden_act=text.get("hidden_act", "silu"),
                mtp_num_hidden_layers=text.get("mtp_num_hidden_layers", 0),
                eos_token_ids=[] if eos is None else ([eos] if isinstance(eos, int) else list(eos)),
                dtype=str(text.get("dtype") or text.get("torch_dtype") or raw.get("torch_dtype") or "bfloat16"),
            )
        except KeyError as exc:
            raise ConfigError(f"config.json lacks required field {exc.args[0]!r}") from None

    @classmethod
    def from_folder(cls, path: str | Path) -> ModelConfig:
        config_file = Path(path) / "config.json"
        if not config_file.is_file():
            raise ConfigError(f"{path} is not a model folder: {config_file} not found")
        try:
            raw = json.loads(config_file.read_text())
        except (OSError, json.JSONDecodeError) as exc:
            raise ConfigError(f"cannot read {config_file}: {exc}") from None
        return cls.from_dict(raw)
