"""Block-wise FP8 GEMMs: y = x @ (W8 · scale)^T for a float8 e4m3 weight W8 [N, K] with one fp32
scale per 128 × 128 block (layers.fp8), x in bf16/fp16/fp32.

- Decode (at most DECODE_ROWS rows, and every pass in batch-invariant mode): kernels.gemv's split-K
  GEMV, each 128-column partial scaled by its block's scale in fp32. W8A8 (fp8_decode's default)
  rounds the activations first (`quantize_groups`) and takes both e4m3 tiles straight from shared
  memory; weight-only (and every fp32 pass) widens each FP8 tile in registers (exact: e4m3 fits
  in bf16). The plan depends on the weight's shape alone (deterministic and batch-invariant).
- Prefill: W8A8. The activations are quantised per token and 128-column group (dynamic scales,
  `quantize_groups`), then multiplied on the FP8 tensor cores: by torch's scaled_mm with
  (BlockWise1x128, BlockWise128x128) scales where cuBLAS has it for this weight's shape (Hopper,
  cuBLASLt 12.9 or later; probed per shape at load), else by our Triton kernel.
No host synchronisation anywhere: all of it runs inside CUDA graphs.
"""

from __future__ import annotations

import functools
import warnings

import torch
import triton
import triton.language as tl

from shardspec import kernels
from shardspec.kernels import norm, rows
from shardspec.kernels.gemv import BLOCK, Plan, prepare, sm_count  # noqa: F401
from shardspec.kernels.gemv import launch as gemv_launch

DECODE_ROWS = 64  # up to here the decode kernel: still bound by the weight bytes at 2·M flops a byte
FP8_MAX = 448.0
CUBLAS_ROWS = 16  # cuBLASLt refuses 1×128 scales whose leading dimension (the rows) is unaligned: pad rows to this


