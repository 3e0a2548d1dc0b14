"""Qwen3.5 (Gated DeltaNet + gated attention) with its MTP module, tensor-parallel, one pipeline
stage at a time: the dense models and the mixture-of-experts ones, which differ in their MLP only;
their configs, read from a Hugging Face config.json; their registry entries."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

import torch
from torch import nn

from shardspec.layers.attention import GatedAttention
from shardspec.layers.batch import Batch
from shardspec.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from shardspec.layers.gdn import GatedDeltaNet
from shardspec.layers.linear import ReplicatedLinear
from shardspec.layers.mlp import MLP
from shardspec.layers.moe import SparseMoE
from shardspec.layers.norm import RMSNorm
from shardspec.layers.parallel import TPGroup
from shardspec.layers.quantization import QuantConfig
from shardspec.models.base import CausalLM, Stage
from shardspec.models.config import ConfigError, text_config
from shardspec.models.registry import Family, register

LAYER_TYPES = ("linear_attention", "full_attention")
MLP_PROJECTIONS = ("gate_proj", "up_proj", "down_proj")  # a dense MLP's and the shared expert's, split by tp


@dataclass(slots=True)
class HybridConfig:
    """What the dense and the MoE models share: the stack of Gated DeltaNet and gated-attention
    layers, the embedding, the head and the MTP module. Each subclass adds its MLP's fields."""

    vocab_size: int
    hidden_size: int
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

    def tp_splits(self, tp: int) -> dict[str, list[tuple[int, int]]]:
        """Per projection that tp ranks split (its checkpoint name within a layer), each segment's
        (whole, one rank's) width along the split, as layers.attention and layers.gdn cut them: the
        FP8 checks read it (models.fp8.split_problem). A subclass adds its MLP's."""
        heads, kv, dim = self.num_attention_heads, self.num_key_value_heads, self.head_dim
        nk, nv, dk, dv = (self.linear_num_key_heads, self.linear_num_value_heads, self.linear_key_head_dim,
                          self.linear_value_head_dim)
        kv_rows = (kv * dim, kv // tp * dim if kv >= tp else dim)  # more ranks than KV heads: one head each
        return {
            "self_attn.q_proj": [(2 * heads * dim, 2 * heads // tp * dim)],  # [query | gate] per head
            "self_attn.k_proj": [kv_rows],
            "self_attn.v_proj": [kv_rows],
            "self_attn.o_proj": [(heads * dim, heads // tp * dim)],
            "linear_attn.in_proj_qkv": [(nk * dk, nk // tp * dk)] * 2 + [(nv * dv, nv // tp * dv)],
            "linear_attn.in_proj_z": [(nv * dv, nv // tp * dv)],
            "linear_attn.in_proj_b": [(nv, nv // tp)],
            "linear_attn.in_proj_a": [(nv, nv // tp)],
            "linear_attn.out_proj": [(nv * dv, nv // tp * dv)],
        }

    @staticmethod
    def mlp_fields(text: dict[str, Any]) -> dict[str, Any]:
        """The subclass's MLP fields from config.json's text part (KeyError for a missing one)."""
        raise NotImplementedError

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> Any:
        text = text_config(raw)
        rope = text.get("rope_parameters") or text.get("rope_scaling") or {}
        if rope.get("rope_type", "default") not in ("default", "mrope"):
            raise ConfigError(f"rope_type {rope.get('rope_type')!r} is not supported")
        try:
            n_layers = text["num_hidden_layers"]
            layer_types = text.get("layer_types") or [
                "full_attention" if (i + 1) % text.get("full_attention_interval", 4) == 0 else "linear_attention"
                for i in range(n_layers)
            ]
            eos = text.get("eos_token_id", raw.get("eos_token_id"))
            tie = text.get("tie_word_embeddings", raw.get("tie_word_embeddings", False))
            return cls(
                vocab_size=text["vocab_size"],
                hidden_size=text["hidden_size"],
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
                **cls.mlp_fields(text),
            )
        except KeyError as exc:
            raise ConfigError(f"config.json lacks required field {exc.args[0]!r}") from None


@dataclass(slots=True, kw_only=True)
class Qwen3_5Config(HybridConfig):
    """A dense Qwen3.5: every layer's MLP is one SiLU-gated MLP."""

    intermediate_size: int

    def check_tp(self, tp: int) -> None:
        HybridConfig.check_tp(self, tp)
        if self.intermediate_size % tp:
            raise ConfigError(f"tensor-parallel degree {tp} does not divide intermediate_size={self.intermediate_size}")

    def tp_splits(self, tp: int) -> dict[str, list[tuple[int, int]]]:
        rows = [(self.intermediate_size, self.intermediate_size // tp)]
        return HybridConfig.tp_splits(self, tp) | {f"mlp.{name}": rows for name in MLP_PROJECTIONS}

    @staticmethod
    def mlp_fields(text: dict[str, Any]) -> dict[str, Any]:
        return {"intermediate_size": text["intermediate_size"]}


@dataclass(slots=True, kw_only=True)
class Qwen3_5MoeConfig(HybridConfig):
    """A Qwen3.5 mixture of experts: every layer's MLP (the MTP layer's too) is a SparseMoE.
    `expert_parallel` is how the engine splits it (layers.moe), not part of config.json."""

    num_experts: int
    num_experts_per_tok: int
    moe_intermediate_size: int
    shared_expert_intermediate_size: int
    expert_parallel: int = 1

    def __post_init__(self) -> None:
        HybridConfig.__post_init__(self)
        if not 1 <= self.num_experts_per_tok <= self.num_experts:
            raise ConfigError(f"num_experts_per_tok={self.num_experts_per_tok} must be in [1, num_experts="
                              f"{self.num_experts}]")

    def with_expert_parallel(self, ep: int) -> Qwen3_5MoeConfig:
        return replace(self, expert_parallel=ep)

    def check_tp(self, tp: int) -> None:
        """ConfigError naming the degrees that work, unless tp ranks (in expert_parallel groups) can
        split the model."""
        ep = self.expert_parallel
        problem = self._split_problem(tp, ep)
        if problem is None:
            return
        if ep == 1 or self._split_problem(tp, 1) is not None:
            works = [t for t in range(1, 2 * self.num_experts + 1) if self._split_problem(t, 1) is None]
            raise ConfigError(f"tensor-parallel degree {tp} {problem}; degrees that work: {_listed(works)}")
        works = [e for e in range(1, tp + 1) if self._split_problem(tp, e) is None]
        raise ConfigError(f"expert-parallel degree {ep} {problem}; at tensor-parallel degree {tp} these work: "
                          f"{_listed(works)}")

    def tp_splits(self, tp: int) -> dict[str, list[tuple[int, int]]]:
        """The shared expert's projections too; the routed experts are never kept FP8 (layers.moe)."""
        size = self.shared_expert_intermediate_size
        shared = {f"mlp.shared_expert.{name}": [(size, size // tp)] for name in MLP_PROJECTIONS}
        return HybridConfig.tp_splits(self, tp) | shared

    def _split_problem(self, tp: int, ep: int) -> str | None:
        """Why tp ranks in ep expert groups cannot split the model, or None."""
        try:
            HybridConfig.check_tp(self, tp)
        except ConfigError as exc:
            return str(exc).removeprefix(f"tensor-parallel degree {tp} ")
        if self.shared_expert_intermediate_size % tp:
            return f"does not divide shared_expert_intermediate_size={self.shared_expert_intermediate_size}"
        if tp % ep:
            return f"does not divide the tensor-parallel degree {tp}"
        if self.num_experts % ep:
            return f"does not divide num_experts={self.num_experts}"
        if self.moe_intermediate_size % (tp // ep):
            return (f"leaves {tp // ep} ranks per expert, which do not divide moe_intermediate_size="
                    f"{self.moe_intermediate_size}")
        return None

    @staticmethod
    def mlp_fields(text: dict[str, Any]) -> dict[str, Any]:
        return {"num_experts": text["num_experts"], "num_experts_per_tok": text["num_experts_per_tok"],
                "moe_intermediate_size": text["moe_intermediate_size"],
                "shared_expert_intermediate_size": text["shared_expert_intermediate_size"]}


def _listed(degrees: list[int]) -> str:
    return ", ".join(map(str, degrees)) or "none"


def feed_forward(config: HybridConfig, tp: TPGroup, quant: QuantConfig | None, prefix: str) -> MLP | SparseMoE:
    """A layer's MLP: the dense one, or the sparse mixture of experts."""
    if isinstance(config, Qwen3_5MoeConfig):
        return SparseMoE(config.hidden_size, config.num_experts, config.num_experts_per_tok,
                         config.moe_intermediate_size, config.shared_expert_intermediate_size, tp,
                         config.expert_parallel, quant, prefix)
    return MLP(config.hidden_size, config.intermediate_size, tp, quant, prefix)


def mixer(config: HybridConfig, layer_type: str, tp: TPGroup, quant: QuantConfig | None,
          prefix: str) -> GatedDeltaNet | GatedAttention:
    """A layer's token mixer: Gated DeltaNet ("linear_attention") or gated attention."""
    if layer_type == "linear_attention":
        return GatedDeltaNet(config.hidden_size, config.linear_num_key_heads, config.linear_num_value_heads,
                             config.linear_key_head_dim, config.linear_value_head_dim,
                             config.linear_conv_kernel_dim, config.rms_norm_eps, tp, quant, prefix)
    return GatedAttention(config.hidden_size, config.num_attention_heads, config.num_key_value_heads,
                          config.head_dim, config.rotary_dim, config.rope_theta, config.rms_norm_eps, tp, quant,
                          prefix)


class DecoderLayer(nn.Module):
    """`prefix`: the layer's checkpoint name (`model.layers.3`), which its projections ask `quant` by."""

    def __init__(self, config: HybridConfig, layer_type: str, tp: TPGroup, quant: QuantConfig | None = None,
                 prefix: str = ""):
        super().__init__()
        # the checkpoint's module names: linear_attn or self_attn; `mixer` is the same module
        name = "linear_attn" if layer_type == "linear_attention" else "self_attn"
        setattr(self, name, mixer(config, layer_type, tp, quant, f"{prefix}.{name}"))
        self.mixer: GatedDeltaNet | GatedAttention = getattr(self, "linear_attn", None) or self.self_attn
        self.mlp = feed_forward(config, tp, quant, f"{prefix}.mlp")
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

    def __init__(self, config: HybridConfig, tp: TPGroup, quant: QuantConfig | None = None):
        super().__init__()
        self.fc = ReplicatedLinear(2 * config.hidden_size, config.hidden_size, quant, "mtp.fc")
        self.pre_fc_norm_embedding = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.pre_fc_norm_hidden = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.layers = nn.ModuleList([DecoderLayer(config, "full_attention", tp, quant, "mtp.layers.0")])
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.tp = tp

    def forward(self, embeds: torch.Tensor, hidden: torch.Tensor, batch: Batch) -> torch.Tensor:
        x = self.fc(torch.cat([self.pre_fc_norm_embedding(embeds), self.pre_fc_norm_hidden(hidden)], -1))
        residual = None
        for layer in self.layers:
            x, residual = layer(x, residual, batch)
        return self.norm(x, residual, self.tp)[0]


class Qwen3_5Model(CausalLM):
    """One stage of the text model. The last stage also holds the embedding when it has the MTP
    module, which embeds the token it drafts from. `quant`: how its projections hold their weights
    (None: all in the model's dtype)."""

    def __init__(self, config: HybridConfig, tp: TPGroup, stage: Stage | None = None, with_mtp: bool = False,
                 quant: QuantConfig | None = None):
        super().__init__()
        stage = stage or Stage.whole(config.num_hidden_layers)
        self.config, self.tp, self.stage = config, tp, stage
        with_mtp = with_mtp and stage.last
        needs_embedding = stage.first or with_mtp
        self.embed_tokens = (VocabParallelEmbedding(config.vocab_size, config.hidden_size, tp)
                             if needs_embedding else None)
        self.layers = nn.ModuleDict({str(i): DecoderLayer(config, config.layer_types[i], tp, quant, f"model.layers.{i}")
                                     for i in range(stage.start, stage.end)})  # keys: the checkpoint's indices
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps) if stage.last else None
        self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size, tp) if stage.last else None
        self.mtp = MTPHead(config, tp, quant) if with_mtp else None

    @property
    def has_mtp(self) -> bool:
        return self.mtp is not None

    def forward(self, x: torch.Tensor, batch: Batch) -> torch.Tensor:
        if self.stage.first:
            x = self.embed_tokens(x)
        residual = None
        for layer in self.layers.values():
            x, residual = layer(x, residual, batch)
        if self.stage.last:
            return self.norm(x, residual, self.tp)[0]
        return self.tp.all_reduce(x) + residual  # the residual stream after this stage's last layer

    def draft(self, next_ids: torch.Tensor, hidden: torch.Tensor, batch: Batch) -> torch.Tensor:
        return self.mtp(self.embed_tokens(next_ids), hidden, batch)

    def checkpoint_key(self, param_name: str) -> str:
        name = param_name.replace(".mixer.", ".")  # `mixer` is an alias of linear_attn / self_attn
        name = name.replace("linear_attn.conv1d_weight", "linear_attn.conv1d.weight")
        if name.startswith("mtp."):
            return name
        if name.startswith("lm_head.") and self.config.tie_word_embeddings:
            return "model.embed_tokens.weight"
        if name.startswith("lm_head."):
            return name
        return "model." + name


register(Family(
    name="qwen3_5",
    architectures=("Qwen3_5ForCausalLM", "Qwen3_5ForConditionalGeneration"),
    model_types=("qwen3_5", "qwen3_5_text"),
    parse_config=Qwen3_5Config.from_dict,
    build=Qwen3_5Model,
    draft_prefix="mtp.",
))

register(Family(
    name="qwen3_5_moe",
    architectures=("Qwen3_5MoeForCausalLM", "Qwen3_5MoeForConditionalGeneration"),
    model_types=("qwen3_5_moe", "qwen3_5_moe_text"),
    parse_config=Qwen3_5MoeConfig.from_dict,
    build=Qwen3_5Model,
    draft_prefix="mtp.",
))
