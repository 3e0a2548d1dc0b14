"""Block-wise FP8 GEMMs: y = x @ (W8 · scale)^T for a float8 e4m3 weight W8 [N, K] with one fp32
scale per 128 × 128 block (layers.fp8), x in bf16/fp16/fp32.

- Decode (at most DECODE_ROWS rows, and every pass in batch-invariant mode): weight-only. The
  activations stay in their dtype; each FP8 tile is widened in registers (exact: e4m3 fits in
  bf16) and its block's scale multiplies the tile's partial dot in fp32. One launch per
  projection and no activation pass: a step at batch 1-32 is bound by the weight bytes, which
  this reads once at one byte each.
- Prefill: W8A8. The activations are quantised per token and 128-column group (dynamic scales,
  `quantize_groups`), then multiplied on the FP8 tensor cores: by torch's scaled_mm with
  (BlockWise1x128, BlockWise128x128) scales where cuBLAS has it (Hopper, cuBLASLt 12.9 or later:
  `cublas_blockwise`), else by the same kernel as decode on FP8 tiles.
No host synchronisation anywhere: all of it runs inside CUDA graphs.
"""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl

BLOCK = 128  # the scales' block (layers.fp8.BLOCK); the kernels' K tile
DECODE_ROWS = 64  # up to here weight-only: still bound by the weight bytes at 2·M flops a byte
FP8_MAX = 448.0
PREFILL = os.environ.get("SHARDSPEC_FP8_PREFILL", "auto")  # auto: cuBLAS where it has blockwise FP8; triton: ours


@triton.jit
def _gemm_kernel(x_ptr, xs_ptr, w_ptr, ws_ptr, y_ptr, M, N, K, stride_x, stride_xs_m, stride_xs_k, stride_w,
                 stride_ws, stride_y, FP8_X: tl.constexpr, EXACT: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
                 BK: tl.constexpr):
    pid_m, pid_n = tl.program_id(0), tl.program_id(1)
    m = pid_m * BM + tl.arange(0, BM)
    n = pid_n.to(tl.int64) * BN + tl.arange(0, BN)
    kk = tl.arange(0, BK)
    n_block = (pid_n * BN) // BK  # BN divides the block: one weight scale per tile and K step
    acc = tl.zeros([BM, BN], dtype=tl.float32)
    for kb in range(0, tl.cdiv(K, BK)):
        k = kb * BK + kk
        x = tl.load(x_ptr + m[:, None] * stride_x + k[None, :], mask=(m[:, None] < M) & (k[None, :] < K), other=0.0)
        w = tl.load(w_ptr + n[:, None] * stride_w + k[None, :], mask=(n[:, None] < N) & (k[None, :] < K), other=0.0)
        w_scale = tl.load(ws_ptr + n_block * stride_ws + kb)
        if EXACT:  # fp32 activations, and Triton's CPU interpreter (its low-precision dots are wrong)
            part = tl.dot(x.to(tl.float32), tl.trans(w.to(tl.float32)), input_precision="ieee")
        elif FP8_X:  # e4m3 × e4m3 on the tensor cores
            part = tl.dot(x, tl.trans(w))
        else:
            part = tl.dot(x, tl.trans(w.to(x.dtype)))
        if FP8_X:
            x_scale = tl.load(xs_ptr + m * stride_xs_m + kb * stride_xs_k, mask=m < M, other=0.0)
            acc += part * (x_scale[:, None] * w_scale)
        else:
            acc += part * w_scale
    tl.store(y_ptr + m[:, None] * stride_y + n[None, :], acc.to(y_ptr.dtype.element_ty),
             mask=(m[:, None] < M) & (n[None, :] < N))


@triton.jit
def _quantize_kernel(x_ptr, q_ptr, s_ptr, K, stride_x, stride_q, stride_s_m, stride_s_k, BK: tl.constexpr):
    row, group = tl.program_id(0), tl.program_id(1)
    k = group * BK + tl.arange(0, BK)
    x = tl.load(x_ptr + row * stride_x + k, mask=k < K, other=0.0).to(tl.float32)
    scale = tl.maximum(tl.max(tl.abs(x), axis=0), 1e-12) / 448.0
    q = tl.clamp(x / scale, -448.0, 448.0)
    tl.store(q_ptr + row * stride_q + k, q.to(q_ptr.dtype.element_ty), mask=k < K)
    tl.store(s_ptr + row * stride_s_m + group * stride_s_k, scale)


