"""Column- and row-parallel linear layers (no bias: Qwen3.5 has none). Each holds the method its
model's QuantConfig gives it when it is built (layers.quantization): the method makes the layer's
parameters, with their slice specs, and multiplies by them."""

from __future__ import annotations

from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn

from shardspec import kernels
from shardspec.layers import invariant
from shardspec.layers.parallel import WHOLE, Ranges, SliceSpec, TPGroup


def linear(x: torch.Tensor, weight: torch.Tensor, block_rows: int = 0) -> torch.Tensor:
    """x @ weight.T; with block_rows > 0 batch-invariant (layers.invariant.matmul); a decode's few
    bf16 rows on CUDA by kernels.gemv."""
    if block_rows:
        return invariant.matmul(x, weight, block_rows)
    if kernels.enabled(x) and kernels.gemv.takes(x, weight):
        return kernels.gemv.linear(x, weight)
    return F.linear(x, weight)



class Quantization(Protocol):
    """What gives a layer its method when it is built (layers.quantization.QuantConfig)."""

    def linear_method(self, keys: list[str]) -> LinearMethod: ...

class LinearMethod:
    """How a projection holds and multiplies its weights: unquantised here, block-wise FP8 in
    layers.fp8. The layer keeps the tensors; a method keeps only their layout."""

    quantized = False  # the layer's weights are other than one `weight` in the activations' dtype
    fuses_silu = False  # apply takes `up`: silu(x) · up inside the projection, with the kernels on

    def create_weights(self, layer: Linear, rows: int, cols: int, spec: SliceSpec) -> None:
        """The layer's parameters for `rows` × `cols` of the projection, cut from the checkpoint as
        `spec` says, with their own specs in layer.slice_specs."""
        layer.weight = nn.Parameter(torch.empty(rows, cols), requires_grad=False)
        layer.slice_specs["weight"] = spec

    def apply(self, layer: Linear, x: torch.Tensor, up: torch.Tensor | None = None) -> torch.Tensor:
        """x times the projection, every output row in order (a merged one's parts joined)."""
        assert up is None, "silu(x) · up inside the projection is a method's that fuses_silu"
        return linear(x, layer.weight, layer.block_rows)

    def apply_parts(self, layer: Linear, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """A merged projection's outputs, one per part in order (views)."""
        return self.apply(layer, x).split(layer.sizes, -1)

    def after_loading(self, layer: Linear) -> None:
        """Once the weights are in place on their device (layouts the kernels want)."""


UNQUANTIZED = LinearMethod()


class Linear(nn.Module):
    """A projection without bias, whose checkpoint weights are `keys` (one per part); `block_rows`
    (0: off) is set by CausalLM.set_batch_invariant."""

    block_rows = 0

    def __init__(self, rows: int, cols: int, spec: SliceSpec, keys: list[str], quant: Quantization | None):
        super().__init__()
        self.slice_specs: dict[str, SliceSpec] = {}
        self.method = quant.linear_method(keys) if quant is not None else UNQUANTIZED
        self.method.create_weights(self, rows, cols, spec)

    def forward(self, x: torch.Tensor, up: torch.Tensor | None = None) -> torch.Tensor:
        """self(x); with `up` (a method that fuses_silu: layers.mlp.MLP) self(silu(x) · up)."""
        return self.method.apply(self, x, up)


class MergedColumnParallelLinear(Linear):
    """Column-parallel projections of the same input as one matmul; returns their outputs in
    order (views of one tensor). `parts` maps each checkpoint module name to this rank's rows; the
    names are siblings of `prefix`'s last one."""

    def __init__(self, in_features: int, parts: dict[str, Ranges], quant: Quantization | None = None,
                 prefix: str = ""):
        sizes = [sum(end - start for start, end in ranges) for ranges in parts.values()]
        parent = prefix.rpartition(".")[0]
        keys = [f"{parent}.{name}.weight" for name in parts]
        spec = SliceSpec(parts=tuple((name, tuple(ranges)) for name, ranges in parts.items()))
        super().__init__(sum(sizes), in_features, spec, keys, quant)
        self.sizes = sizes

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return self.method.apply_parts(self, x)

    def joined(self, x: torch.Tensor) -> torch.Tensor:
        """The parts' outputs side by side, as one tensor."""
        return self.method.apply(self, x)


class RowParallelLinear(Linear):
    """Holds the input columns `ranges` and returns this rank's partial output, unreduced: every
    one of these layers feeds an RMSNorm, which sums it across the group (RMSNorm's `reduce`), in
    the same kernel as its residual add where it can."""

    def __init__(self, ranges: Ranges, out_features: int, quant: Quantization | None = None, prefix: str = ""):
        in_features = sum(end - start for start, end in ranges)
        super().__init__(out_features, in_features, SliceSpec(cut=(1, tuple(ranges))), [f"{prefix}.weight"], quant)


class ReplicatedLinear(Linear):
    def __init__(self, in_features: int, out_features: int, quant: Quantization | None = None, prefix: str = ""):
        super().__init__(out_features, in_features, WHOLE, [f"{prefix}.weight"], quant)


def after_loading(model: nn.Module) -> None:
    """Each projection's method, once the model's weights are loaded (LinearMethod.after_loading)."""
    for module in model.modules():
        if isinstance(module, Linear):
            module.method.after_loading(module)


def head_ranges(tp: TPGroup, num_heads: int, head_size: int, offset: int = 0) -> Ranges:
    """The rows of this rank's heads in a weight laid out head after head."""
    start, end = tp.split(num_heads)
    return [(offset + start * head_size, offset + end * head_size)]
