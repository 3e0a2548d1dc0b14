"""A Qwen3.5 text checkpoint's parameters: their names and shapes in the text layout, and
deterministic random values for them."""

from __future__ import annotations

import hashlib
import math

import torch
from torch import Tensor

# routed experts: fused 3-D tensors, one tensor per expert, or fused in the layers and per expert in
# the MTP layer (as Qwen3.5-35B-A3B is released)
EXPERT_LAYOUTS = ("fused", "per_expert", "mixed")
# lm_head std = LOGIT_GAIN / sqrt(hidden), so logits ~ N(0, LOGIT_GAIN²): peaked, not saturated
LOGIT_GAIN = 3.0


def _mlp_shapes(prefix: str, c: dict, per_expert: bool) -> dict[str, tuple[int, ...]]:
    """A layer's MLP under `prefix` ('model.layers.3.mlp.'): dense, or the sparse MoE block."""
    h = c["hidden_size"]
    if "num_experts" not in c:
        i = c["intermediate_size"]
        return {f"{prefix}gate_proj.weight": (i, h), f"{prefix}up_proj.weight": (i, h),
                f"{prefix}down_proj.weight": (h, i)}
    n, i, s = c["num_experts"], c["moe_intermediate_size"], c["shared_expert_intermediate_size"]
    shapes: dict[str, tuple[int, ...]] = {f"{prefix}gate.weight": (n, h)}
    if per_expert:
        for e in range(n):
            shapes |= {f"{prefix}experts.{e}.gate_proj.weight": (i, h), f"{prefix}experts.{e}.up_proj.weight": (i, h),
                       f"{prefix}experts.{e}.down_proj.weight": (h, i)}
    else:
        shapes |= {f"{prefix}experts.gate_up_proj": (n, 2 * i, h), f"{prefix}experts.down_proj": (n, h, i)}
    return shapes | {
        f"{prefix}shared_expert.gate_proj.weight": (s, h),
        f"{prefix}shared_expert.up_proj.weight": (s, h),
        f"{prefix}shared_expert.down_proj.weight": (h, s),
        f"{prefix}shared_expert_gate.weight": (1, h),
    }


def _decoder_layer_shapes(
    prefix: str, c: dict, layer_type: str, per_expert: bool = False
) -> dict[str, tuple[int, ...]]:
    """Parameter shapes of one decoder layer under `prefix` (e.g. 'model.layers.3.')."""
    h = c["hidden_size"]
    shapes: dict[str, tuple[int, ...]] = {f"{prefix}input_layernorm.weight": (h,)}
    if layer_type == "linear_attention":
        nk, nv = c["linear_num_key_heads"], c["linear_num_value_heads"]
        dk, dv = c["linear_key_head_dim"], c["linear_value_head_dim"]
        conv_dim = 2 * nk * dk + nv * dv
        a = f"{prefix}linear_attn."
        shapes |= {
            f"{a}in_proj_qkv.weight": (conv_dim, h),
            f"{a}in_proj_z.weight": (nv * dv, h),
            f"{a}in_proj_b.weight": (nv, h),
            f"{a}in_proj_a.weight": (nv, h),
            f"{a}conv1d.weight": (conv_dim, 1, c["linear_conv_kernel_dim"]),
            f"{a}dt_bias": (nv,),
            f"{a}A_log": (nv,),
            f"{a}norm.weight": (dv,),
            f"{a}out_proj.weight": (h, nv * dv),
        }
    elif layer_type == "full_attention":
        nq, nkv, d = c["num_attention_heads"], c["num_key_value_heads"], c["head_dim"]
        a = f"{prefix}self_attn."
        shapes |= {
            f"{a}q_proj.weight": (2 * nq * d, h),  # per head: [query | output gate]
            f"{a}k_proj.weight": (nkv * d, h),
            f"{a}v_proj.weight": (nkv * d, h),
            f"{a}o_proj.weight": (h, nq * d),
            f"{a}q_norm.weight": (d,),
            f"{a}k_norm.weight": (d,),
        }
    else:
        raise ValueError(f"unknown layer type {layer_type!r}")
    shapes[f"{prefix}post_attention_layernorm.weight"] = (h,)
    return shapes | _mlp_shapes(f"{prefix}mlp.", c, per_expert)


