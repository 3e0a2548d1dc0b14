"""Column- and row-parallel linear layers (no bias: Qwen3.5 has none)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from shardspec.layers.parallel import Ranges, TPGroup, shard, stack


class MergedColumnParallelLinear(nn.Module):
    """Column-parallel projections of the same input as one matmul; returns their outputs in
    order (views of one tensor). `parts` maps each checkpoint module name to this rank's rows."""

    def __init__(self, in_features: int, parts: dict[str, Ranges]):
        super().__init__()
        self.sizes = [sum(end - start for start, end in ranges) for ranges in parts.values()]
        weight = nn.Parameter(torch.empty(sum(self.sizes), in_features), requires_grad=False)
        self.weight = stack(weight, list(parts.items()))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return F.linear(x, self.weight).split(self.sizes, -1)


class RowParallelLinear(nn.Module):
    """Holds the input columns `ranges` and returns this rank's partial output, unreduced: every
    one of these layers feeds an RMSNorm, which sums it across the group (RMSNorm's `reduce`), in
    the same kernel as its residual add where it can."""

    def __init__(self, ranges: Ranges, out_features: int):
        super().__init__()
        in_features = sum(end - start for start, end in ranges)
        self.weight = shard(nn.Parameter(torch.empty(out_features, in_features), requires_grad=False), 1, ranges)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight)


class ReplicatedLinear(nn.Module):
    def __init__(self, in_features: int, out_features: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_features, in_features), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight)


def head_ranges(tp: TPGroup, num_heads: int, head_size: int, offset: int = 0) -> Ranges:
    """The rows of this rank's heads in a weight laid out head after head."""
    start, end = tp.split(num_heads)
    return [(offset + start * head_size, offset + end * head_size)]
