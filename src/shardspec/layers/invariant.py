"""Batch-invariant arithmetic: a token's result computed the same way whatever else is in the pass.

A library picks its algorithm by the shapes it is given: a matmul its kernel by the number of rows,
a reduction its loop order by the number of rows it reduces, so each row's rounding changes with
the batch. Here every such call gets one fixed shape (`in_blocks`): the rows go through in
zero-padded blocks of a constant size, and each row's result depends on that row alone. On a CPU,
an elementwise function such as sigmoid or silu also runs a vectorised approximation on whole
vectors and the scalar libm function on the last few elements of a tensor, which round differently
(`pointwise`). Per-token GPU kernels (shardspec.kernels) treat every token alike and need none of
this. CausalLM.set_batch_invariant turns the mode on in every layer.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

REDUCE_ROWS = 64  # rows per block of a row reduction or a batched matmul
# pointwise: tensors go through in pieces of at most this many elements (below ATen's parallel grain
# of 32768, so one thread runs each piece), each a multiple of VECTOR
PIECE = 16384
VECTOR = 64  # two AVX-512 vectors of bfloat16: a multiple of every CPU's vector loop step


def in_blocks(fn: Callable[..., torch.Tensor], *xs: torch.Tensor, rows: int) -> torch.Tensor:
    """fn over the tensors xs (the same length along dim 0) in zero-padded blocks of exactly `rows`
    along dim 0, concatenated: every call of fn sees the same shapes."""
    n = xs[0].shape[0]
    size = -(-n // rows) * rows
    padded = []
    for x in xs:
        p = x.new_zeros((size, *x.shape[1:]))
        p[:n] = x
        padded.append(p.split(rows))
    return torch.cat([fn(*blocks) for blocks in zip(*padded)])[:n]


def matmul(x: torch.Tensor, weight: torch.Tensor, block_rows: int) -> torch.Tensor:
    """x @ weight.T, the rows of x in blocks of block_rows."""
    out = in_blocks(lambda block: F.linear(block, weight), x.reshape(-1, x.shape[-1]), rows=block_rows)
    return out.view(*x.shape[:-1], weight.shape[0])


def row_reduce(fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor, on: bool) -> torch.Tensor:
    """fn(x) for an fn that reduces the last dimension (keepdim); with `on`, in blocks of rows."""
    if not on:
        return fn(x)
    return in_blocks(fn, x.reshape(-1, x.shape[-1]), rows=REDUCE_ROWS).view(*x.shape[:-1], 1)


def matvec(vectors: torch.Tensor, matrices: torch.Tensor, on: bool) -> torch.Tensor:
    """vectors [..., K] times matrices [..., K, M] -> [..., M]; with `on`, in blocks of the leading dims."""
    if not on:
        return (vectors[..., None, :] @ matrices)[..., 0, :]
    lead = vectors.shape[:-1]
    v = vectors.reshape(-1, 1, vectors.shape[-1])
    m = matrices.reshape(-1, *matrices.shape[-2:])
    return in_blocks(torch.bmm, v, m, rows=REDUCE_ROWS).view(*lead, matrices.shape[-1])


def pointwise(fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor, on: bool) -> torch.Tensor:
    """fn(x) for an elementwise fn; with `on`, on a CPU, every element takes the vectorised path: x
    is padded to whole vector steps and split into single-threaded pieces."""
    if not on or x.device.type != "cpu":
        return fn(x)
    flat = x.reshape(-1)
    n = flat.numel()
    padded = flat.new_zeros(-(-n // VECTOR) * VECTOR)
    padded[:n] = flat
    out = torch.cat([fn(piece) for piece in padded.split(PIECE)])
    return out[:n].view(x.shape)
