"""The drafts' LM head: the argmax of x @ W^T without the logits, W in bf16 or in fp8 with a scale
per row (the default for MTP drafts on CUDA: the option draft_head fp8).

A draft token is only the argmax of its logits, and a draft's LM-head pass reads the whole head
(2 GB on a 9B-class Qwen3.5) for one to a few rows: bound by the bytes read. This kernel reads W
once for up to 16 rows, keeps each block's (max, index) and never writes logits. With the head
also stored as float8 (e4m3, one fp32 scale per row) a draft reads half the bytes. Drafts from
the fp8 head may differ from the bf16 head's where two logits are close: that changes which
drafts are proposed, never the output, which the target's verify pass decides.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

MAX_ROWS = 16  # rows per launch: one tile of tl.dot
FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0


def quantize_rows(weight: torch.Tensor, chunk: int = 8192) -> tuple[torch.Tensor, torch.Tensor]:
    """weight [V, K] -> (float8 e4m3 [V, K], fp32 scale [V]) with weight ≈ w8 * scale[:, None];
    a chunk of rows at a time, so that no fp32 copy of the whole head is ever made."""
    w8 = torch.empty(weight.shape, dtype=FP8, device=weight.device)
    scale = torch.empty(weight.shape[0], dtype=torch.float32, device=weight.device)
    for start in range(0, weight.shape[0], chunk):
        rows = weight[start : start + chunk].float()
        s = rows.abs().amax(dim=1).clamp(min=1e-12) / FP8_MAX
        w8[start : start + chunk] = (rows / s[:, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8)
        scale[start : start + chunk] = s
    return w8, scale


@triton.jit
def _argmax_kernel(x_ptr, w_ptr, scale_ptr, value_ptr, index_ptr, M, N, K, valid, stride_x, stride_w, blocks,
                   HAS_SCALE: tl.constexpr, EXACT: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    pid = tl.program_id(0)
    n = pid.to(tl.int64) * BN + tl.arange(0, BN)  # (a head of 2**31 elements or more: 64-bit offsets)
    m = tl.arange(0, BM)
    kk = tl.arange(0, BK)
    acc = tl.zeros([BM, BN], dtype=tl.float32)
    for k0 in range(0, K, BK):
        k = k0 + kk
        x = tl.load(x_ptr + m[:, None] * stride_x + k[None, :], mask=(m[:, None] < M) & (k[None, :] < K), other=0.0)
        w = tl.load(w_ptr + n[:, None] * stride_w + k[None, :], mask=(n[:, None] < N) & (k[None, :] < K), other=0.0)
        if EXACT:  # Triton's CPU interpreter gets bfloat16 dots wrong: float32 there
            acc += tl.dot(x.to(tl.float32), tl.trans(w.to(tl.float32)), input_precision="ieee")
        else:  # tensor cores; an fp8 weight widens to bfloat16 exactly
            acc += tl.dot(x.to(tl.bfloat16), tl.trans(w.to(tl.bfloat16)))
    if HAS_SCALE:
        acc = acc * tl.load(scale_ptr + n, mask=n < N, other=0.0)[None, :]
    acc = tl.where((n < valid)[None, :], acc, float("-inf"))  # vocabulary padding never wins
    value = tl.max(acc, axis=1)
    index = tl.argmax(acc, axis=1)  # the first maximum: the lowest index on a tie
    tl.store(value_ptr + m * blocks + pid, value, mask=m < M)
    tl.store(index_ptr + m * blocks + pid, pid * BN + index, mask=m < M)


def argmax(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor | None, valid: int,
           block_n: int = 64, block_k: int = 128) -> tuple[torch.Tensor, torch.Tensor]:
    """(max, index) over the first `valid` rows of weight [N, K] of x [M, K] @ weight^T (times scale
    per row when given), for M <= MAX_ROWS: ([M] fp32, [M] int64). Ties go to the lowest index."""
    M, K = x.shape
    N = weight.shape[0]
    assert M <= MAX_ROWS and weight.shape[1] == K and x.stride(-1) == 1 and weight.stride(-1) == 1
    blocks = triton.cdiv(N, block_n)
    values = torch.empty(M, blocks, dtype=torch.float32, device=x.device)
    indices = torch.empty(M, blocks, dtype=torch.int32, device=x.device)
    _argmax_kernel[(blocks,)](x, weight, scale if scale is not None else weight, values, indices, M, N, K, valid,
                              x.stride(0), weight.stride(0), blocks, HAS_SCALE=scale is not None,
                              EXACT=not x.is_cuda, BM=MAX_ROWS,
                              BN=block_n, BK=block_k, num_warps=4, num_stages=3)
    best = values.argmax(dim=1, keepdim=True)  # the first maximum: the lowest block
    return values.gather(1, best)[:, 0], indices.gather(1, best)[:, 0].long()
