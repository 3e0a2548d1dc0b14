"""Qwen3.5 dense text model (Gated DeltaNet + gated attention) and its MTP head, tensor-parallel."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from shardspec import kernels
from shardspec.layers.attention import GatedAttention
from shardspec.layers.batch import Batch
from shardspec.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from shardspec.layers.gdn import GatedDeltaNet
from shardspec.layers.linear import MergedColumnParallelLinear, ReplicatedLinear, RowParallelLinear
from shardspec.layers.norm import RMSNorm
from shardspec.layers.parallel import TPGroup
from shardspec.models.config import ModelConfig


class MLP(nn.Module):
    def __init__(self, config: ModelConfig, tp: TPGroup):
        super().__init__()
        rows = [tp.split(config.intermediate_size)]
        self.gate_up_proj = MergedColumnParallelLinear(config.hidden_size, {"gate_proj": rows, "up_proj": rows})
        self.down_proj = RowParallelLinear(rows, config.hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x)
        if kernels.enabled(x):
            return self.down_proj(kernels.norm.silu_mul(gate, up))
        return self.down_proj(F.silu(gate) * up)


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer_type: str, tp: TPGroup):
        super().__init__()
        if layer_type == "linear_attention":
            self.linear_attn = GatedDeltaNet(config, tp)
        else:
            self.self_attn = GatedAttention(config, tp)
        self.mixer: GatedDeltaNet | GatedAttention = getattr(self, "linear_attn", None) or self.self_attn
        self.mlp = MLP(config, tp)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.tp = tp

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None, batch: Batch):
        """(this layer's output, the residual stream before it). The output is this rank's partial
        sum (a row-parallel projection's), as is the input when `residual` is given (the previous
        layer's output): each norm sums its input across the group and adds it to the residual
        first, so that all-reduce, add and norm are one kernel where they can be (RMSNorm)."""
        if residual is None:
            h, residual = self.input_layernorm(x), x
        else:
            h, residual = self.input_layernorm(x, residual, self.tp)
        h, residual = self.post_attention_layernorm(self.mixer(h, batch), residual, self.tp)
        return self.mlp(h), residual


class MTPHead(nn.Module):
    """Predicts token t+2 from the embedding of token t+1 and the target's final hidden state at t."""

    def __init__(self, config: ModelConfig, tp: TPGroup):
        super().__init__()
        self.fc = ReplicatedLinear(2 * config.hidden_size, config.hidden_size)
        self.pre_fc_norm_embedding = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.pre_fc_norm_hidden = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.layers = nn.ModuleList([DecoderLayer(config, "full_attention", tp)])
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.tp = tp

    def forward(self, embeds: torch.Tensor, hidden: torch.Tensor, batch: Batch) -> torch.Tensor:
        x = self.fc(torch.cat([self.pre_fc_norm_embedding(embeds), self.pre_fc_norm_hidden(hidden)], -1))
        residual = None
        for layer in self.layers:
            x, residual = layer(x, residual, batch)
        return self.norm(x, residual, self.tp)[0]


class Qwen3_5Model(nn.Module):
    """The text model; `forward` returns the final (post-norm) hidden states."""

    def __init__(self, config: ModelConfig, tp: TPGroup, with_mtp: bool = False):
        super().__init__()
        self.config = config
        self.tp = tp
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size, tp)
        self.layers = nn.ModuleList([DecoderLayer(config, t, tp) for t in config.layer_types])
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size, tp)
        self.mtp = MTPHead(config, tp) if with_mtp else None

    def forward(self, ids: torch.Tensor, batch: Batch) -> torch.Tensor:
        x, residual = self.embed_tokens(ids), None
        for layer in self.layers:
            x, residual = layer(x, residual, batch)
        return self.norm(x, residual, self.tp)[0]

    def stateful_layers(self) -> list[GatedAttention | GatedDeltaNet]:
        mixers = [layer.mixer for layer in self.layers]
        if self.mtp is not None:
            mixers += [layer.mixer for layer in self.mtp.layers]
        return mixers

    def allocate_caches(self, num_slots: int, max_len: int, dtype: torch.dtype, device: torch.device) -> int:
        """Allocate every layer's per-slot state; returns the bytes allocated."""
        return sum(m.allocate(num_slots, max_len, dtype, device) for m in self.stateful_layers())

    def reset_slots(self, slots: torch.Tensor) -> None:
        for mixer in self.stateful_layers():
            if isinstance(mixer, GatedDeltaNet):
                mixer.reset(slots)


def checkpoint_name(param_name: str, config: ModelConfig) -> str:
    """The text-layout checkpoint key of one of our parameters."""
    name = param_name.replace(".mixer.", ".")  # `mixer` is an alias of linear_attn / self_attn
    name = name.replace("linear_attn.conv1d_weight", "linear_attn.conv1d.weight")
    if name.startswith("mtp."):
        return name
    if name.startswith("lm_head.") and config.tie_word_embeddings:
        return "model.embed_tokens.weight"
    if name.startswith("lm_head."):
        return name
    return "model." + name
