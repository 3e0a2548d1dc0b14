"""Column- and row-parallel linear layers (no bias: Qwen3.5 has none)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from shardspec import kernels
from shardspec.layers import invariant
from shardspec.layers.parallel import Ranges, TPGroup, shard, stack


def linear(x: torch.Tensor, weight: torch.Tensor, block_rows: int = 0) -> torch.Tensor:
    """x @ weight.T; with block_rows > 0 batch-invariant (layers.invariant.matmul); a decode's few
    bf16 rows on CUDA by kernels.gemv."""
    if block_rows:
        return invariant.matmul(x, weight, block_rows)
    if kernels.enabled(x) and kernels.gemv.takes(x, weight):
        return kernels.gemv.linear(x, weight)
    return F.linear(x, weight)


class Linear(nn.Module):
    """A projection without bias; `block_rows` (0: off) is set by CausalLM.set_batch_invariant."""

    block_rows = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.block_rows)


class MergedColumnParallelLinear(Linear):
    """Column-parallel projections of the same input as one matmul; returns their outputs in
    order (views of one tensor). `parts` maps each checkpoint module name to this rank's rows."""

    def __init__(self, in_features: int, parts: dict[str, Ranges]):
        super().__init__()
        self.sizes = [sum(end - start for start, end in ranges) for ranges in parts.values()]
        weight = nn.Parameter(torch.empty(sum(self.sizes), in_features), requires_grad=False)
        self.weight = stack(weight, list(parts.items()))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return super().forward(x).split(self.sizes, -1)


class RowParallelLinear(Linear):
    """Holds the input columns `ranges` and returns this rank's partial output, unreduced: every
    one of these layers feeds an RMSNorm, which sums it across the group (RMSNorm's `reduce`), in
    the same kernel as its residual add where it can."""

    def __init__(self, ranges: Ranges, out_features: int):
        super().__init__()
        in_features = sum(end - start for start, end in ranges)
        self.weight = shard(nn.Parameter(torch.empty(out_features, in_features), requires_grad=False), 1, ranges)


class ReplicatedLinear(Linear):
    def __init__(self, in_features: int, out_features: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_features, in_features), requires_grad=False)


def head_ranges(tp: TPGroup, num_heads: int, head_size: int, offset: int = 0) -> Ranges:
    """The rows of this rank's heads in a weight laid out head after head."""
    start, end = tp.split(num_heads)
    return [(offset + start * head_size, offset + end * head_size)]
