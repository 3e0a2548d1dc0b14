"""Tensor-parallel plumbing: the rank's place in its group, and how a parameter is sliced."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

Ranges = list[tuple[int, int]]
SYMMETRIC_ALLREDUCE = os.environ.get("SHARDSPEC_ALLREDUCE") == "symm"  # see SymmetricReducer


@dataclass(frozen=True)
class TPGroup:
    """This rank's tensor-parallel group; size 1 needs no torch.distributed at all."""

    rank: int = 0
    size: int = 1
    group: Any = None
    _reducer: Any = field(default=None, init=False, compare=False, repr=False)

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        if self.size == 1:
            return x
        if SYMMETRIC_ALLREDUCE and x.is_cuda and x.nbytes <= SymmetricReducer.MAX_BYTES:
            if self._reducer is None:  # made at the first (eager) all-reduce, the same one on every rank
                object.__setattr__(self, "_reducer", SymmetricReducer(self.group))
            return self._reducer(x)
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


class SymmetricReducer:
    """One-shot all-reduce through PyTorch's symmetric memory: every rank reads its peers' buffers
    directly over NVLink. For the small tensors of a decode step it takes a few microseconds where
    NCCL's ring takes tens (opt-in: SHARDSPEC_ALLREDUCE=symm)."""

    MAX_BYTES = 1 << 20

    def __init__(self, group: Any):
        from torch.distributed import _symmetric_memory as symm_mem

        self.symm_mem = symm_mem
        self.group_name = (group or dist.group.WORLD).group_name
        self.buffers: dict[torch.dtype, torch.Tensor] = {}

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        buffer = self.buffers.get(x.dtype)
        if buffer is None:
            buffer = self.symm_mem.empty(self.MAX_BYTES // x.element_size(), dtype=x.dtype, device=x.device)
            self.symm_mem.rendezvous(buffer, self.group_name)
            self.buffers[x.dtype] = buffer
        x = x.contiguous()
        out = torch.empty_like(x)
        torch.ops.symm_mem.one_shot_all_reduce_copy_out(buffer[: x.numel()].view_as(x), x, "sum", self.group_name, out)
        return out


def shard(param: nn.Parameter, dim: int, ranges: Ranges) -> nn.Parameter:
    """Mark `param` as the concatenation along `dim` of `ranges` of the checkpoint tensor.

    Ranges reaching past the checkpoint's size are zero-padded (vocabulary padding)."""
    param.shard = (dim, ranges)  # type: ignore[attr-defined]
    return param


def stack(param: nn.Parameter, parts: list[tuple[str, Ranges]]) -> nn.Parameter:
    """Mark `param` as the rows `ranges` of each named checkpoint tensor, stacked in order: several
    projections of one input held as one weight, so a step runs one matmul where it ran several.
    The names replace the module name in the parameter's own checkpoint key (`in_proj.weight` made
    of `in_proj_qkv.weight`, `in_proj_z.weight`, ...)."""
    param.parts = parts  # type: ignore[attr-defined]
    return param
