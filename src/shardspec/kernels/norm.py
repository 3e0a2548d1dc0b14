"""RMSNorm kernels: the zero-centred norm (optionally fused with the residual add before it), the
gated norm of Gated DeltaNet's output, and SiLU(gate) * up of the MLP."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from shardspec.kernels import rows


@triton.jit
def _rms_norm_kernel(x_ptr, res_ptr, w_ptr, y_ptr, sum_ptr, D, eps, stride_x, stride_r,
                     HAS_RES: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < D
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    if HAS_RES:  # the sum rounds to the input dtype first, as `x + residual` does
        x = (x.to(tl.float32) + tl.load(res_ptr + row * stride_r + cols, mask=mask, other=0.0).to(tl.float32))
        x = x.to(sum_ptr.dtype.element_ty)
        tl.store(sum_ptr + row * D + cols, x, mask=mask)
    x = x.to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(x * x, 0) / D + eps)
    w = 1.0 + tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(y_ptr + row * D + cols, (x * rstd * w).to(y_ptr.dtype.element_ty), mask=mask)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None):
    """norm(x) · (1 + w); with `residual`: (norm(x + residual), x + residual)."""
    shape, D = x.shape, x.shape[-1]
    x2 = rows(x)
    r2 = rows(residual) if residual is not None else x2
    y = torch.empty(shape, dtype=x.dtype, device=x.device)
    total = torch.empty(shape, dtype=x.dtype, device=x.device) if residual is not None else y
    _rms_norm_kernel[(x2.shape[0],)](x2, r2, weight, y, total, D, eps, x2.stride(0), r2.stride(0),
                                     HAS_RES=residual is not None,
                                     BLOCK=triton.next_power_of_2(D), num_warps=4 if D >= 1024 else 1)
    return y if residual is None else (y, total)


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
