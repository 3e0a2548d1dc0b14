"""Gated full attention (Qwen3.5's: an output gate per head, q/k norms, partial rotary) over a paged
KV cache: K/V in blocks of a pool, found through each sequence's block table (CacheShape)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.backends.cuda import SDPAParams, can_use_flash_attention

from shardspec import kernels
from shardspec.layers.batch import BLOCK_TOKENS, Batch, CachedLayer, CacheShape
from shardspec.layers.invariant import pointwise
from shardspec.layers.linear import MergedColumnParallelLinear, RowParallelLinear, head_ranges
from shardspec.layers.norm import RMSNorm
from shardspec.layers.parallel import TPGroup
from shardspec.layers.quantization import QuantConfig
from shardspec.layers.rotary import RotaryEmbedding

# Passes of up to this many tokens per sequence (decode, verify) use the kernels that read the
# cache in place, as do padded prefills (Batch.lengths, graphed); other prefill chunks gather the keys
# and use PyTorch's flash attention.
KERNEL_MAX_TOKENS = 16


def tail_causal_flash(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> torch.Tensor | None:
    """Attention of queries that are the last T of the L keys ([B, H, T, D] against [B, HK, L, D]),
    or None where the flash kernel cannot run it. With more keys than queries, flash aligns its
    causal mask to the last key: what PyTorch's causal_lower_right bias dispatches to on CUDA, without
    the [2, T, L] tensor that bias allocates on construction."""
    if not q.is_cuda or q.shape[-1] % 8:
        return None
    if not can_use_flash_attention(SDPAParams(q, keys, values, None, 0.0, False, True)):  # True: GQA
        return None
    return torch.ops.aten._scaled_dot_product_flash_attention(q, keys, values, 0.0, True)[0]


def exact_length_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                           positions: torch.Tensor) -> torch.Tensor:
    """Each query [B, T, H, D] against exactly the keys it sees (its row's keys [B, L, HK, D] up to its
    position), one query at a time: a token's arithmetic depends on its position alone, not on the
    other sequences of the pass or on how many tokens its own row has (batch-invariant mode) ->
    [B, H, T, D]."""
    B, T, H, D = q.shape
    out = q.new_empty(B, H, T, D)
    for b, row in enumerate(positions.tolist()):
        for t, position in enumerate(row):
            seen_keys = keys[b, : position + 1].transpose(0, 1)[None]  # [1, HK, n, D]
            seen_values = values[b, : position + 1].transpose(0, 1)[None]
            query = q[b, t, :, None][None]  # [1, H, 1, D]
            out[b, :, t] = F.scaled_dot_product_attention(query, seen_keys, seen_values, enable_gqa=True)[0, :, 0]
    return out


def paged_index(tables: torch.Tensor, positions: torch.Tensor, block_tokens: int) -> torch.Tensor:
    """The flat index (block * block_tokens + offset) of each position [B, T] of rows with block
    tables [B, max_blocks] in a pool viewed as [blocks * block_tokens, ...]."""
    blocks = tables.gather(1, torch.div(positions, block_tokens, rounding_mode="floor"))
    return blocks.long() * block_tokens + positions % block_tokens


def gather_paged(cache: torch.Tensor, tables: torch.Tensor, length: int) -> torch.Tensor:
    """The first `length` positions of each row's blocks (tables [B, max_blocks]) of a pool
    [blocks, block_tokens, ...] -> [B, length, ...] (a copy)."""
    block_tokens = cache.shape[1]
    used = tables[:, : -(-length // block_tokens)].long()
    return cache[used].flatten(1, 2)[:, :length]


def kv_head_ranges(heads: int, dim: int, tp: TPGroup) -> tuple[int, list[tuple[int, int]]]:
    """This rank's KV heads; with more ranks than KV heads each rank keeps a replica of one."""
    if heads >= tp.size:
        return heads // tp.size, head_ranges(tp, heads, dim)
    head = tp.rank * heads // tp.size
    return 1, [(head * dim, (head + 1) * dim)]