@triton.jit
def _w8a8_kernel(x_ptr, xs_ptr, w_ptr, ws_ptr, y_ptr, M, N, K, stride_x, stride_xs_m, stride_xs_k, stride_w,
                 stride_ws, stride_y, EXACT: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    pid_m, pid_n = tl.program_id(0), tl.program_id(1)
    m = pid_m * BM + tl.arange(0, BM)
    n = pid_n.to(tl.int64) * BN + tl.arange(0, BN)
    kk = tl.arange(0, BK)
    n_block = (pid_n * BN) // BK
    acc = tl.zeros([BM, BN], dtype=tl.float32)
    for kb in range(0, tl.cdiv(K, BK)):
        k = kb * BK + kk
        x = tl.load(x_ptr + m[:, None] * stride_x + k[None, :], mask=(m[:, None] < M) & (k[None, :] < K), other=0.0)
        w = tl.load(w_ptr + n[:, None] * stride_w + k[None, :], mask=(n[:, None] < N) & (k[None, :] < K), other=0.0)
        if EXACT:  # Triton's CPU interpreter
            part = tl.dot(x.to(tl.float32), tl.trans(w.to(tl.float32)), input_precision="ieee")
        else:  # e4m3 × e4m3 on the tensor cores
            part = tl.dot(x, tl.trans(w))
        x_scale = tl.load(xs_ptr + m * stride_xs_m + kb * stride_xs_k, mask=m < M, other=0.0)
        acc += part * (x_scale[:, None] * tl.load(ws_ptr + n_block * stride_ws + kb))
    tl.store(y_ptr + m[:, None] * stride_y + n[None, :], acc.to(y_ptr.dtype.element_ty),
             mask=(m[:, None] < M) & (n[None, :] < N))


@triton.jit
def _round_to_e4m3(v):
    """v (|v| ≤ 448, fp32) rounded to nearest-even on the e4m3 grid, in fp32 arithmetic: spacing
    2^(e-3) in [2^e, 2^(e+1)), 2^-9 below 2^-6; the cast to e4m3 after it is then exact whatever
    path the compiler takes for it."""
    exponent = (v.to(tl.int32, bitcast=True) >> 23) & 0xFF
    spacing = ((tl.maximum(exponent, 127 - 6) - 3) << 23).to(tl.float32, bitcast=True)
    magic = spacing * 12582912.0  # 1.5 · 2^23 spacings: |v| + magic keeps no bit below the spacing
    rounded = (tl.abs(v) + magic) - magic
    sign = v.to(tl.int32, bitcast=True) & -0x80000000  # v's sign bit, put back by bits: a negative v that
    return (rounded.to(tl.int32, bitcast=True) | sign).to(tl.float32, bitcast=True)  # rounds to 0 is -0, as in torch


@triton.jit
def _quantize_kernel(x_ptr, u_ptr, q_ptr, s_ptr, M, K, stride_x, stride_u, stride_q, stride_s_m, stride_s_k,
                     GATED: tl.constexpr, BK: tl.constexpr):
    row, group = tl.program_id(0), tl.program_id(1)
    k = group * BK + tl.arange(0, BK)
    columns = K * (row < M).to(tl.int32)  # a padding row (row ≥ M) reads nothing: q 0
    x = tl.load(x_ptr + row * stride_x + k, mask=k < columns, other=0.0).to(tl.float32)
    if GATED:  # x is the MLP's gate: silu(x) · up, each rounded to x's dtype as kernels.norm.silu_mul rounds
        dtype = x_ptr.dtype.element_ty
        act = (x * tl.sigmoid(x)).to(dtype).to(tl.float32)
        up = tl.load(u_ptr + row * stride_u + k, mask=k < columns, other=0.0).to(tl.float32)
        x = (act * up).to(dtype).to(tl.float32)
    scale = tl.div_rn(tl.maximum(tl.max(tl.abs(x), axis=0), 1e-12), 448.0)  # IEEE division: torch's rounding
    q = _round_to_e4m3(tl.clamp(tl.div_rn(x, scale), -448.0, 448.0))
    tl.store(q_ptr + row * stride_q + k, q.to(q_ptr.dtype.element_ty), mask=k < K)
    tl.store(s_ptr + row * stride_s_m + group * stride_s_k, scale)


def quantize_groups(x: torch.Tensor, column_major: bool = False, rows: int | None = None,
                    up: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (e4m3 [rows, K], fp32 scales [rows, ⌈K/128⌉]) with x ≈ q · scale per token and
    group of 128 columns, each group's scale its max |x| / 448 (rounded to nearest, as is q);
    rows ≥ M: padded with zero rows; column_major: the scales stored K-group-major (what cuBLAS's
    blockwise mode reads); up [M, K]: quantise silu(x) · up instead, bit for bit what
    kernels.norm.silu_mul would give (the MLP's down projection: one launch, not two)."""
    M, K = x.shape
    rows = M if rows is None else rows
    groups = triton.cdiv(K, BLOCK)
    q = torch.empty(rows, K, dtype=torch.float8_e4m3fn, device=x.device)
    scales = torch.empty(groups, rows, dtype=torch.float32, device=x.device).t() if column_major else \
        torch.empty(rows, groups, dtype=torch.float32, device=x.device)
    if up is not None:
        assert up.shape == x.shape and up.stride(-1) == 1 and up.dtype == x.dtype
    _quantize_kernel[(rows, groups)](x, x if up is None else up, q, scales, M, K, x.stride(0),
                                     0 if up is None else up.stride(0), q.stride(0), scales.stride(0),
                                     scales.stride(1), GATED=up is not None, BK=BLOCK, num_warps=1)
    return q, scales


def plan(M: int, N: int, K: int, sms: int, invariant: bool = False, quantize: bool = False) -> Plan:
    """The launch for x [M, K] @ W[N, K]^T: 64-row strips of the weight (16 or 32 for a narrower
    N). Weight-only: split along K until there are four programs per SM, each keeping at least 4
    K blocks to stream. W8A8 (quantize), whose e4m3 tiles go to the tensor cores as they are:
    fewer, longer programs keep up, so split only until there are two programs per SM, each
    keeping at least 8 blocks, with 4 tiles in flight where a program streams 16 blocks or more,
    else 3 (bench/fp8_gemm.py --sweep stages: the best plan or within 0.4 µs of it at every 9B
    shape at 1 and 8 rows). The split depends on the weight's shape, never on M. All rows in one
    program up to 64 (the weight read once); 16 per program in batch-invariant mode (a row's
    arithmetic then never depends on the batch)."""
    block_n = 64 if N > 32 else (32 if N > 16 else 16)
    tiles, blocks, split = triton.cdiv(N, block_n), triton.cdiv(K, BLOCK), 1
    programs, min_blocks = (2, 8) if quantize else (4, 4)
    while tiles * split < programs * sms and blocks // (2 * split) >= min_blocks and split < 16:
        split *= 2
    stages = 4 if quantize and triton.cdiv(blocks, split) >= 16 else 3
    block_m = 16 if invariant else min(64, max(16, triton.next_power_of_2(M)))
    return Plan(block_m, block_n, split, stages, quantize=quantize)


def decode(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, invariant: bool = False,
           quantize: bool = False, launch: Plan | None = None, up: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K] @ (weight · scale)^T, the decode path: x as it is (weight-only, one launch), or with
    quantize first rounded to e4m3 per row and 128-column group by quantize_groups (W8A8, two
    launches; fp32 x is never quantised); launch: the plan (default: `plan` for this shape and
    device); up: multiply silu(x) · up instead (see `linear`)."""
    M, K = x.shape
    quantize = quantize and x.dtype != torch.float32
    launch = launch or plan(M, weight.shape[0], K, sm_count(x.device), invariant, quantize)
    if not launch.quantize:
        return gemv_launch(x if up is None else norm.silu_mul(x, up), weight, launch, scale=scale)
    q, x_scale = quantize_groups(x, up=up)
    return gemv_launch(q, weight, launch, scale=scale, x_scale=x_scale, out_dtype=x.dtype)


def w8a8_triton(q: torch.Tensor, x_scale: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor,
                out_dtype: torch.dtype) -> torch.Tensor:
    """q [M, K] (e4m3) · x_scale [M, ⌈K/128⌉] @ (weight · scale)^T on our FP8 kernel."""
    M, K = q.shape
    N = weight.shape[0]
    y = torch.empty(M, N, dtype=out_dtype, device=q.device)
    grid = (triton.cdiv(M, 64), triton.cdiv(N, 128))
    _w8a8_kernel[grid](q, x_scale, weight, scale, y, M, N, K, q.stride(0), x_scale.stride(0), x_scale.stride(1),
                       weight.stride(0), scale.stride(0), y.stride(0), EXACT=not q.is_cuda, BM=64, BN=128, BK=BLOCK,
                       num_warps=4, num_stages=3)
    return y


def w8a8_cublas(q: torch.Tensor, x_scale: torch.Tensor, weight: torch.Tensor, cublas_scale: torch.Tensor,
                out_dtype: torch.dtype) -> torch.Tensor:
    """The same through torch's scaled_mm: q's rows a multiple of CUBLAS_ROWS, x_scale column-major."""
    return torch.nn.functional.scaled_mm(
        q, weight.t(), x_scale, torch.nn.functional.ScalingType.BlockWise1x128, cublas_scale.t(),
        torch.nn.functional.ScalingType.BlockWise128x128, output_dtype=out_dtype)


_CUBLAS_REFUSED: set[tuple[int, int]] = set()  # weight shapes cuBLAS refused at run time


def w8a8(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, cublas_scale: torch.Tensor | None = None,
         up: torch.Tensor | None = None):
    """x [M, K] @ (weight · scale)^T with x quantised per token and 128-group (the prefill path);
    cublas_scale: the weight's scales laid out for torch's scaled_mm (cublas_layout), None: our kernel;
    up: multiply silu(x) · up instead. A shape cuBLAS refuses after all (it fails before launching
    anything) takes our kernel from then on."""
    M = x.shape[0]
    if cublas_scale is not None and tuple(weight.shape) not in _CUBLAS_REFUSED:
        q, x_scale = quantize_groups(x, column_major=True, rows=triton.cdiv(M, CUBLAS_ROWS) * CUBLAS_ROWS, up=up)
        try:
            return w8a8_cublas(q, x_scale, weight, cublas_scale, x.dtype)[:M]
        except RuntimeError as exc:
            _CUBLAS_REFUSED.add(tuple(weight.shape))
            warnings.warn(f"cuBLAS block-scaled FP8 refused {M} × {tuple(weight.shape)} ({exc}); "
                          "the Triton kernel takes this shape from now on", RuntimeWarning, stacklevel=2)
    q, x_scale = quantize_groups(x, up=up)
    return w8a8_triton(q, x_scale, weight, scale, x.dtype)


def linear(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, invariant: bool = False,
           cublas_scale: torch.Tensor | None = None, up: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., K] @ (weight · scale)^T: the one-launch decode kernel up to DECODE_ROWS rows (always
    when `invariant`: each row's result then depends on that row alone), W8A8 or weight-only (the
    option fp8_decode: w8a8 rounds the activations to e4m3 first, as the checkpoints' dynamic
    activation scheme and the prefill; fp32 activations always take weight-only); above, the
    prefill's W8A8 GEMM. With `up` (x's shape: the MLP's gate and up), silu(x) · up @ (weight ·
    scale)^T, the SiLU·up inside the activations' quantiser where they are quantised (its own
    kernel where not)."""
    x2 = rows(x)
    u2 = rows(up) if up is not None else None
    if invariant or x2.shape[0] <= DECODE_ROWS or x.dtype == torch.float32:
        y = decode(x2, weight, scale, invariant, quantize=kernels.settings.fp8_decode == "w8a8", up=u2)
    else:
        y = w8a8(x2, weight, scale, cublas_scale, up=u2)
    return y.view(*x.shape[:-1], weight.shape[0])


def cublas_layout(weight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor | None:
    """A weight's block scales [⌈N/128⌉, ⌈K/128⌉] for torch's scaled_mm (which reads their transpose
    as BlockWise128x128), or None where the prefill takes our kernel: no blockwise FP8 in cuBLAS
    here or not for this shape (K groups not a multiple of 4, N not of 16, or the probe of this
    (N, K) failed), or the option fp8_prefill is triton (comparisons)."""
    N, K = weight.shape
    if kernels.settings.fp8_prefill == "triton" or N % 16 or scale.shape[1] % 4 or not cublas_blockwise(
            scale.device, N, K):
        return None
    return scale.contiguous()


@functools.cache
def cublas_blockwise(device: torch.device, N: int = 256, K: int = 512) -> bool:
    """Whether torch's scaled_mm runs (1×128, 128×128) block-scaled FP8 for an [N, K] weight here,
    and agrees with our kernel: tried once per shape at load, at two padded row counts (it needs
    Hopper and cuBLASLt 12.9 or later). Any failure means our kernel for this shape."""
    if device.type != "cuda" or torch.cuda.get_device_capability(device)[0] != 9:
        return False
    gen = torch.Generator(device=device).manual_seed(0)
    weight = torch.randn(N, K, device=device, generator=gen).clamp(-4, 4).to(torch.float8_e4m3fn)
    scale = torch.rand(triton.cdiv(N, BLOCK), triton.cdiv(K, BLOCK), device=device, generator=gen) + 0.5
    cublas_scale = scale.contiguous()
    for M in (DECODE_ROWS + 1, 3 * BLOCK + 7):  # padded to 80 and 400 rows, as w8a8 pads
        x = torch.randn(M, K, device=device, generator=gen, dtype=torch.bfloat16)
        ours = w8a8(x, weight, scale)
        q, x_scale = quantize_groups(x, column_major=True, rows=triton.cdiv(M, CUBLAS_ROWS) * CUBLAS_ROWS)
        try:
            theirs = w8a8_cublas(q, x_scale, weight, cublas_scale, x.dtype)[:M]
        except (RuntimeError, NotImplementedError, ValueError, AttributeError):
            return False
        tolerance = 2e-2 * ours.float().abs().max().item()
        if not torch.allclose(ours.float(), theirs.float(), rtol=2e-2, atol=tolerance):
            return False
    return True
