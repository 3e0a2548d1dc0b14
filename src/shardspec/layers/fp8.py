"""Projections whose weights stay in the checkpoint's block-wise FP8: float8 e4m3 with one fp32 scale
per BLOCK × BLOCK block (W = W8 · scale), the format of the fine-grained FP8 releases.

On CUDA the GEMM reads the FP8 weight (shardspec.kernels.fp8); elsewhere, and as the reference,
the weight is dequantised and multiplied as a bf16/fp32 one. A merged projection whose checkpoint
leaves some parts unquantised (Gated DeltaNet's in_proj_a/b beside in_proj_qkv/z) holds those rows
as a plain weight `rest` and multiplies it on its own.
"""

from __future__ import annotations

import torch
from torch import nn

from shardspec import kernels
from shardspec.layers.linear import linear

BLOCK = 128  # the weight_block_size [128, 128] of the FP8 releases: the only one supported
FP8 = torch.float8_e4m3fn


def dequantize(w8: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype, rows: torch.Tensor | None = None,
               cols: torch.Tensor | None = None) -> torch.Tensor:
    """W8 · scale in fp32, cast to dtype. w8 holds the rows `rows` and columns `cols` (indices into
    the full tensor, whose blocks `scale` [⌈N/BLOCK⌉, ⌈K/BLOCK⌉] scales); default: all of them."""
    rows = torch.arange(w8.shape[0], device=scale.device) if rows is None else rows.to(scale.device)
    cols = torch.arange(w8.shape[1], device=scale.device) if cols is None else cols.to(scale.device)
    per_element = scale.float()[rows // BLOCK][:, cols // BLOCK]
    return (w8.float() * per_element).to(dtype)


def fp8_linear(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, block_rows: int = 0,
               cublas_scale: torch.Tensor | None = None, up: torch.Tensor | None = None) -> torch.Tensor:
    """x @ (weight · scale).T in x's dtype; block_rows > 0: batch-invariant (layers.invariant);
    cublas_scale: see prepare_kernels; up (with the kernels only): silu(x) · up @ (weight · scale).T,
    the MLP's down projection with its SiLU·up in the activations' quantiser (kernels.fp8.linear)."""
    if kernels.enabled(x):
        return kernels.fp8.linear(x, weight, scale, block_rows > 0, cublas_scale, up)
    assert up is None, "silu(x) · up inside the projection is a kernel's (kernels.enabled)"
    return linear(x, dequantize(weight, scale, x.dtype), block_rows)


def prepare_kernels(model: nn.Module) -> None:
    """Once loaded on CUDA: each Fp8Linear's scales also in the layout of torch's scaled_mm, for
    the prefill GEMMs, where cuBLAS has block-scaled FP8 for its shape (kernels.fp8.cublas_layout),
    and the decode kernel's split-K counters allocated before any CUDA graph is captured."""
    for module in model.modules():
        if isinstance(module, Fp8Linear) and kernels.enabled(module.weight):
            kernels.fp8.prepare(module.weight.device)
            module.cublas_scale = kernels.fp8.cublas_layout(module.weight, module.weight_scale_inv)


class Fp8Linear(nn.Module):
    """A projection of `cols` inputs to `rows` FP8 rows, plus `rest_rows` plain rows (see the module
    doc). `outputs`: for a merged projection, each part's (from rest?, first row, rows) in its
    checkpoint order, returned as a tuple of views; None: one output, all FP8 rows. FP8 parts start
    on a block boundary (the loader pads them), so no scale block spans two parts."""

    block_rows = 0  # batch-invariant mode (CausalLM.set_batch_invariant)

    def __init__(self, rows: int, cols: int, outputs: list[tuple[bool, int, int]] | None = None,
                 rest_rows: int = 0, dtype: torch.dtype | None = None):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(rows, cols, dtype=FP8), requires_grad=False)
        self.weight_scale_inv = nn.Parameter(torch.empty(-(-rows // BLOCK), -(-cols // BLOCK), dtype=torch.float32),
                                             requires_grad=False)
        self.rest = nn.Parameter(torch.empty(rest_rows, cols, dtype=dtype), requires_grad=False) if rest_rows else None
        self.outputs = outputs
        self.cublas_scale: torch.Tensor | None = None  # (prepare_kernels)

    def forward(self, x: torch.Tensor, up: torch.Tensor | None = None) -> torch.Tensor | tuple[torch.Tensor, ...]:
        """self(x); with `up` (one output, the kernels on: layers.mlp.MLP) self(silu(x) · up)."""
        y = fp8_linear(x, self.weight, self.weight_scale_inv, self.block_rows, self.cublas_scale, up)
        if self.outputs is None:
            return y
        assert up is None, "silu(x) · up goes to a projection of one output"
        rest = linear(x, self.rest, self.block_rows) if self.rest is not None else None
        return tuple((rest if from_rest else y)[..., start : start + size] for from_rest, start, size in self.outputs)
