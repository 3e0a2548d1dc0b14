"""The SiLU-gated MLP: gate and up column-split, down row-split."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from shardspec import kernels
from shardspec.layers.invariant import pointwise
from shardspec.layers.linear import MergedColumnParallelLinear, RowParallelLinear
from shardspec.layers.parallel import TPGroup
from shardspec.layers.quantization import QuantConfig


def silu_mul(gate: torch.Tensor, up: torch.Tensor, invariant: bool = False) -> torch.Tensor:
    """silu(gate) · up: one kernel on CUDA; batch-invariant elementwise on a CPU with `invariant`."""
    if kernels.enabled(gate):
        return kernels.norm.silu_mul(gate, up)
    return pointwise(F.silu, gate, invariant) * up


class MLP(nn.Module):
    """down(silu(gate(x)) · up(x)); returns this rank's partial sum (RowParallelLinear)."""

    def __init__(self, hidden_size: int, intermediate_size: int, tp: TPGroup, quant: QuantConfig | None = None,
                 prefix: str = ""):
        super().__init__()
        rows = [tp.split(intermediate_size)]
        self.gate_up_proj = MergedColumnParallelLinear(hidden_size, {"gate_proj": rows, "up_proj": rows}, quant,
                                                       f"{prefix}.gate_up_proj")
        self.down_proj = RowParallelLinear(rows, hidden_size, quant, f"{prefix}.down_proj")
        self.invariant = False  # batch-invariant mode (CausalLM.set_batch_invariant)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x)
        if self.down_proj.method.fuses_silu and kernels.enabled(gate):  # e.g. FP8 weights on the GPU:
            return self.down_proj(gate, up=up)  # silu(gate) · up inside the activations' quantiser
        return self.down_proj(silu_mul(gate, up, self.invariant))
