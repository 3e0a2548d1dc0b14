"""The decode GEMV: y = x @ W^T for the few rows of a decode step, x [M, K], W [N, K].

A decode step reads every weight once for a handful of rows, so its matmuls are bound by the
weight bytes alone. Each program streams a strip of the weight (BN rows) over a slice of K
(split-K where the strips alone leave SMs without work: N of 4096) and
multiplies it with the activations on the tensor cores, the weight as the wide operand ("swap
AB": a 16-row activation tile costs the same as one row). The splits' partials meet in an fp32
workspace; the last split of a tile to finish (a counter per tile) adds them in split order and
writes y. One launch where cuBLAS takes two (its split-K GEMV and a reduction kernel), and the
same sum whichever split ends last: deterministic, and the plan depends on the weight's shape and
the row count's bucket only.

The one kernel serves two weights: bf16/fp16 (`linear`), and FP8 with one fp32 scale per
128 × 128 block (kernels.fp8.decode), each 128-column partial scaled in fp32 (W8A8: also by the
activations' group scales).

The option bf16_gemv off (`--no-bf16-gemv`) leaves the bf16 matmuls to cuBLAS (comparisons); FP8
always takes this kernel.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from shardspec import kernels
from shardspec.kernels import rows

BLOCK = 128  # the FP8 scales' block: the K tile wherever the weight is scaled
ROWS = 16  # bf16 up to here: one 16-row activation tile (more rows were not swept: cuBLAS)
COUNTERS = 1 << 20  # split-K tile counters per device (a GEMV with more tiles runs unsplit)


@dataclass(frozen=True)
class Plan:
    """A launch: rows per program (block_m), weight rows per program (block_n), the K tile
    (block_k: BLOCK for a scaled weight), the K slices (split) that fill the SMs, weight tiles in
    flight a program (stages), and, for FP8, whether the activations are rounded to e4m3 first
    (quantize: W8A8 on the FP8 tensor cores) or multiplied as they are (weight-only)."""

    block_m: int
    block_n: int
    split: int
    stages: int = 3
    quantize: bool = False
    warps: int = 4
    block_k: int = BLOCK


@triton.jit
def _gemv_kernel(x_ptr, xs_ptr, w_ptr, ws_ptr, y_ptr, part_ptr, count_ptr, M, N, K, stride_x, stride_xs,
                 stride_w, stride_ws, stride_y, blocks_per_split, SPLIT, SCALED: tl.constexpr,
                 QUANT: tl.constexpr, EXACT: tl.constexpr, EVEN: tl.constexpr,
                 BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    pid_n, pid_s, pid_m = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    n = pid_n.to(tl.int64) * BN + tl.arange(0, BN)
    m = pid_m.to(tl.int64) * BM + tl.arange(0, BM)
    kk = tl.arange(0, BK)
    n_block = (pid_n * BN) // BK  # (scaled: BK is the block and BN divides it: one scale per tile and K step)
    first = pid_s * blocks_per_split
    last = tl.minimum(first + blocks_per_split, tl.cdiv(K, BK))
    acc = tl.zeros([BN, BM], dtype=tl.float32)
    for kb in range(first, last):
        k = kb * BK + kk
        if EVEN:  # whole tiles: unmasked 16-byte loads of the weight
            w = tl.load(w_ptr + n[:, None] * stride_w + k[None, :])
        else:
            w = tl.load(w_ptr + n[:, None] * stride_w + k[None, :], mask=(n[:, None] < N) & (k[None, :] < K),
                        other=0.0)
        x = tl.load(x_ptr + m[:, None] * stride_x + k[None, :], mask=(m[:, None] < M) & (k[None, :] < K), other=0.0)
        if EXACT:  # fp32 activations, and Triton's CPU interpreter (its low-precision dots are wrong)
            part = tl.dot(w.to(tl.float32), tl.trans(x.to(tl.float32)), input_precision="ieee")
        elif QUANT:  # W8A8, x in e4m3: both tiles go to the tensor cores straight from shared memory
            part = tl.dot(w, tl.trans(x))
        else:  # bf16 as it is; an FP8 weight widened to x's dtype (exact)
            part = tl.dot(w.to(x.dtype), tl.trans(x))
        if SCALED:
            scale = tl.load(ws_ptr + n_block * stride_ws + kb)
            if QUANT:  # and each row's scale of this 128-column group (kernels.fp8.quantize_groups)
                scale = scale * tl.load(xs_ptr + m * stride_xs + kb, mask=m < M, other=0.0)[None, :]
            acc += part * scale
        else:
            acc += part
    y_offsets = m[None, :] * stride_y + n[:, None]
    y_mask = (m[None, :] < M) & (n[:, None] < N)
    if SPLIT == 1:
        tl.store(y_ptr + y_offsets, acc.to(y_ptr.dtype.element_ty), mask=y_mask)
    else:
        part_offsets = m[None, :] * N + n[:, None]
        tl.store(part_ptr + pid_s * M * N + part_offsets, acc, mask=y_mask)
        tl.debug_barrier()  # every thread's partial stored before the release below
        tile = pid_m * tl.num_programs(0) + pid_n
        arrived = tl.atomic_add(count_ptr + tile, 1, sem="acq_rel", scope="gpu")
        if arrived == SPLIT - 1:  # the last split of this tile: add all of them, in split order
            total = tl.zeros([BN, BM], dtype=tl.float32)
            for s in range(SPLIT):
                total += tl.load(part_ptr + s * M * N + part_offsets, mask=y_mask, other=0.0, cache_modifier=".cg")
            tl.store(y_ptr + y_offsets, total.to(y_ptr.dtype.element_ty), mask=y_mask)
            tl.atomic_xchg(count_ptr + tile, 0)  # ready for the next launch (CUDA graph replays)


def plan(M: int, N: int, K: int, sms: int) -> Plan:
    """The bf16 launch for x [M, K] @ W[N, K]^T: 64-row strips of the weight (16 or 32 for a
    narrower N) by 128 columns, split along K only until every SM has a program (more splits lose:
    bench/gemv.py --sweep), four tiles in flight where there are fewer than 1.5 programs an SM,
    else three; all rows in one program. The plan depends on the weight's shape and the rows'
    power of two, never on the rows otherwise."""
    block_n = 64 if N > 32 else (32 if N > 16 else 16)
    tiles, blocks, split = triton.cdiv(N, block_n), triton.cdiv(K, BLOCK), 1
    while tiles * split < sms and blocks // (2 * split) >= 4:
        split *= 2
    stages = 4 if 2 * tiles * split < 3 * sms else 3
    return Plan(min(64, max(16, triton.next_power_of_2(M))), block_n, split, stages)


@functools.cache
def sm_count(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 1


def _counters(device: torch.device) -> torch.Tensor:
    """The split-K tile counters, zero between launches (the last split of a tile resets its own);
    one set per device: the GEMVs of one process run on one stream at a time."""
    if device.type == "cuda" and device.index is None:  # one key for "cuda" and "cuda:N"
        device = torch.device("cuda", torch.cuda.current_device())
    return _device_counters(device)


@functools.cache
def _device_counters(device: torch.device) -> torch.Tensor:
    return torch.zeros(COUNTERS, dtype=torch.int32, device=device)


def prepare(device: torch.device) -> None:
    """Allocate the device's counters now, before any CUDA graph is captured."""
    _counters(device)


