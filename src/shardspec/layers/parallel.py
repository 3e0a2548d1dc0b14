"""Tensor-parallel plumbing: the rank's place in its group, and how a parameter is sliced."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

Ranges = list[tuple[int, int]]


@dataclass(frozen=True)
class TPGroup:
    """This rank's tensor-parallel group; size 1 needs no torch.distributed at all."""

    rank: int = 0
    size: int = 1
    group: Any = None

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        if self.size > 1:
            dist.all_reduce(x, group=self.group)
        return x

    def all_gather(self, x: torch.Tensor, dim: int = -1) -> torch.Tensor:
        if self.size == 1:
            return x
        parts = [torch.empty_like(x) for _ in range(self.size)]
        dist.all_gather(parts, x.contiguous(), group=self.group)
        return torch.cat(parts, dim=dim)

    def split(self, n: int) -> tuple[int, int]:
        """This rank's [start, end) of n items split evenly (n divisible by size)."""
        per = n // self.size
        return self.rank * per, (self.rank + 1) * per


def shard(param: nn.Parameter, dim: int, ranges: Ranges) -> nn.Parameter:
    """Mark `param` as the concatenation along `dim` of `ranges` of the checkpoint tensor.

    Ranges reaching past the checkpoint's size are zero-padded (vocabulary padding)."""
    param.shard = (dim, ranges)  # type: ignore[attr-defined]
    return param
