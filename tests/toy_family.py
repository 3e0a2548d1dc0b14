"""A second model family, registered from the test suite only (SHARDSPEC_MODEL_PLUGINS=toy_family):
a decoder of gated-attention layers alone (no Gated DeltaNet), with an MTP module of one such
layer, built from the same layers as Qwen3.5. It proves that the worker, the runner, the loader
and the orchestrator run a family they do not know by name."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from safetensors.torch import save_file
from torch import nn

from shardspec.layers.attention import GatedAttention
from shardspec.layers.batch import Batch
from shardspec.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from shardspec.layers.linear import MergedColumnParallelLinear, ReplicatedLinear, RowParallelLinear
from shardspec.layers.norm import RMSNorm
from shardspec.layers.parallel import TPGroup
from shardspec.models.base import CausalLM, Stage
from shardspec.models.config import ConfigError
from shardspec.models.registry import Family, register

ARCHITECTURE = "ToyAttentionForCausalLM"


@dataclass
class ToyConfig:
    vocab_size: int = 96
    hidden_size: int = 64
    intermediate_size: int = 128
    num_hidden_layers: int = 3
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    head_dim: int = 16
    max_position_embeddings: int = 512
    eos_token_ids: list[int] = field(default_factory=list)
    rms_norm_eps: float = 1e-6

    def check_tp(self, tp: int) -> None:
        for name in ("num_attention_heads", "num_key_value_heads", "intermediate_size"):
            if getattr(self, name) % tp:
                raise ConfigError(f"tensor-parallel degree {tp} does not divide {name}")

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> ToyConfig:
        return cls(**{k: v for k, v in raw.items() if k in cls.__dataclass_fields__})


class ToyLayer(nn.Module):
    def __init__(self, c: ToyConfig, tp: TPGroup):
        super().__init__()
        self.attn = GatedAttention(c.hidden_size, c.num_attention_heads, c.num_key_value_heads, c.head_dim,
                                   c.head_dim, 10_000.0, c.rms_norm_eps, tp)
        rows = [tp.split(c.intermediate_size)]
        self.up = MergedColumnParallelLinear(c.hidden_size, {"gate": rows, "up": rows})
        self.down = RowParallelLinear(rows, c.hidden_size)
        self.norm1 = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.norm2 = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.tp = tp

    def forward(self, x, residual, batch: Batch):
        h, residual = (self.norm1(x), x) if residual is None else self.norm1(x, residual, self.tp)
        h, residual = self.norm2(self.attn(h, batch), residual, self.tp)
        gate, up = self.up(h)
        return self.down(F.silu(gate) * up), residual


class ToyModel(CausalLM):
    def __init__(self, config: ToyConfig, tp: TPGroup, stage: Stage, with_mtp: bool, quant=None):
        super().__init__()
        self.config, self.tp, self.stage = config, tp, stage
        self.embed = VocabParallelEmbedding(config.vocab_size, config.hidden_size, tp)
        self.blocks = nn.ModuleDict({str(i): ToyLayer(config, tp) for i in range(stage.start, stage.end)})
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size, tp)
        if with_mtp:
            self.mtp_fc = ReplicatedLinear(2 * config.hidden_size, config.hidden_size)
            self.mtp_layer = ToyLayer(config, tp)
            self.mtp_norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.with_mtp = with_mtp

    @property
    def has_mtp(self) -> bool:
        return self.with_mtp

    def forward(self, ids: torch.Tensor, batch: Batch) -> torch.Tensor:
        x, residual = self.embed(ids), None
        for block in self.blocks.values():
            x, residual = block(x, residual, batch)
        return self.norm(x, residual, self.tp)[0]

    def draft(self, next_ids: torch.Tensor, hidden: torch.Tensor, batch: Batch) -> torch.Tensor:
        x = self.mtp_fc(torch.cat([self.embed(next_ids), hidden], -1))
        x, residual = self.mtp_layer(x, None, batch)
        return self.mtp_norm(x, residual, self.tp)[0]

    def checkpoint_key(self, param_name: str) -> str:
        return param_name  # the toy's checkpoints use its own parameter names


register(Family(name="toy", architectures=(ARCHITECTURE,), model_types=("toy_attention",),
                parse_config=ToyConfig.from_dict, build=ToyModel, draft_prefix="mtp_"))


def write_checkpoint(folder: Path, config: ToyConfig, seed: int = 0) -> Path:
    """config.json and random weights, every parameter randomised (norms too)."""
    g = torch.Generator().manual_seed(seed)
    h, i, d = config.hidden_size, config.intermediate_size, config.head_dim
    nq, nkv = config.num_attention_heads, config.num_key_value_heads

    def layer(prefix: str) -> dict[str, tuple[int, ...]]:
        return {f"{prefix}attn.q_proj.weight": (2 * nq * d, h), f"{prefix}attn.k_proj.weight": (nkv * d, h),
                f"{prefix}attn.v_proj.weight": (nkv * d, h), f"{prefix}attn.o_proj.weight": (h, nq * d),
                f"{prefix}attn.q_norm.weight": (d,), f"{prefix}attn.k_norm.weight": (d,),
                f"{prefix}gate.weight": (i, h), f"{prefix}up.weight": (i, h), f"{prefix}down.weight": (h, i),
                f"{prefix}norm1.weight": (h,), f"{prefix}norm2.weight": (h,)}

    shapes = {"embed.weight": (config.vocab_size, h), "norm.weight": (h,), "lm_head.weight": (config.vocab_size, h),
              "mtp_fc.weight": (h, 2 * h), "mtp_norm.weight": (h,), **layer("mtp_layer.")}
    for n in range(config.num_hidden_layers):
        shapes |= layer(f"blocks.{n}.")
    tensors = {}
    for name, shape in shapes.items():
        scale = 0.2 if len(shape) == 1 else 1.0 / shape[-1] ** 0.5
        tensors[name] = (torch.randn(shape, generator=g) * scale).contiguous()
    tensors["lm_head.weight"] *= 4.0  # peaked next-token distributions
    folder.mkdir(parents=True, exist_ok=True)
    save_file(tensors, folder / "model.safetensors")
    raw = {"architectures": [ARCHITECTURE], "model_type": "toy_attention", "dtype": "float32",
           **{k: v for k, v in config.__dict__.items()}}
    (folder / "config.json").write_text(json.dumps(raw))
    return folder