class GatedAttention(CachedLayer):
    """`heads` query heads and `kv_heads` key/value heads of `head_dim`, split by KV-head groups;
    rotary embedding over the first `rotary_dim` channels of each head."""

    def __init__(self, hidden: int, heads: int, kv_heads: int, head_dim: int, rotary_dim: int, rope_theta: float,
                 eps: float, tp: TPGroup, quant: QuantConfig | None = None, prefix: str = ""):
        super().__init__()
        dim = self.head_dim = head_dim
        self.heads = heads // tp.size
        self.kv_heads, kv_ranges = kv_head_ranges(kv_heads, dim, tp)
        # q_proj rows hold [query | gate] per head, so whole heads are 2*dim rows
        self.qkv_proj = MergedColumnParallelLinear(hidden, {
            "q_proj": head_ranges(tp, heads, 2 * dim), "k_proj": kv_ranges, "v_proj": kv_ranges,
        }, quant, f"{prefix}.qkv_proj")
        self.o_proj = RowParallelLinear(head_ranges(tp, heads, dim), hidden, quant, f"{prefix}.o_proj")
        self.q_norm = RMSNorm(dim, eps)
        self.k_norm = RMSNorm(dim, eps)
        self.rotary = RotaryEmbedding(dim, rotary_dim, rope_theta)
        self.k_cache = torch.empty(0)  # [blocks, block_tokens, kv heads, head dim]: the pool's K/V blocks
        self.v_cache = torch.empty(0)
        self.tables = torch.empty(0, 0, dtype=torch.int32)  # every slot's block table (CacheShape)
        self.invariant = False  # batch-invariant mode (CausalLM.set_batch_invariant)

    def allocate(self, shape: CacheShape, dtype: torch.dtype, device: torch.device) -> int:
        blocks = (shape.blocks, shape.block_tokens, self.kv_heads, self.head_dim)
        self.k_cache = torch.zeros(blocks, dtype=dtype, device=device)
        self.v_cache = torch.zeros(blocks, dtype=dtype, device=device)
        self.tables = shape.tables
        return 2 * self.k_cache.nbytes

    def copy_blocks(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        self.k_cache[dst] = self.k_cache[src]
        self.v_cache[dst] = self.v_cache[src]

    def bytes_per(self, dtype: torch.dtype) -> tuple[int, int]:
        return 0, 2 * BLOCK_TOKENS * self.kv_heads * self.head_dim * dtype.itemsize

    def forward(self, x: torch.Tensor, batch: Batch) -> torch.Tensor:
        B, T, _ = x.shape
        qg, k, v = self.qkv_proj(x)
        if batch.slots is not None and (T <= KERNEL_MAX_TOKENS or batch.lengths is not None) and kernels.enabled(x):
            return self.o_proj(self._cached_kernels(qg, k, v, batch))
        qg = qg.view(B, T, self.heads, 2 * self.head_dim)
        q, gate = qg[..., : self.head_dim], qg[..., self.head_dim :].reshape(B, T, -1)
        q = self.rotary(self.q_norm(q), batch.positions)
        k = self.rotary(self.k_norm(k.view(B, T, self.kv_heads, self.head_dim)), batch.positions)
        v = v.view(B, T, self.kv_heads, self.head_dim)

        if batch.slots is not None:
            tables = self.tables[batch.slots]
            where = paged_index(tables, batch.positions, self.k_cache.shape[1])
            self.k_cache.flatten(0, 1)[where] = k
            self.v_cache.flatten(0, 1)[where] = v
        if batch.slots is None or (batch.kv_len == T and self.k_cache.dtype == k.dtype and not self.invariant):
            # every row's positions are 0..T-1 (T distinct positions below kv_len = T): the keys are
            # exactly this pass's, so plain causal attention over them (the flash kernel, no mask)
            out = F.scaled_dot_product_attention(
                q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True, enable_gqa=True
            )
        elif self.invariant:  # (the kernels above are per token too; prefill as decode: see layers.gdn.delta_rule)
            keys, values = (gather_paged(cache, tables, batch.kv_len) for cache in (self.k_cache, self.v_cache))
            out = exact_length_attention(q, keys, values, batch.positions)
        else:
            keys = gather_paged(self.k_cache, tables, batch.kv_len).transpose(1, 2)
            values = gather_paged(self.v_cache, tables, batch.kv_len).transpose(1, 2)
            out = None
            if batch.tail and self.k_cache.dtype == k.dtype:
                out = tail_causal_flash(q.transpose(1, 2), keys, values)
            if out is None:  # a [B, T, L] mask: SDPA's math path (fp32 for bf16 inputs)
                visible = torch.arange(batch.kv_len, device=x.device) <= batch.positions[..., None]
                out = F.scaled_dot_product_attention(
                    q.transpose(1, 2), keys, values, attn_mask=visible[:, None], enable_gqa=True
                )
        out = out.transpose(1, 2).reshape(B, T, -1) * pointwise(torch.sigmoid, gate, self.invariant)
        return self.o_proj(out)

    def _cached_kernels(self, qg: torch.Tensor, k: torch.Tensor, v: torch.Tensor, batch: Batch) -> torch.Tensor:
        """Decode and verify passes on CUDA: two kernels read and write the cache in place."""
        tables = self.tables[batch.slots]
        q = kernels.attention.qk_norm_rope(
            qg, k, v, self.q_norm.weight, self.k_norm.weight, self.rotary.inv_freq(qg.device),
            batch.positions, tables, self.k_cache, self.v_cache, self.q_norm.eps,
        )
        # (batch-invariant: no splits of the keys, whose number follows the batch)
        return kernels.attention.cached_attention(q, qg, self.k_cache, self.v_cache, batch.positions, tables,
                                                  splits=1 if self.invariant else None)
