"""RMSNorm variants of Qwen3.5, computed in fp32 (Triton kernels on CUDA: shardspec.kernels)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from shardspec import kernels
from shardspec.layers.invariant import pointwise, row_reduce
from shardspec.layers.parallel import TPGroup


def mean_square(x: torch.Tensor) -> torch.Tensor:
    return x.pow(2).mean(-1, keepdim=True)


class RMSNorm(nn.Module):
    """Zero-centred RMSNorm: x̂ · (1 + w), the weight stored as an offset from one.

    With `residual`, the residual add before the norm is part of it: returns (norm(x + residual),
    x + residual), the sum rounded to x's dtype as `x + residual` would be. With `reduce`, x is this
    rank's partial sum (a row-parallel layer's output), summed across the group first: in the same
    kernel as the add and the norm where TPGroup.all_reduce_rms_norm applies."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(dim), requires_grad=False)
        self.eps = eps
        self.invariant = False  # batch-invariant mode (CausalLM.set_batch_invariant)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None, reduce: TPGroup | None = None):
        if reduce is not None:
            fused = reduce.all_reduce_rms_norm(x, residual, self.weight, self.eps) if residual is not None else None
            if fused is not None:
                return fused
            x = reduce.all_reduce(x)  # x itself in a group of one
        if kernels.enabled(x):
            return kernels.norm.rms_norm(x, self.weight, self.eps, residual)
        if residual is not None:
            x = x + residual
            return self.forward(x), x
        xf = x.float()
        xf = xf * torch.rsqrt(row_reduce(mean_square, xf, self.invariant) + self.eps)
        return (xf * (1.0 + self.weight.float())).to(x.dtype)


class GatedRMSNorm(nn.Module):
    """The per-head output norm of Gated DeltaNet: x̂ · w · silu(z), with a plain weight."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim), requires_grad=False)
        self.eps = eps
        self.invariant = False  # batch-invariant mode (CausalLM.set_batch_invariant)

    def forward(self, x: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        if kernels.enabled(x):
            return kernels.norm.gated_rms_norm(x, z, self.weight, self.eps)
        xf = x.float()
        xf = xf * torch.rsqrt(row_reduce(mean_square, xf, self.invariant) + self.eps)
        # the weight multiplies in the input dtype, as the reference does, before the fp32 gate
        y = self.weight * xf.to(x.dtype)
        return (y.float() * pointwise(F.silu, z.float(), self.invariant)).to(x.dtype)
