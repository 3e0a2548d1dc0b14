"""The bytes one rank must read and write in one decode step of a Qwen3.5 model: the numerator of
every decode floor (bench/decode.py divides it by the device's measured copy bandwidth).

A k = 0 step runs the target once: every weight of the rank once (the LM head too), but of the
input-embedding table only the B rows it looks up, and nothing of the MTP module. A step with
k drafts runs the target's verify pass over B·(k+1) tokens, then k MTP passes (one over the
accepted prefix, k − 1 chaining the drafts), each followed by a draft LM-head pass: the MTP module
and the drafts' head are read k times each, and the embedding table gives B·(3k + 1) rows.
The caches: each attention layer reads the K and V of the positions attended and writes those of
the new tokens; each Gated DeltaNet layer reads and writes its fp32 recurrent state and its
convolution state once. Activations (a few hidden vectors per token) are left out.

Per rank under tensor parallelism: projections split by heads or the vocabulary, so their bytes
divide by tp; a rank holds max(1, kv_heads // tp) KV heads; norms and the MTP module's input
projection are replicated.

A mixture-of-experts layer reads its router, the shared expert's gate and the rank's slice of the
shared expert whole, but of the routed experts only those the pass's tokens route to: with N
tokens each picking k of E experts, a rank holding E' of them reads E' · (1 − (1 − k/E)^N) on
average where routing is uniform (random weights route so). The MTP layer's experts count with its
own passes' tokens: B·(k+1) for the pass over the accepted prefix, B for each chained one.
"""

from __future__ import annotations

from dataclasses import dataclass

from shardspec.models.qwen3_5 import HybridConfig, Qwen3_5MoeConfig

STATE_BYTES = 4  # the recurrent state is fp32 whatever the weights' dtype
FP8_SCALE_BYTES = 4  # the fp8 draft head's fp32 scale per row (shardspec.kernels.head)


@dataclass(frozen=True)
class StepBytes:
    """One decode step's bytes by where they go."""

    weights: int  # the target's weights of the rank, its LM head included, the embedding table excluded
    embedding_rows: int  # the rows of the input-embedding table looked up
    mtp: int  # the MTP module, once per MTP pass
    draft_head: int  # the drafts' LM-head passes
    kv_cache: int  # K and V read (positions attended) and written (new tokens), every attention layer
    recurrent_state: int  # Gated DeltaNet's recurrent and convolution states, read and written

    @property
    def total(self) -> int:
        return self.weights + self.embedding_rows + self.mtp + self.draft_head + self.kv_cache + self.recurrent_state


def _kv_heads(config: HybridConfig, tp: int) -> int:
    return max(1, config.num_key_value_heads // tp)


def _attention_layer(config: HybridConfig, tp: int, tokens: int) -> float:
    """Elements of one full-attention decoder layer on a rank (mixer + MLP + norms) that a pass of
    `tokens` tokens reads."""
    h, d = config.hidden_size, config.head_dim
    q = config.num_attention_heads // tp * d
    mixer = 2 * q * h + 2 * _kv_heads(config, tp) * d * h + h * q + 2 * d  # q|gate, k, v, o; q and k norms
    return mixer + _mlp_and_norms(config, tp, tokens)


def _linear_attention_layer(config: HybridConfig, tp: int, tokens: int) -> float:
    """Elements of one Gated DeltaNet decoder layer on a rank."""
    h = config.hidden_size
    nv = config.linear_num_value_heads // tp
    key_dim = config.linear_num_key_heads // tp * config.linear_key_head_dim
    value_dim = nv * config.linear_value_head_dim
    conv_dim = 2 * key_dim + value_dim
    mixer = (conv_dim * h + value_dim * h + 2 * nv * h  # in_proj qkv, z, b, a
             + conv_dim * config.linear_conv_kernel_dim + 2 * nv  # conv1d; dt_bias, A_log
             + config.linear_value_head_dim + h * value_dim)  # gated norm; out_proj
    return mixer + _mlp_and_norms(config, tp, tokens)


def _mlp_and_norms(config: HybridConfig, tp: int, tokens: int) -> float:
    h = config.hidden_size
    if isinstance(config, Qwen3_5MoeConfig):
        return _moe(config, tp, tokens) + 2 * h
    return 3 * config.intermediate_size // tp * h + 2 * h  # gate, up, down; the two layer norms


def _moe(config: Qwen3_5MoeConfig, tp: int, tokens: int) -> float:
    """Elements of a rank's MoE block a pass of `tokens` tokens reads (uniform routing)."""
    h, experts, ep = config.hidden_size, config.num_experts, config.expert_parallel
    held = experts // ep
    hit = held * (1 - (1 - config.num_experts_per_tok / experts) ** tokens)  # expected distinct experts
    expert = 3 * config.moe_intermediate_size // (tp // ep) * h  # gate, up, down of the rank's slice
    shared = 3 * config.shared_expert_intermediate_size // tp * h
    return experts * h + h + shared + hit * expert  # router, shared gate, shared expert, routed experts


def step_bytes(config: HybridConfig, tp: int, batch: int, context: int, k: int = 0, dtype_bytes: int = 2,
               draft_head: str = "cublas") -> StepBytes:
    """One step of `batch` sequences with `context` positions cached before it and `k` drafts (0: no
    MTP): the step reads those positions and writes its k + 1 new ones.

    dtype_bytes: of the weights and the caches; draft_head: the drafts' LM head (runner.DRAFT_HEAD):
    "fp8" reads a float8 copy (one byte an element, an fp32 scale a row), "bf16" and "cublas" the head."""
    layers = config.layer_types
    tokens = batch * (k + 1)  # the target's pass
    per_layer = {"full_attention": _attention_layer(config, tp, tokens),
                 "linear_attention": _linear_attention_layer(config, tp, tokens)}
    h, vocab = config.hidden_size, config.vocab_size // tp
    head = vocab * h
    weights = round((sum(per_layer[t] for t in layers) + h + head) * dtype_bytes)  # + the final norm, the LM head

    kv_position = 2 * _kv_heads(config, tp) * config.head_dim * dtype_bytes  # K and V of one position, one layer
    kv = layers.count("full_attention") * batch * (context + k + 1) * kv_position
    nv = config.linear_num_value_heads // tp
    state = nv * config.linear_key_head_dim * config.linear_value_head_dim * STATE_BYTES
    conv_dim = 2 * (config.linear_num_key_heads // tp) * config.linear_key_head_dim + nv * config.linear_value_head_dim
    state += conv_dim * (config.linear_conv_kernel_dim - 1) * dtype_bytes
    recurrent = 2 * layers.count("linear_attention") * batch * state
    if not k:
        return StepBytes(weights, batch * h * dtype_bytes, 0, 0, kv, recurrent)

    passes = [batch * (k + 1)] + [batch] * (k - 1)  # the tokens of the MTP passes: the accepted prefix, the chain
    # fc, 3 norms, one layer, in each pass
    mtp_module = round(sum(2 * h * h + 3 * h + _attention_layer(config, tp, n) for n in passes) * dtype_bytes)
    # the MTP layer's own cache: the prefix pass attends over context + k + 1, each chained pass one further
    mtp_kv = sum(batch * (context + k + 1 + i) * kv_position for i in range(k))
    draft = head + vocab * FP8_SCALE_BYTES if draft_head == "fp8" else head * dtype_bytes
    return StepBytes(weights, batch * (3 * k + 1) * h * dtype_bytes, mtp_module, k * draft, kv + mtp_kv,
                     recurrent)
