"""The bytes one rank must read and write in one decode step of a Qwen3.5 model: the numerator of
every decode floor (bench/decode.py divides it by the device's measured copy bandwidth).

A k = 0 step runs the target once: every weight of the rank once (the LM head too), but of the
input-embedding table only the B rows it looks up, and nothing of the MTP module. A step with
k drafts runs the target's verify pass over B·(k+1) tokens, then k MTP passes (one over the
accepted prefix, k − 1 chaining the drafts), each followed by a draft LM-head pass: the MTP module
and the drafts' head are read k times each, and the embedding table gives B·(3k + 1) rows.
The caches: each attention layer reads the K and V of the positions attended and writes those of
the new tokens, finding them through the block table (an int32 entry a block of BLOCK_TOKENS
positions, each row's entries read once a layer); each Gated DeltaNet layer reads and writes its fp32
recurrent state and its convolution state once. Activations (a few hidden vectors per token) are left out.

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

from shardspec.layers.batch import BLOCK_TOKENS
from shardspec.models.qwen3_5 import HybridConfig, Qwen3_5MoeConfig
from shardspec.testing.fp8 import FP8_BLOCK

STATE_BYTES = 4  # the recurrent state is fp32 whatever the weights' dtype
FP8_SCALE_BYTES = 4  # an fp32 scale: per row of the fp8 draft head (kernels.head), per block of FP8 weights
TABLE_ENTRY_BYTES = 4  # an int32 block number of a block table


@dataclass(frozen=True)
class StepBytes:
    """One decode step's bytes by where they go."""

    weights: int  # the target's weights of the rank, its LM head included, the embedding table excluded
    embedding_rows: int  # the rows of the input-embedding table looked up
    mtp: int  # the MTP module, once per MTP pass
    draft_head: int  # the drafts' LM-head passes
    kv_cache: int  # K and V read (positions attended) and written (new tokens), every attention layer
    recurrent_state: int  # Gated DeltaNet's recurrent and convolution states, read and written
    block_tables: int = 0  # the block-table entries of the positions attended, every attention layer's pass

    @property
    def total(self) -> int:
        return (self.weights + self.embedding_rows + self.mtp + self.draft_head + self.kv_cache + self.recurrent_state
                + self.block_tables)