def quantize_groups(x: torch.Tensor, column_major: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (e4m3 [M, K], fp32 scales [M, ⌈K/128⌉]) with x ≈ q · scale per token and group of
    128 columns; column_major: the scales stored K-group-major (what cuBLAS's blockwise mode reads)."""
    M, K = x.shape
    groups = triton.cdiv(K, BLOCK)
    q = torch.empty(M, K, dtype=torch.float8_e4m3fn, device=x.device)
    scales = torch.empty(groups, M, dtype=torch.float32, device=x.device).t() if column_major else \
        torch.empty(M, groups, dtype=torch.float32, device=x.device)
    _quantize_kernel[(M, groups)](x, q, scales, K, x.stride(0), q.stride(0), scales.stride(0), scales.stride(1),
                                  BK=BLOCK, num_warps=1)
    return q, scales


def _gemm(x: torch.Tensor, x_scale: torch.Tensor | None, weight: torch.Tensor, scale: torch.Tensor,
          out_dtype: torch.dtype, block_m: int, block_n: int) -> torch.Tensor:
    M, K = x.shape
    N = weight.shape[0]
    y = torch.empty(M, N, dtype=out_dtype, device=x.device)
    xs = x_scale if x_scale is not None else scale  # (unread without FP8_X)
    exact = not x.is_cuda or x.dtype == torch.float32
    grid = (triton.cdiv(M, block_m), triton.cdiv(N, block_n))
    _gemm_kernel[grid](x, xs, weight, scale, y, M, N, K, x.stride(0), xs.stride(0), xs.stride(1), weight.stride(0),
                       scale.stride(0), y.stride(0), FP8_X=x_scale is not None, EXACT=exact, BM=block_m,
                       BN=block_n, BK=BLOCK, num_warps=4, num_stages=3)
    return y


def _decode_block_n(N: int, device: torch.device) -> int:
    """Output rows per program: the widest tile that still gives every SM two programs or more."""
    sms = _sm_count(device)
    for block_n in (64, 32):
        if triton.cdiv(N, block_n) >= 2 * sms:
            return block_n
    return 16


@functools.cache
def _sm_count(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 1


def weight_only(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """x [M, K] @ (weight · scale)^T with x as it is (the decode path); tiles of 16 rows."""
    return _gemm(x, None, weight, scale, x.dtype, 16, _decode_block_n(weight.shape[0], x.device))


def w8a8(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, cublas_scale: torch.Tensor | None = None):
    """x [M, K] @ (weight · scale)^T with x quantised per token and 128-group (the prefill path);
    cublas_scale: the weight's scales laid out for torch's scaled_mm (cublas_layout), None: our kernel."""
    if cublas_scale is not None:
        q, x_scale = quantize_groups(x, column_major=True)
        return torch.nn.functional.scaled_mm(
            q, weight.t(), x_scale, torch.nn.functional.ScalingType.BlockWise1x128, cublas_scale.t(),
            torch.nn.functional.ScalingType.BlockWise128x128, output_dtype=x.dtype)
    q, x_scale = quantize_groups(x)
    return _gemm(q, x_scale, weight, scale, x.dtype, 64, 128)


def linear(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, invariant: bool = False,
           cublas_scale: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., K] @ (weight · scale)^T: weight-only up to DECODE_ROWS rows (always when `invariant`:
    each row's result then depends on that row alone), W8A8 above."""
    rows = x.reshape(-1, x.shape[-1])
    rows = rows if rows.stride(-1) == 1 else rows.contiguous()
    if invariant or rows.shape[0] <= DECODE_ROWS or x.dtype == torch.float32:
        y = weight_only(rows, weight, scale)
    else:
        y = w8a8(rows, weight, scale, cublas_scale)
    return y.view(*x.shape[:-1], weight.shape[0])


def cublas_layout(weight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor | None:
    """A weight's block scales [⌈N/128⌉, ⌈K/128⌉] for torch's scaled_mm (which reads their transpose
    as BlockWise128x128), or None where the prefill takes our kernel: no blockwise FP8 in cuBLAS
    here, shapes it does not take (K groups not a multiple of 4, N not of 16), or
    SHARDSPEC_FP8_PREFILL=triton (comparisons)."""
    if PREFILL == "triton" or weight.shape[0] % 16 or scale.shape[1] % 4 or not cublas_blockwise(scale.device):
        return None
    return scale.contiguous()


@functools.cache
def cublas_blockwise(device: torch.device) -> bool:
    """Whether torch's scaled_mm runs (1×128, 128×128) block-scaled FP8 here, and agrees with our
    kernel: tried once on a small GEMM (it needs Hopper and cuBLASLt 12.9 or later)."""
    if device.type != "cuda" or torch.cuda.get_device_capability(device)[0] != 9:
        return False
    gen = torch.Generator(device=device).manual_seed(0)
    x = torch.randn(256, 512, device=device, generator=gen, dtype=torch.bfloat16)
    weight = torch.randn(256, 512, device=device, generator=gen).clamp(-4, 4).to(torch.float8_e4m3fn)
    scale = torch.rand(2, 4, device=device, generator=gen) + 0.5
    try:
        ours, theirs = w8a8(x, weight, scale), w8a8(x, weight, scale, scale.contiguous())
    except (RuntimeError, NotImplementedError, ValueError, AttributeError):
        return False
    return bool(torch.allclose(ours.float(), theirs.float(), rtol=2e-2, atol=2e-2 * ours.float().abs().max().item()))
