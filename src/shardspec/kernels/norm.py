"""RMSNorm kernels: the zero-centred norm (optionally fused with the residual add before it, and with
the tensor-parallel all-reduce before that), the gated norm of Gated DeltaNet's output, and
SiLU(gate) * up of the MLP."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from shardspec.kernels import rows


@triton.jit
def _add_norm_store(x, res_ptr, w_ptr, y_ptr, sum_ptr, row, cols, mask, D, eps, stride_r, HAS_RES: tl.constexpr):
    """Store norm(x + residual) · (1 + w) and, with a residual, x + residual: one row."""
    if HAS_RES:  # the sum rounds to the input dtype first, as `x + residual` does
        x = (x.to(tl.float32) + tl.load(res_ptr + row * stride_r + cols, mask=mask, other=0.0).to(tl.float32))
        x = x.to(sum_ptr.dtype.element_ty)
        tl.store(sum_ptr + row * D + cols, x, mask=mask)
    x = x.to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(x * x, 0) / D + eps)
    w = 1.0 + tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(y_ptr + row * D + cols, (x * rstd * w).to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _rms_norm_kernel(x_ptr, res_ptr, w_ptr, y_ptr, sum_ptr, D, eps, stride_x, stride_r,
                     HAS_RES: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < D
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    _add_norm_store(x, res_ptr, w_ptr, y_ptr, sum_ptr, row, cols, mask, D, eps, stride_r, HAS_RES)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None,
             num_warps: int | None = None):
    """norm(x) · (1 + w); with `residual`: (norm(x + residual), x + residual); num_warps: the
    launch's (default: `warps`)."""
    return _launch_norm(_rms_norm_kernel, x, weight, eps, residual, num_warps=num_warps)


def warps(D: int) -> int:
    """Warps of one row's program: at a 9B's 4096, 16 take 2.1 µs a call against 2.5 for 4 and
    2.8 for 1 (bench/norm.py, at 1-32 rows)."""
    return 16 if D >= 4096 else (4 if D >= 1024 else 1)


def _launch_norm(kernel, x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None,
                 *extra, num_warps: int | None = None, **constants):
    """One program per row of x; `extra` and `constants` go after the common arguments."""
    shape, D = x.shape, x.shape[-1]
    x2 = rows(x)
    r2 = rows(residual) if residual is not None else x2
    y = torch.empty(shape, dtype=x.dtype, device=x.device)
    total = torch.empty(shape, dtype=x.dtype, device=x.device) if residual is not None else y
    kernel[(x2.shape[0],)](x2, r2, weight, y, total, D, eps, x2.stride(0), r2.stride(0), *extra,
                           HAS_RES=residual is not None, BLOCK=triton.next_power_of_2(D),
                           num_warps=num_warps or warps(D), **constants)
    return y if residual is None else (y, total)