def _table_bytes(batch: int, positions: int) -> int:
    """One attention layer's pass: each row's block-table entries over `positions` positions."""
    return batch * -(-positions // BLOCK_TOKENS) * TABLE_ENTRY_BYTES


def _kv_heads(config: HybridConfig, tp: int) -> int:
    return max(1, config.num_key_value_heads // tp)


# a layer on a rank as a pass of some tokens reads it: its projections' [N, K] (FP8 in FP8 releases)
# and its other elements (of the routed experts, those the tokens are expected to hit)
Layer = tuple[list[tuple[int, int]], float]


def _attention_layer(config: HybridConfig, tp: int, tokens: int) -> Layer:
    """One full-attention decoder layer on a rank (mixer + MLP + norms), read by `tokens` tokens."""
    h, d = config.hidden_size, config.head_dim
    q, kv = config.num_attention_heads // tp * d, _kv_heads(config, tp) * d
    projections, other = _mlp_and_norms(config, tp, tokens)
    mixer = [(2 * q, h), (kv, h), (kv, h), (h, q)]  # q|gate, k, v, o
    return [*mixer, *projections], 2 * d + other  # q and k norms


def _linear_attention_layer(config: HybridConfig, tp: int, tokens: int) -> Layer:
    """One Gated DeltaNet decoder layer on a rank."""
    h = config.hidden_size
    nv = config.linear_num_value_heads // tp
    key_dim = config.linear_num_key_heads // tp * config.linear_key_head_dim
    value_dim = nv * config.linear_value_head_dim
    conv_dim = 2 * key_dim + value_dim
    projections, other = _mlp_and_norms(config, tp, tokens)
    other += (2 * nv * h  # in_proj b, a: 16-bit in FP8 releases
              + conv_dim * config.linear_conv_kernel_dim + 2 * nv  # conv1d; dt_bias, A_log
              + config.linear_value_head_dim)  # gated norm
    mixer = [(conv_dim, h), (value_dim, h), (h, value_dim)]  # in_proj qkv, z; out_proj
    return [*mixer, *projections], other


def _mlp_and_norms(config: HybridConfig, tp: int, tokens: int) -> Layer:
    h = config.hidden_size
    if isinstance(config, Qwen3_5MoeConfig):
        return _moe(config, tp, tokens)
    i = config.intermediate_size // tp
    return [(i, h), (i, h), (h, i)], 2 * h  # gate, up, down; the two layer norms


def _moe(config: Qwen3_5MoeConfig, tp: int, tokens: int) -> Layer:
    """A rank's MoE block and the layer's norms as a pass of `tokens` tokens reads them (uniform routing)."""
    h, experts, ep = config.hidden_size, config.num_experts, config.expert_parallel
    hit = experts // ep * (1 - (1 - config.num_experts_per_tok / experts) ** tokens)  # expected distinct experts
    i = config.moe_intermediate_size // (tp // ep)  # each held expert's rows on this rank
    s = config.shared_expert_intermediate_size // tp
    routed = 3 * i * h * hit  # gate, up, down of the experts hit: 16-bit even from FP8 (the loader dequantises them)
    # the shared expert; the router, the shared gate and the two layer norms (16-bit in FP8 releases)
    return [(s, h), (s, h), (h, s)], routed + experts * h + h + 2 * h


def _layer_bytes(layer: Layer, dtype_bytes: int, fp8: bool) -> float:
    """A layer's bytes: with fp8 its projections as FP8 checkpoints hold them, one byte an element and
    an fp32 scale a 128 × 128 block (exact where a rank's slices are whole blocks)."""
    projections, other = layer
    elements = sum(n * k for n, k in projections)
    if not fp8:
        return (elements + other) * dtype_bytes
    blocks = sum(-(-n // FP8_BLOCK) * -(-k // FP8_BLOCK) for n, k in projections)
    return elements + FP8_SCALE_BYTES * blocks + other * dtype_bytes


def step_bytes(config: HybridConfig, tp: int, batch: int, context: int, k: int = 0, dtype_bytes: int = 2,
               draft_head: str = "cublas", fp8: bool = False) -> StepBytes:
    """One step of `batch` sequences with `context` positions cached before it and `k` drafts (0: no
    MTP): the step reads those positions and writes its k + 1 new ones.

    dtype_bytes: of the weights and the caches; draft_head: the drafts' LM head (WorkerOptions.draft_head):
    "fp8" reads a float8 copy (one byte an element, an fp32 scale a row), "bf16" and "cublas" the head.
    fp8: a block-wise FP8 checkpoint, its projections FP8 (the embeddings, LM head, norms, GDN's
    in_proj_a/b, conv and gates and the MTP module's fc in dtype_bytes, as the releases keep them; the
    routed experts too, which the loader dequantises)."""
    layers = config.layer_types
    tokens = batch * (k + 1)  # the target's pass
    per_layer = {"full_attention": _layer_bytes(_attention_layer(config, tp, tokens), dtype_bytes, fp8),
                 "linear_attention": _layer_bytes(_linear_attention_layer(config, tp, tokens), dtype_bytes, fp8)}
    h, vocab = config.hidden_size, config.vocab_size // tp
    head = vocab * h
    weights = round(sum(per_layer[t] for t in layers) + (h + head) * dtype_bytes)  # + the final norm, the LM head

    kv_position = 2 * _kv_heads(config, tp) * config.head_dim * dtype_bytes  # K and V of one position, one layer
    kv = layers.count("full_attention") * batch * (context + k + 1) * kv_position
    tables = layers.count("full_attention") * _table_bytes(batch, context + k + 1)
    nv = config.linear_num_value_heads // tp
    state = nv * config.linear_key_head_dim * config.linear_value_head_dim * STATE_BYTES
    conv_dim = 2 * (config.linear_num_key_heads // tp) * config.linear_key_head_dim + nv * config.linear_value_head_dim
    state += conv_dim * (config.linear_conv_kernel_dim - 1) * dtype_bytes
    recurrent = 2 * layers.count("linear_attention") * batch * state
    if not k:
        return StepBytes(weights, batch * h * dtype_bytes, 0, 0, kv, recurrent, tables)

    passes = [batch * (k + 1)] + [batch] * (k - 1)  # the tokens of the MTP passes: the accepted prefix, the chain
    # fc, 3 norms and one layer, in each pass
    mtp = round(sum((2 * h * h + 3 * h) * dtype_bytes + _layer_bytes(_attention_layer(config, tp, n), dtype_bytes, fp8)
                    for n in passes))
    # the MTP layer's own cache: the prefix pass attends over context + k + 1, each chained pass one further
    mtp_kv = sum(batch * (context + k + 1 + i) * kv_position for i in range(k))
    tables += sum(_table_bytes(batch, context + k + 1 + i) for i in range(k))
    draft = head + vocab * FP8_SCALE_BYTES if draft_head == "fp8" else head * dtype_bytes
    return StepBytes(weights, batch * (3 * k + 1) * h * dtype_bytes, mtp, k * draft, kv + mtp_kv,
                     recurrent, tables)