def _capturing_without_counters(device: torch.device) -> bool:
    return device.type == "cuda" and torch.cuda.is_current_stream_capturing() and \
        _device_counters.cache_info().currsize == 0


def launch(x: torch.Tensor, weight: torch.Tensor, launch: Plan, scale: torch.Tensor | None = None,
           x_scale: torch.Tensor | None = None, out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """x [M, K] @ (weight [· scale])^T at `launch`: scale, the FP8 weight's block scales; x_scale,
    W8A8's activation group scales (x then in e4m3)."""
    M, K = x.shape
    N = weight.shape[0]
    tiles_n, tiles_m = triton.cdiv(N, launch.block_n), triton.cdiv(M, launch.block_m)
    split = launch.split
    if split > 1 and (tiles_n * tiles_m > COUNTERS or _capturing_without_counters(x.device)):
        split = 1  # (no counters to share, or none allocated before this capture: unsplit, still correct)
    out_dtype = out_dtype or x.dtype
    y = torch.empty(M, N, dtype=out_dtype, device=x.device)
    part = torch.empty(split, M, N, dtype=torch.float32, device=x.device) if split > 1 else y
    count = _counters(x.device) if split > 1 else y
    blocks = triton.cdiv(K, launch.block_k)
    even = N % launch.block_n == 0 and K % launch.block_k == 0
    exact = not x.is_cuda or out_dtype == torch.float32
    _gemv_kernel[(tiles_n, split, tiles_m)](
        x, x if x_scale is None else x_scale, weight, weight if scale is None else scale,
        y, part, count, M, N, K, x.stride(0), 0 if x_scale is None else x_scale.stride(0), weight.stride(0),
        0 if scale is None else scale.stride(0), y.stride(0), triton.cdiv(blocks, split), SPLIT=split,
        SCALED=scale is not None, QUANT=x_scale is not None, EXACT=exact, EVEN=even,
        BM=launch.block_m, BN=launch.block_n, BK=launch.block_k, num_warps=launch.warps,
        num_stages=launch.stages)
    return y


def takes(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether a bf16/fp16 matmul of x [..., K] takes this kernel: on, on CUDA, a decode's 1 to
    ROWS rows, a weight of unit stride along K."""
    return kernels.settings.bf16_gemv and x.is_cuda and x.dtype in (torch.bfloat16, torch.float16) \
        and weight.dtype == x.dtype and weight.dim() == 2 and weight.stride(-1) == 1 \
        and 0 < x.numel() <= ROWS * x.shape[-1]


def linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x [..., K] @ weight^T (where `takes`)."""
    x2 = rows(x)
    M, K = x2.shape
    y = launch(x2, weight, plan(M, weight.shape[0], K, sm_count(x.device)))
    return y.view(*x.shape[:-1], weight.shape[0])