def parameter_shapes(config: dict, mtp: bool = True, experts: str = "fused") -> dict[str, tuple[int, ...]]:
    """Ordered text-layout parameter names and shapes of a Qwen3.5 text checkpoint; `experts`: the
    routed experts' layout (EXPERT_LAYOUTS) of an MoE config."""
    if experts not in EXPERT_LAYOUTS:
        raise ValueError(f"experts must be one of {EXPERT_LAYOUTS}, got {experts!r}")
    h = config["hidden_size"]
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (config["vocab_size"], h)}
    for i, layer_type in enumerate(config["layer_types"][: config["num_hidden_layers"]]):
        shapes |= _decoder_layer_shapes(f"model.layers.{i}.", config, layer_type, experts == "per_expert")
    shapes["model.norm.weight"] = (h,)
    if not config.get("tie_word_embeddings", False):
        shapes["lm_head.weight"] = (config["vocab_size"], h)
    if mtp:
        shapes |= {
            "mtp.fc.weight": (h, 2 * h),
            "mtp.pre_fc_norm_embedding.weight": (h,),
            "mtp.pre_fc_norm_hidden.weight": (h,),
        }
        for j in range(config.get("mtp_num_hidden_layers", 1)):
            shapes |= _decoder_layer_shapes(f"mtp.layers.{j}.", config, "full_attention", experts != "fused")
        shapes["mtp.norm.weight"] = (h,)
    return shapes


def _generator(seed: int, name: str) -> torch.Generator:
    """Per-tensor generator, so values depend only on (seed, name), not on order or sharding."""
    digest = hashlib.sha256(f"{seed}/{name}".encode()).digest()
    return torch.Generator().manual_seed(int.from_bytes(digest[:8], "little") >> 1)


def random_tensor(
    config: dict, name: str, shape: tuple[int, ...], seed: int, dtype=torch.float32
) -> Tensor:
    """One randomly initialised parameter, chosen by its (text-layout) name."""
    if name.endswith(("experts.gate_up_proj", "experts.down_proj")):
        return _fused_experts(config, name, shape, seed, dtype)
    g = _generator(seed, name)
    module = name.split(".")[-2]

    def randn() -> Tensor:
        return torch.randn(shape, generator=g)

    # In-place ops keep the peak at one fp32 copy (+ the cast) for vocab-sized tensors.
    if name == "model.embed_tokens.weight":
        t = randn()
    elif name == "lm_head.weight":
        t = randn().mul_(LOGIT_GAIN / math.sqrt(shape[1]))
    elif name.endswith("linear_attn.norm.weight"):
        t = randn().mul_(0.2).add_(1.0)  # gated RMSNorm multiplies by w directly
    elif "norm" in module:
        t = randn().mul_(0.2)  # zero-centred RMSNorm: x̂ * (1 + w)
    elif name.endswith("A_log"):
        t = torch.empty(shape).uniform_(0.5, 8.0, generator=g).log_()
    elif name.endswith("dt_bias"):
        t = randn().mul_(0.5)
    elif name.endswith("conv1d.weight"):
        t = randn().mul_(0.3)
    elif len(shape) == 2:
        t = randn().mul_(1.0 / math.sqrt(shape[1]))
    else:
        raise ValueError(f"no init rule for {name}")
    return t.to(dtype)


def _fused_experts(config: dict, name: str, shape: tuple[int, ...], seed: int, dtype: torch.dtype) -> Tensor:
    """A fused 3-D expert tensor made of the per-expert tensors random_tensor gives: a checkpoint has
    the same weights in either expert layout."""
    module, leaf = name.rsplit(".", 1)
    parts = ("gate_proj", "up_proj") if leaf == "gate_up_proj" else ("down_proj",)
    out = torch.empty(shape, dtype=dtype)
    rows = shape[1] // len(parts)
    for e in range(shape[0]):
        for j, part in enumerate(parts):
            out[e, j * rows : (j + 1) * rows] = random_tensor(config, f"{module}.{e}.{part}.weight",
                                                              (rows, shape[2]), seed, dtype)
    return out


def random_state_dict(
    config: dict, seed: int, dtype=torch.float32, mtp: bool = True, experts: str = "fused"
) -> dict[str, Tensor]:
    """Deterministic random text-layout state dict for `config`."""
    return {
        n: random_tensor(config, n, s, seed, dtype)
        for n, s in parameter_shapes(config, mtp, experts).items()
    }

