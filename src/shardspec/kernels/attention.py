"""Gated attention kernels for decode and verify passes over the paged KV cache, read in place.

The cache is one pool of blocks [num_blocks, block_tokens, HKV, D]; position p of row b lives in
block tables[b, p // block_tokens] at offset p % block_tokens. `qk_norm_rope` normalises
(zero-centred RMSNorm per head) and rotates q and k, and writes k and v into the cache there;
`cached_attention` attends each query to its row's keys up to its own position (online softmax over
key tiles) and multiplies by sigmoid(gate).
"""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl

INTERPRETER = os.environ.get("TRITON_INTERPRET") == "1"


@triton.jit
def _qk_norm_rope_kernel(q_ptr, k_ptr, v_ptr, qw_ptr, kw_ptr, inv_freq_ptr, pos_ptr, tables_ptr, q_out_ptr,
                         k_cache_ptr, v_cache_ptr, T, stride_q, stride_k, stride_v, max_blocks, eps,
                         HQ: tl.constexpr, HKV: tl.constexpr, D: tl.constexpr, DP: tl.constexpr,
                         ROT: tl.constexpr, BLOCK: tl.constexpr):
    token = tl.program_id(0).to(tl.int64)  # b * T + t
    head = tl.program_id(1)
    is_q = head < HQ
    cols = tl.arange(0, DP)  # the head dim padded to a power of two; lanes from D on are masked
    live = cols < D
    half: tl.constexpr = ROT // 2
    partner = tl.where(cols < half, cols + half, cols - half)
    sign = tl.where(cols < half, -1.0, 1.0)
    rotary = cols < ROT
    if is_q:
        src = q_ptr + token * stride_q + head * 2 * D  # q_proj rows hold [query | gate] per head
        w_ptr = qw_ptr
    else:
        src = k_ptr + token * stride_k + (head - HQ) * D
        w_ptr = kw_ptr
    dtype = q_out_ptr.dtype.element_ty
    x = tl.load(src + cols, mask=live, other=0.0).to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(x * x, 0) / D + eps)
    normed = (x * rstd * (1.0 + tl.load(w_ptr + cols, mask=live, other=0.0).to(tl.float32))).to(dtype)
    other = tl.load(src + partner, mask=live, other=0.0).to(tl.float32)
    other = (other * rstd * (1.0 + tl.load(w_ptr + partner, mask=live, other=0.0).to(tl.float32))).to(dtype)
    freq = tl.load(pos_ptr + token).to(tl.float32) * tl.load(inv_freq_ptr + (cols % half), mask=rotary, other=0.0)
    cos = tl.cos(freq).to(dtype).to(tl.float32)
    sin = tl.sin(freq).to(dtype).to(tl.float32)
    # rotate-half over the first ROT channels, each product rounded as in eager bf16
    rotated = ((normed.to(tl.float32) * cos).to(dtype).to(tl.float32)
               + (sign * other.to(tl.float32) * sin).to(dtype).to(tl.float32))
    out = tl.where(rotary, rotated.to(dtype), normed)
    if is_q:
        tl.store(q_out_ptr + (token * HQ + head) * D + cols, out, mask=live)
    else:
        b = token // T
        position = tl.load(pos_ptr + token)
        block = tl.load(tables_ptr + b * max_blocks + position // BLOCK).to(tl.int64)
        where = ((block * BLOCK + position % BLOCK) * HKV + (head - HQ)) * D + cols
        tl.store(k_cache_ptr + where, out, mask=live)
        tl.store(v_cache_ptr + where, tl.load(v_ptr + token * stride_v + (head - HQ) * D + cols, mask=live), mask=live)


def qk_norm_rope(qg: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_weight: torch.Tensor, k_weight: torch.Tensor,
                 inv_freq: torch.Tensor, positions: torch.Tensor, tables: torch.Tensor, k_cache: torch.Tensor,
                 v_cache: torch.Tensor, eps: float) -> torch.Tensor:
    """qg [B, T, HQ*2D] (query|gate per head), k, v [B, T, HKV*D]: returns rotated q [B, T, HQ, D];
    the rotated k and v go into the caches [blocks, block_tokens, HKV, D] at position p of row b:
    block tables[b, p // block_tokens] ([B, max_blocks] int32), offset p % block_tokens."""
    B, T, _ = qg.shape
    block_tokens, HKV, D = k_cache.shape[1:]
    HQ = qg.shape[-1] // (2 * D)
    qg2, k2, v2 = qg.reshape(B * T, -1), k.reshape(B * T, -1), v.reshape(B * T, -1)
    assert qg2.stride(1) == 1 and k2.stride(1) == 1 and v2.stride(1) == 1 and k_cache.is_contiguous()
    assert tables.is_contiguous() and block_tokens & (block_tokens - 1) == 0
    q_out = torch.empty(B, T, HQ, D, dtype=qg.dtype, device=qg.device)
    positions = positions.contiguous()
    _qk_norm_rope_kernel[(B * T, HQ + HKV)](
        qg2, k2, v2, q_weight, k_weight, inv_freq, positions, tables, q_out, k_cache, v_cache, T,
        qg2.stride(0), k2.stride(0), v2.stride(0), tables.shape[1], eps, HQ=HQ, HKV=HKV, D=D,
        DP=triton.next_power_of_2(D), ROT=2 * inv_freq.numel(), BLOCK=block_tokens,
        num_warps=1,
    )
    return q_out


@triton.jit
def _finish(acc, denom, gate_ptr, out_ptr, token, heads, cols, tile, stride_g, HQ: tl.constexpr, D: tl.constexpr):
    """Rows (token, head) of attention's output: acc / denom rounded to the output's dtype, times
    sigmoid(gate) (each head's gate: the second half of its query|gate projection)."""
    dtype = out_ptr.dtype.element_ty
    attended = (acc / tl.where(denom > 0, denom, 1.0)[:, None]).to(dtype).to(tl.float32)
    gate = tl.load(gate_ptr + token[:, None] * stride_g + heads[:, None] * 2 * D + cols[None, :], mask=tile,
                   other=0.0).to(tl.float32)
    gate = tl.sigmoid(gate).to(dtype).to(tl.float32)
    tl.store(out_ptr + (token[:, None] * HQ + heads[:, None]) * D + cols[None, :], (attended * gate).to(dtype),
             mask=tile)


@triton.jit
def _keep_part(acc, denom, m, acc_ptr, m_ptr, l_ptr, token, kv_head, split, g, cols, row_live, in_head,
               HKV: tl.constexpr, SPLITS: tl.constexpr, GW: tl.constexpr, DP: tl.constexpr):
    """A split's unnormalised sums for its rows (token, g < GW) into the workspace [N, HKV, SPLITS, GW(, DP)]."""
    at = ((token * HKV + kv_head) * SPLITS + split) * GW + g
    keep = row_live & (g < GW)
    tl.store(m_ptr + at, m, mask=keep)
    tl.store(l_ptr + at, denom, mask=keep)
    tl.store(acc_ptr + at[:, None] * DP + cols[None, :], acc, mask=keep[:, None] & in_head[None, :])


@triton.jit
def _attend(q, m, denom, acc, k_cache_ptr, v_cache_ptr, table, kv_head, last, lo, hi, cols, in_head, scale,
            HKV: tl.constexpr, D: tl.constexpr, BN: tl.constexpr, BLOCK: tl.constexpr, DOT_FP32: tl.constexpr):
    """Online softmax of the query rows q against the keys lo .. hi - 1 (each row: those <= its `last`),
    read through the block table in tiles of BN; returns (m, denom, acc)."""
    for start in range(lo, hi, BN):
        keys = start + tl.arange(0, BN)
        present = keys < hi
        # a tile may span blocks: each key's block from the table (entries past the range never read)
        blocks = tl.load(table + keys // BLOCK, mask=present, other=0).to(tl.int64)
        rows = (blocks * BLOCK + keys % BLOCK) * HKV + kv_head
        offsets = rows[:, None] * D + cols[None, :]
        kv_tile = present[:, None] & in_head[None, :]
        k = tl.load(k_cache_ptr + offsets, mask=kv_tile, other=0.0)
        v = tl.load(v_cache_ptr + offsets, mask=kv_tile, other=0.0)
        if DOT_FP32:  # float32 models (no TF32), and Triton's interpreter, which has no bf16 dot
            scores = tl.dot(q.to(tl.float32), tl.trans(k.to(tl.float32)), input_precision="ieee") * scale
        else:
            scores = tl.dot(q, tl.trans(k)) * scale  # [rows, BN]
        scores = tl.where(present[None, :] & (keys[None, :] <= last[:, None]), scores, float("-inf"))
        m_new = tl.maximum(m, tl.max(scores, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # (a row that sees no key yet)
        p = tl.exp(scores - m_safe[:, None])
        correction = tl.exp(m - m_safe)
        denom = denom * correction + tl.sum(p, 1)
        if DOT_FP32:
            acc = acc * correction[:, None] + tl.dot(p, v.to(tl.float32), input_precision="ieee")
        else:
            acc = acc * correction[:, None] + tl.dot(p.to(v.dtype), v)
        m = m_new
    return m, denom, acc


@triton.jit
def _split_range(n_keys, split, SPLITS: tl.constexpr, BN: tl.constexpr):
    """Split `split` of SPLITS of the keys 0 .. n_keys - 1: whole tiles, the last splits empty if need be."""
    per = tl.cdiv(tl.cdiv(n_keys, SPLITS), BN) * BN
    lo = split * per
    return lo, tl.minimum(lo + per, n_keys)


@triton.jit
def _cached_attention_kernel(q_ptr, gate_ptr, k_cache_ptr, v_cache_ptr, pos_ptr, tables_ptr, out_ptr, acc_ptr, m_ptr,
                             l_ptr, T, stride_g, max_blocks, scale, HQ: tl.constexpr, HKV: tl.constexpr,
                             D: tl.constexpr, DP: tl.constexpr, GROUP: tl.constexpr, GP: tl.constexpr,
                             GW: tl.constexpr, BN: tl.constexpr, BLOCK: tl.constexpr, DOT_FP32: tl.constexpr,
                             SPLITS: tl.constexpr):
    """A program per (token, KV head, split of its keys): the token's query heads of the KV head
    (GP rows, GROUP live) against its keys up to its position; with SPLITS > 1, its split's partial
    sums into the workspace (_combine_kernel finishes)."""
    token = tl.program_id(0).to(tl.int64)  # b * T + t
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    b = token // T
    table = tables_ptr + b * max_blocks
    last = tl.load(pos_ptr + token)  # this query sees keys 0 .. last
    g = tl.arange(0, GP)
    heads = kv_head * GROUP + g
    live = g < GROUP
    cols = tl.arange(0, DP)  # the head dim padded to a power of two (at least 16, for tl.dot); masked
    in_head = cols < D
    tile = live[:, None] & in_head[None, :]
    rows_token = token + tl.zeros([GP], dtype=tl.int64)
    q = tl.load(q_ptr + (token * HQ + heads[:, None]) * D + cols[None, :], mask=tile, other=0.0)
    m = tl.full([GP], float("-inf"), dtype=tl.float32)
    denom = tl.zeros([GP], dtype=tl.float32)
    acc = tl.zeros([GP, DP], dtype=tl.float32)
    lo, hi = _split_range(last + 1, split, SPLITS, BN)
    m, denom, acc = _attend(q, m, denom, acc, k_cache_ptr, v_cache_ptr, table, kv_head, last + tl.zeros([GP], tl.int64),
                            lo, hi, cols, in_head, scale, HKV, D, BN, BLOCK, DOT_FP32)
    if SPLITS == 1:
        _finish(acc, denom, gate_ptr, out_ptr, rows_token, heads, cols, tile, stride_g, HQ, D)
    else:
        _keep_part(acc, denom, m, acc_ptr, m_ptr, l_ptr, rows_token, kv_head, split, g, cols, live, in_head, HKV,
                   SPLITS, GW, DP)


@triton.jit
def _tiled_attention_kernel(q_ptr, gate_ptr, k_cache_ptr, v_cache_ptr, pos_ptr, tables_ptr, out_ptr, acc_ptr, m_ptr,
                            l_ptr, T, stride_g, max_blocks, scale, HQ: tl.constexpr, HKV: tl.constexpr,
                            D: tl.constexpr, DP: tl.constexpr, GROUP: tl.constexpr, GP: tl.constexpr,
                            GW: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BLOCK: tl.constexpr,
                            DOT_FP32: tl.constexpr, SPLITS: tl.constexpr):
    """_cached_attention_kernel for BM tokens of a row at once (a long pass: a padded prefill), so
    that each key tile is read once for all of them: rows r = (token t0 + r // GP, head r % GP)."""
    blocks_per_row = tl.cdiv(T, BM)
    b = (tl.program_id(0) // blocks_per_row).to(tl.int64)
    t0 = (tl.program_id(0) % blocks_per_row) * BM
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    table = tables_ptr + b * max_blocks
    r = tl.arange(0, BM * GP)
    t = t0 + r // GP
    g = r % GP
    live = (g < GROUP) & (t < T)
    token = b * T + t
    heads = kv_head * GROUP + g
    last = tl.load(pos_ptr + token, mask=live, other=-1)  # each row sees keys 0 .. last
    top = tl.load(pos_ptr + b * T + tl.minimum(t0 + BM, T) - 1)  # the block's last token sees the most
    cols = tl.arange(0, DP)
    in_head = cols < D
    tile = live[:, None] & in_head[None, :]
    q = tl.load(q_ptr + (token[:, None] * HQ + heads[:, None]) * D + cols[None, :], mask=tile, other=0.0)
    m = tl.full([BM * GP], float("-inf"), dtype=tl.float32)
    denom = tl.zeros([BM * GP], dtype=tl.float32)
    acc = tl.zeros([BM * GP, DP], dtype=tl.float32)
    lo, hi = _split_range(top + 1, split, SPLITS, BN)
    m, denom, acc = _attend(q, m, denom, acc, k_cache_ptr, v_cache_ptr, table, kv_head, last, lo, hi, cols, in_head,
                            scale, HKV, D, BN, BLOCK, DOT_FP32)
    if SPLITS == 1:
        _finish(acc, denom, gate_ptr, out_ptr, token, heads, cols, tile, stride_g, HQ, D)
    else:
        _keep_part(acc, denom, m, acc_ptr, m_ptr, l_ptr, token, kv_head, split, g, cols, live, in_head, HKV, SPLITS,
                   GW, DP)


@triton.jit
def _combine_kernel(gate_ptr, out_ptr, acc_ptr, m_ptr, l_ptr, stride_g, HQ: tl.constexpr, HKV: tl.constexpr,
                    D: tl.constexpr, DP: tl.constexpr, GROUP: tl.constexpr, GW: tl.constexpr,
                    SPLITS: tl.constexpr):
    """A program per (token, KV head): its splits' partial sums rescaled to their common maximum and
    added in split order, then finished as without splits."""
    token = tl.program_id(0).to(tl.int64)
    kv_head = tl.program_id(1)
    g = tl.arange(0, GW)
    live = g < GROUP
    heads = kv_head * GROUP + g
    cols = tl.arange(0, DP)
    in_head = cols < D
    tile = live[:, None] & in_head[None, :]
    base = (token * HKV + kv_head) * SPLITS * GW + g
    top = tl.full([GW], float("-inf"), dtype=tl.float32)
    for split in range(SPLITS):
        top = tl.maximum(top, tl.load(m_ptr + base + split * GW, mask=live, other=float("-inf")))
    top = tl.where(top == float("-inf"), 0.0, top)
    denom = tl.zeros([GW], dtype=tl.float32)
    acc = tl.zeros([GW, DP], dtype=tl.float32)
    for split in range(SPLITS):
        at = base + split * GW
        weight = tl.exp(tl.load(m_ptr + at, mask=live, other=float("-inf")) - top)
        denom += tl.load(l_ptr + at, mask=live, other=0.0) * weight
        acc += tl.load(acc_ptr + at[:, None] * DP + cols[None, :], mask=tile, other=0.0) * weight[:, None]
    _finish(acc, denom, gate_ptr, out_ptr, token + tl.zeros([GW], dtype=tl.int64), heads, cols, tile, stride_g, HQ, D)


TILE_MIN_TOKENS = 17  # passes of this many tokens a row and more read each key tile once per 64 query rows
SPLIT_PROGRAMS = 2  # programs a streaming multiprocessor the splits of the keys aim for
MAX_SPLITS = 32


def splits_for(programs: int, device: torch.device) -> int:
    """Key splits a program per (token or token block, KV head) takes so that `programs` of them
    become about SPLIT_PROGRAMS a multiprocessor: a few tokens over a long context otherwise keep most
    of the GPU idle (at batch 1, four programs each reading every key)."""
    if device.type != "cuda":
        return 1
    return max(1, min(MAX_SPLITS, SPLIT_PROGRAMS * _multiprocessors(device.index) // max(programs, 1)))


@functools.cache
def _multiprocessors(index: int | None) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def cached_attention(q: torch.Tensor, qg: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                     positions: torch.Tensor, tables: torch.Tensor, splits: int | None = None) -> torch.Tensor:
    """q [B, T, HQ, D] rotated; qg [B, T, HQ*2D] (the gate is each head's second half); caches
    [blocks, block_tokens, HKV, D] read through tables [B, max_blocks] int32 -> [B, T, HQ*D]. Decode
    and verify passes: a program per token and KV head; longer ones (TILE_MIN_TOKENS) a program per
    block of tokens and KV head; each over `splits` ranges of its keys (None: splits_for the GPU;
    1: none, a token's arithmetic then independent of the batch), whose sums a second kernel adds."""
    B, T, HQ, D = q.shape
    block_tokens, HKV = k_cache.shape[1:3]
    group = HQ // HKV
    qg2 = qg.reshape(B * T, -1)
    assert tables.is_contiguous() and q.is_contiguous() and block_tokens & (block_tokens - 1) == 0
    out = torch.empty(B, T, HQ * D, dtype=q.dtype, device=q.device)
    gw, dp = triton.next_power_of_2(group), max(16, triton.next_power_of_2(D))
    tiled = T >= TILE_MIN_TOKENS
    bm = max(1, 64 // gw) if tiled else 1
    programs = B * triton.cdiv(T, bm)
    splits = splits_for(programs * HKV, q.device) if splits is None else splits
    parts = [torch.empty(B * T, HKV, splits, gw, *size, dtype=torch.float32, device=q.device)
             for size in ((dp,), (), ())] if splits > 1 else [out] * 3
    common = dict(HQ=HQ, HKV=HKV, D=D, DP=dp, GROUP=group, GW=gw, BN=32, BLOCK=block_tokens,
                  DOT_FP32=q.dtype == torch.float32 or INTERPRETER, SPLITS=splits, num_warps=4)
    args = (q, qg2[:, D:], k_cache, v_cache, positions.contiguous(), tables, out, *parts, T, qg2.stride(0),
            tables.shape[1], D**-0.5)
    if tiled:
        _tiled_attention_kernel[(programs, HKV, splits)](*args, GP=gw, BM=bm, **common)
    else:
        _cached_attention_kernel[(programs, HKV, splits)](*args, GP=max(16, gw), **common)
    if splits > 1:
        _combine_kernel[(B * T, HKV)](qg2[:, D:], out, *parts, qg2.stride(0), HQ=HQ, HKV=HKV, D=D, DP=dp, GROUP=group,
                                      GW=gw, SPLITS=splits, num_warps=4)
    return out