@triton.jit
def _swap_flag(flag, expected, new, SEM: tl.constexpr):
    """Spin until the flag at `flag` goes from `expected` to `new` (a scalar atomic: one thread of the
    program runs it and Triton broadcasts the result). A peer that never comes (a rank that died)
    traps the kernel after 2^28 tries, minutes, rather than spinning forever: the worker then fails
    with a CUDA error instead of hanging."""
    spins = 0
    while (tl.atomic_cas(flag, expected, new, sem=SEM, scope="sys") != expected) & (spins < 268435456):
        spins += 1
    if spins >= 268435456:
        tl.inline_asm_elementwise("trap;", "=r", [], dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def _all_reduce_rms_norm_kernel(x_ptr, res_ptr, w_ptr, y_ptr, sum_ptr, D, eps, stride_x, stride_r,
                                buffers, pads, epochs, SLOT_ROWS,
                                RANK: tl.constexpr, WORLD: tl.constexpr, HAS_RES: tl.constexpr, BLOCK: tl.constexpr):
    """Row `row` of x summed over the group's ranks, then as _rms_norm_kernel.

    Each rank writes its row into its own symmetric buffer and flags each peer's signal pad; once
    every peer has flagged this rank's pad, it reads the peers' rows over NVLink and sums them in
    rank order (the same bits on every rank). Flags go from 0 to 1 and back, so the pads are zero
    between calls and a CUDA graph can replay the kernel. Program `row` of every rank uses flag
    row · WORLD + rank and buffer row `row` of slot epochs[row] % 2: the slots alternate, so a rank
    writing a slot again (two calls later) knows, from the flags of the call between, that every
    peer has finished reading it."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < D
    dtype = y_ptr.dtype.element_ty
    epoch = tl.load(epochs + row)
    offset = ((epoch % 2) * SLOT_ROWS + row) * D
    mine = tl.multiple_of(tl.load(buffers + RANK).to(tl.pointer_type(dtype)), 16)  # D % 16 == 0: 16-byte loads
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    tl.store(mine + offset + cols, x, mask=mask)
    tl.debug_barrier()  # the whole row is written before any flag says so
    for peer in tl.static_range(WORLD):
        if peer != RANK:
            flag = tl.load(pads + peer).to(tl.pointer_type(tl.int32)) + row * WORLD + RANK
            _swap_flag(flag, 0, 1, "release")  # waits only if the peer has not taken the last call's flag
    own_pad = tl.load(pads + RANK).to(tl.pointer_type(tl.int32))
    for peer in tl.static_range(WORLD):
        if peer != RANK:
            _swap_flag(own_pad + row * WORLD + peer, 1, 0, "acquire")
    tl.debug_barrier()
    total = tl.zeros([BLOCK], dtype=tl.float32)
    for r in tl.static_range(WORLD):
        if r == RANK:
            total += x.to(tl.float32)
        else:
            part = tl.multiple_of(tl.load(buffers + r).to(tl.pointer_type(dtype)), 16)
            total += tl.load(part + offset + cols, mask=mask, other=0.0, volatile=True).to(tl.float32)  # not L1
    tl.store(epochs + row, epoch + 1)
    _add_norm_store(total.to(dtype), res_ptr, w_ptr, y_ptr, sum_ptr, row, cols, mask, D, eps, stride_r, HAS_RES)


def all_reduce_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor,
                        buffers: torch.Tensor, pads: torch.Tensor, epochs: torch.Tensor, slot_rows: int, rank: int,
                        world: int):
    """rms_norm(x summed over a tensor-parallel group, residual) in one kernel (see the kernel).
    buffers, pads: int64 tensors of the addresses of the group's symmetric buffers and signal pads,
    by rank; the buffers hold two slots of slot_rows rows of x's width and dtype;
    epochs: int64, a counter per row, zero on every rank at the start; at most slot_rows rows, a
    width that is a multiple of 16."""
    assert x.numel() // x.shape[-1] <= slot_rows <= epochs.numel() and x.shape[-1] % 16 == 0
    return _launch_norm(_all_reduce_rms_norm_kernel, x, weight, eps, residual, buffers, pads, epochs, slot_rows,
                        RANK=rank, WORLD=world)  # the warps of rms_norm: the same sums, bit for bit


@triton.jit
def _gated_rms_norm_kernel(x_ptr, z_ptr, w_ptr, y_ptr, H, D, eps, stride_x, stride_zt, stride_zh,
                           BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)  # token * H + head
    cols = tl.arange(0, BLOCK)
    mask = cols < D
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(x * x, 0) / D + eps)
    dtype = y_ptr.dtype.element_ty
    normed = (x * rstd).to(dtype)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0)
    y = (w.to(tl.float32) * normed.to(tl.float32)).to(dtype).to(tl.float32)  # w · x̂ in the input dtype
    z_row = z_ptr + (row // H) * stride_zt + (row % H) * stride_zh
    z = tl.load(z_row + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(y_ptr + row * D + cols, (y * z * tl.sigmoid(z)).to(dtype), mask=mask)


def gated_rms_norm(x: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x̂ · w · silu(z) per row of the last dim; x and z [..., heads, D], z may be a strided view
    (a slice of the merged input projection)."""
    H, D = x.shape[-2:]
    x2 = rows(x)
    z3 = z.reshape(-1, H, D)  # a view for a slice of the projection's output rows
    if z3.stride(-1) != 1:
        z3 = z3.contiguous()
    y = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    _gated_rms_norm_kernel[(x2.shape[0],)](x2, z3, weight, y, H, D, eps, x2.stride(0), z3.stride(0), z3.stride(1),
                                           BLOCK=triton.next_power_of_2(D), num_warps=1)
    return y


@triton.jit
def _silu_mul_kernel(g_ptr, u_ptr, y_ptr, N, stride, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < N
    dtype = y_ptr.dtype.element_ty
    g = tl.load(g_ptr + row * stride + cols, mask=mask, other=0.0).to(tl.float32)
    act = (g * tl.sigmoid(g)).to(dtype).to(tl.float32)  # silu rounds before the product, as in eager
    u = tl.load(u_ptr + row * stride + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(y_ptr + row * N + cols, (act * u).to(dtype), mask=mask)


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """silu(gate) · up; gate and up may be the two halves of one merged projection's output."""
    g2, u2 = rows(gate), rows(up)
    if g2.stride(0) != u2.stride(0):
        g2, u2 = g2.contiguous(), u2.contiguous()
    N = g2.shape[1]
    y = torch.empty(gate.shape, dtype=gate.dtype, device=gate.device)
    BLOCK = 1024
    _silu_mul_kernel[(g2.shape[0], triton.cdiv(N, BLOCK))](g2, u2, y, N, g2.stride(0), BLOCK=BLOCK, num_warps=4)
    return y
