"""The routed experts of a mixture of experts at a few (token, expert) rows: decode and verify.

At a few rows the expert path is bound by latency: the bytes are the hit experts' weights (6 MB an
expert at the 35B-A3B shapes, 2 µs at HBM speed), and sorting the rows by expert for a grouped GEMM
costs a dozen small launches. Here two launches, no sorting, each program one GEMV tile:
- `_gate_up_kernel`, one program per (row, block of BLOCK_I intermediate columns): the row's expert's
  gate rows and the matching up rows streamed along H (the contiguous dim), fp32 sums; it writes
  h = silu(gate) · up rounded as layers.mlp.silu_mul rounds (gate, up, silu(gate) and the product
  each to the activations' dtype, to nearest, as the matmul's output and the eager elementwise ops are).
- `_down_kernel`, one program per (token, block of BLOCK_H output columns): the down tiles of all k
  slots loaded at once ([k, BLOCK_H, BLOCK_I] per step along I: k times the bytes in flight of a
  slot-by-slot loop), each slot's output rounded to the dtype, times its weight (rounded), added in
  slot order (rounded): the arithmetic of layers.moe._weighted_sum, so bf16 agrees with the grouped
  backend but for the order of the fp32 sums inside each dot product.
A row whose expert is not held here (another rank's, under expert parallelism) loads nothing and
adds 0. Each token's result depends on its own rows alone (batch-invariant), and no step reads a
value back to the host: CUDA graphs capture it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl


@dataclass(frozen=True)
class Blocks:
    """Tile sizes: gate/up columns per program and its step along H; down columns per program and
    its step along the width; warps and tiles in flight (stages) of each kernel."""

    # The fastest of the tiles bench/moe_kernels.py --sweep timed on an H200 at the 35B-A3B shapes
    # (each kernel chosen on its own: they are separate launches; 36 gate/up and 18 down variants at
    # 1, 4, 8 and 32 tokens, docs/data/moe-kernels-sweep-stages.log). gate/up: 16 columns a program
    # (32 programs an expert at width 512, 288 at one token's 8 rows and the shared expert), each
    # loading 2 × 16 × 512 bf16 = 32 KB a step: against steps of 256, 8 % less time at 1 token,
    # within 1 % at 4 to 32.
    gate_up_i: int = 16
    gate_up_k: int = 512
    gate_up_warps: int = 4
    gate_up_stages: int = 3
    # down: 2 output columns a program (1,024 programs at one token, H = 2048), each loading 8 slots ×
    # 2 × 128 bf16 = 4 KB a step: against 4 columns 8 % less time at 1 token, 4 % at 4, 0.5 % at 8,
    # 2 % more at 32
    down_h: int = 2
    down_i: int = 128
    down_warps: int = 4
    down_stages: int = 3


BLOCKS = Blocks()


@triton.jit
def _round(v, dtype: tl.constexpr):
    """v (fp32) rounded to the nearest `dtype` value (ties to even), kept in fp32. bf16 by its bits:
    the same on the GPU and in Triton's CPU interpreter (whose casts to bf16 truncate)."""
    if dtype == tl.bfloat16:
        bits = v.to(tl.int32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & -65536
        return bits.to(tl.float32, bitcast=True)
    else:
        return v.to(dtype).to(tl.float32)


@triton.jit
def _gate_up_kernel(x_ptr, ids_ptr, w_ptr, shared_ptr, h_ptr, E, width, H, k, routed, stride_x, stride_we,
                    stride_wn, stride_h, EVEN: tl.constexpr, BLOCK_I: tl.constexpr, BLOCK_K: tl.constexpr):
    row, pid_i = tl.program_id(0), tl.program_id(1)
    shared = row >= routed  # rows past the routed ones: each token's shared-expert row (its own weights)
    expert = tl.load(ids_ptr + tl.minimum(row, routed - 1))
    held = shared | ((expert >= 0) & (expert < E))
    expert = tl.where(held & ~shared, expert, 0).to(tl.int64)
    token = tl.where(shared, row - routed, row // k).to(tl.int64)
    n = pid_i * BLOCK_I + tl.arange(0, BLOCK_I)
    rows = n[:, None] < tl.where(held, width, 0)  # none of another rank's expert (a tensor mask, not a scalar)
    kk = tl.arange(0, BLOCK_K)
    base = tl.where(shared, shared_ptr, w_ptr + expert * stride_we)
    gate_ptrs = base + n[:, None] * stride_wn + kk[None, :]
    up_ptrs = gate_ptrs + width * stride_wn  # the up rows follow the expert's gate rows
    x_ptrs = x_ptr + token * stride_x + kk
    acc_gate = tl.zeros([BLOCK_I, BLOCK_K], dtype=tl.float32)
    acc_up = tl.zeros([BLOCK_I, BLOCK_K], dtype=tl.float32)
    for k0 in range(0, H, BLOCK_K):
        if EVEN:  # whole tiles: a mask constant along H, so the loads stay 16-byte vectors
            x = tl.load(x_ptrs + k0).to(tl.float32)
            gate = tl.load(gate_ptrs + k0, mask=rows, other=0.0).to(tl.float32)
            up = tl.load(up_ptrs + k0, mask=rows, other=0.0).to(tl.float32)
        else:
            in_k = k0 + kk < H
            mask = rows & in_k[None, :]
            x = tl.load(x_ptrs + k0, mask=in_k, other=0.0).to(tl.float32)
            gate = tl.load(gate_ptrs + k0, mask=mask, other=0.0).to(tl.float32)
            up = tl.load(up_ptrs + k0, mask=mask, other=0.0).to(tl.float32)
        acc_gate += gate * x[None, :]
        acc_up += up * x[None, :]
    dtype = h_ptr.dtype.element_ty
    gate = _round(tl.sum(acc_gate, axis=1), dtype)
    up = _round(tl.sum(acc_up, axis=1), dtype)
    act = _round(gate * tl.sigmoid(gate), dtype)  # silu rounds before the product, as in eager
    tl.store(h_ptr + row.to(tl.int64) * stride_h + n, _round(act * up, dtype).to(dtype), mask=n < width)


@triton.jit
def _down_kernel(h_ptr, ids_ptr, weights_ptr, w_ptr, shared_ptr, gate_ptr, out_ptr, E, width, H, k, routed,
                 stride_h, stride_we, stride_wn, stride_out, EVEN: tl.constexpr, SLOTS: tl.constexpr,
                 BLOCK_H: tl.constexpr, BLOCK_I: tl.constexpr, SHARED: tl.constexpr):
    token, pid_h = tl.program_id(0), tl.program_id(1)
    slot = tl.arange(0, SLOTS)
    rows = token.to(tl.int64) * k + slot
    expert = tl.load(ids_ptr + rows, mask=slot < k, other=-1)
    held = (slot < k) & (expert >= 0) & (expert < E)
    expert = tl.where(held, expert, 0).to(tl.int64)
    weight = tl.load(weights_ptr + rows, mask=slot < k, other=0.0).to(tl.float32)
    n = pid_h * BLOCK_H + tl.arange(0, BLOCK_H)
    ii = tl.arange(0, BLOCK_I)
    w_ptrs = w_ptr + expert[:, None, None] * stride_we + n[None, :, None] * stride_wn + ii[None, None, :]
    h_ptrs = h_ptr + rows[:, None] * stride_h + ii[None, :]
    # the shared expert (SHARED): its own tile along, its row past the routed rows
    shared_w_ptrs = shared_ptr + n[:, None] * stride_wn + ii[None, :]
    shared_h_ptrs = h_ptr + (routed + token).to(tl.int64) * stride_h + ii
    acc = tl.zeros([SLOTS, BLOCK_H], dtype=tl.float32)
    acc_shared = tl.zeros([BLOCK_H], dtype=tl.float32)
    for i0 in range(0, width, BLOCK_I):
        if EVEN:
            mask = held[:, None, None]
            h = tl.load(h_ptrs + i0, mask=held[:, None], other=0.0).to(tl.float32)
        else:
            in_i = i0 + ii < width
            mask = held[:, None, None] & (n < H)[None, :, None] & in_i[None, None, :]
            h = tl.load(h_ptrs + i0, mask=held[:, None] & in_i[None, :], other=0.0).to(tl.float32)
        w = tl.load(w_ptrs + i0, mask=mask, other=0.0).to(tl.float32)
        acc += tl.sum(w * h[:, None, :], axis=2)
        if SHARED:
            if EVEN:
                hs = tl.load(shared_h_ptrs + i0).to(tl.float32)
                ws = tl.load(shared_w_ptrs + i0).to(tl.float32)
            else:
                hs = tl.load(shared_h_ptrs + i0, mask=in_i, other=0.0).to(tl.float32)
                ws = tl.load(shared_w_ptrs + i0, mask=(n < H)[:, None] & in_i[None, :], other=0.0).to(tl.float32)
            acc_shared += tl.sum(ws * hs[None, :], axis=1)
    dtype = out_ptr.dtype.element_ty
    part = _round(_round(acc, dtype) * weight[:, None], dtype)  # expert(row) · w, each rounded
    out = tl.sum(tl.where(slot[:, None] == 0, part, 0.0), axis=0)
    for s in tl.static_range(1, SLOTS):  # slot order; padding slots (s ≥ k) add an exact 0
        out = _round(out + tl.sum(tl.where(slot[:, None] == s, part, 0.0), axis=0), dtype)
    if SHARED:  # after the routed ones, as the eager sum adds it
        gate = tl.load(gate_ptr + token).to(tl.float32)
        out = _round(out + _round(_round(acc_shared, dtype) * gate, dtype), dtype)
    tl.store(out_ptr + token.to(tl.int64) * stride_out + n, out.to(dtype), mask=n < H)


def experts(x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor,
            shared: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
            blocks: Blocks = BLOCKS) -> torch.Tensor:
    """Σ_j weights[:, j] · expert_{ids[:, j]}(x) for x [N, H], weights and ids [N, k] (ids local to
    this rank: outside [0, E) adds nothing), gate_up [E, 2I, H] (gate rows, then up rows), down
    [E, H, width]: [N, H] in x's dtype. `shared` (gate_up [2I, H], down [H, width], gate [N, 1]): a
    shared expert of the same width, added last with its weight `gate` (as one more slot per token)."""
    N, H = x.shape
    k = ids.shape[1]
    E, width = down.shape[0], down.shape[2]
    assert gate_up.shape == (E, 2 * width, H) and down.shape == (E, H, width), (gate_up.shape, down.shape)
    assert gate_up.stride(-1) == 1 and down.stride(-1) == 1 and x.stride(-1) == 1
    ids, weights = ids.contiguous(), weights.contiguous()
    shared_gate_up, shared_down, gate = shared if shared is not None else (gate_up, down, weights)
    if shared is not None:
        assert shared_gate_up.shape == (2 * width, H) and shared_down.shape == (H, width), (shared_gate_up.shape,
                                                                                           shared_down.shape)
        assert shared_gate_up.is_contiguous() and shared_down.is_contiguous() and gate.numel() == N
        gate = gate.contiguous()
    routed = N * k
    h = torch.empty(routed + (N if shared is not None else 0), width, dtype=x.dtype, device=x.device)
    out = torch.empty(N, H, dtype=x.dtype, device=x.device)
    even = H % blocks.gate_up_k == 0 and width % blocks.gate_up_i == 0
    _gate_up_kernel[(h.shape[0], triton.cdiv(width, blocks.gate_up_i))](
        x, ids, gate_up, shared_gate_up, h, E, width, H, k, routed, x.stride(0), gate_up.stride(0),
        gate_up.stride(1), h.stride(0), EVEN=even, BLOCK_I=blocks.gate_up_i, BLOCK_K=blocks.gate_up_k,
        num_warps=blocks.gate_up_warps, num_stages=blocks.gate_up_stages)
    even = H % blocks.down_h == 0 and width % blocks.down_i == 0
    _down_kernel[(N, triton.cdiv(H, blocks.down_h))](
        h, ids, weights, down, shared_down, gate, out, E, width, H, k, routed, h.stride(0), down.stride(0),
        down.stride(1), out.stride(0), EVEN=even, SLOTS=triton.next_power_of_2(k),
        BLOCK_H=blocks.down_h, BLOCK_I=blocks.down_i, SHARED=shared is not None, num_warps=blocks.down_warps,
        num_stages=blocks.down_stages)
    return out


@triton.jit
def _route_kernel(logits_ptr, weights_ptr, ids_ptr, gate_ptr, E, stride_logits, K: tl.constexpr,
                  SLOTS: tl.constexpr, BLOCK_E: tl.constexpr, SHARED: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    e = tl.arange(0, BLOCK_E)
    x = tl.load(logits_ptr + row * stride_logits + e, mask=e < E, other=float("-inf")).to(tl.float32)
    p = tl.exp(x - tl.max(x, axis=0))
    p = p / tl.sum(p, axis=0)  # the fp32 softmax
    p = tl.where(e < E, p, -1.0)
    slot = tl.arange(0, SLOTS)
    picked = tl.zeros([SLOTS], dtype=tl.float32)
    ids = tl.zeros([SLOTS], dtype=tl.int64)
    for j in tl.static_range(K):  # the largest first; of equal ones the lowest expert id
        best = tl.max(p, axis=0)
        index = tl.min(tl.where(p == best, e, BLOCK_E), axis=0)
        picked = tl.where(slot == j, best, picked)
        ids = tl.where(slot == j, index, ids)
        p = tl.where(e == index, -1.0, p)
    total = tl.sum(picked, axis=0)
    dtype = weights_ptr.dtype.element_ty
    tl.store(weights_ptr + row * K + slot, _round(picked / total, dtype).to(dtype), mask=slot < K)
    tl.store(ids_ptr + row * K + slot, ids, mask=slot < K)
    if SHARED:  # the shared expert's gate: sigmoid of the logit after the router's, rounded to the dtype
        seg = tl.load(logits_ptr + row * stride_logits + E).to(tl.float32)
        tl.store(gate_ptr + row, _round(1.0 / (1.0 + tl.exp(-seg)), dtype).to(dtype))


def route(logits: torch.Tensor, experts: int, top_k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """One launch for layers.moe.route and the shared expert's gate: logits [N, experts] (the
    router's), or [N, experts + 1] with the shared expert's gate logit last. Returns (weights [N, k]
    in the logits' dtype, expert ids [N, k] int64, sigmoid of the gate logit [N, 1] or None)."""
    N, width = logits.shape
    assert width in (experts, experts + 1) and logits.stride(-1) == 1, logits.shape
    shared = width == experts + 1
    weights = torch.empty(N, top_k, dtype=logits.dtype, device=logits.device)
    ids = torch.empty(N, top_k, dtype=torch.int64, device=logits.device)
    gate = torch.empty(N, 1, dtype=logits.dtype, device=logits.device) if shared else None
    if N:
        _route_kernel[(N,)](logits, weights, ids, gate if shared else weights, experts, logits.stride(0), K=top_k,
                            SLOTS=triton.next_power_of_2(top_k), BLOCK_E=triton.next_power_of_2(experts),
                            SHARED=shared, num_warps=4 if experts >= 512 else 1)
    return weights, ids, gate
