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
from shardspec.layers.linear import Linear, LinearMethod, linear
from shardspec.layers.parallel import Ranges, SliceSpec

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
    cublas_scale: see Fp8LinearMethod.after_loading; up (with the kernels only): silu(x) · up @
    (weight · scale).T, the MLP's down projection with its SiLU·up in the activations' quantiser
    (kernels.fp8.linear)."""
    if kernels.enabled(x):
        return kernels.fp8.linear(x, weight, scale, block_rows > 0, cublas_scale, up)
    assert up is None, "silu(x) · up inside the projection is a kernel's (kernels.enabled)"
    return linear(x, dequantize(weight, scale, x.dtype), block_rows)


class BlockSplitError(ValueError):
    """A rank's slice of an FP8 weight cuts through its BLOCK × BLOCK blocks (the loader names the
    TP degrees that do not)."""


def blocks(n: int) -> int:
    return -(-n // BLOCK)


class Fp8LinearMethod(LinearMethod):
    """A projection read from checkpoint weights `keys` (one per part), of full `shapes`; None for
    a part the checkpoint leaves unquantised. Its layer holds the FP8 rows in `weight`, their scale
    blocks in `weight_scale_inv` and the unquantised rows in `rest` (None: none). `outputs`: for a
    merged projection, each part's (from rest?, first row, rows) in order, returned as views; None:
    one output, all FP8 rows. FP8 parts start on a block boundary (padded with zero rows to whole
    blocks), so no scale block spans two parts; BlockSplitError where a rank's slice would split one."""

    quantized = True
    fuses_silu = True

    def __init__(self, keys: list[str], shapes: list[tuple[int, int] | None]):
        self.keys, self.shapes = keys, shapes
        self.outputs: list[tuple[bool, int, int]] | None = None

    def create_weights(self, layer: Linear, rows: int, cols: int, spec: SliceSpec) -> None:
        if spec.parts is None:
            self._single(layer, rows, cols, spec)
        else:
            self._merged(layer, cols, spec)
        layer.cublas_scale = None  # (after_loading)
        layer.fixed_dtypes = ("weight", "weight_scale_inv")  # the model's dtype is not theirs (models.loader)

    def _single(self, layer: Linear, rows: int, cols: int, spec: SliceSpec) -> None:
        """One FP8 checkpoint weight, whole or sliced along one dimension."""
        scales = SliceSpec(source="weight", block=BLOCK)
        if spec.cut is not None:
            dim, ranges = spec.cut
            joined = _whole_blocks(self.keys[0], ranges, self.shapes[0][dim])
            scales = SliceSpec(cut=(dim, _in_blocks(joined)), source="weight", block=BLOCK)
        self._fp8_weights(layer, rows, cols, spec, scales)
        layer.rest = None

    def _merged(self, layer: Linear, cols: int, spec: SliceSpec) -> None:
        """Stacked parts: the FP8 ones each padded to whole blocks with zero rows, the others into `rest`."""
        weight, scales, rest, self.outputs = [], [], [], []
        fp8_rows = rest_rows = 0
        for (name, ranges), key, shape in zip(spec.parts, self.keys, self.shapes, strict=True):
            size = sum(end - start for start, end in ranges)
            if shape is None:
                rest.append((name, ranges))
                self.outputs.append((True, rest_rows, size))
                rest_rows += size
                continue
            joined = _whole_blocks(key, ranges, shape[0])
            pad = -size % BLOCK  # only where the part ends at its tensor's end: rows past it read as zeros
            joined[-1] = (joined[-1][0], joined[-1][1] + pad)
            weight.append((name, tuple(joined)))
            scales.append((name, _in_blocks(joined)))
            self.outputs.append((False, fp8_rows, size))
            fp8_rows += size + pad
        self._fp8_weights(layer, fp8_rows, cols, SliceSpec(parts=tuple(weight)),
                          SliceSpec(parts=tuple(scales), source="weight", block=BLOCK))
        layer.rest = nn.Parameter(torch.empty(rest_rows, cols), requires_grad=False) if rest else None
        if rest:
            layer.slice_specs["rest"] = SliceSpec(parts=tuple(rest), source="weight")

    @staticmethod
    def _fp8_weights(layer: Linear, rows: int, cols: int, spec: SliceSpec, scales: SliceSpec) -> None:
        layer.weight = nn.Parameter(torch.empty(rows, cols, dtype=FP8), requires_grad=False)
        layer.weight_scale_inv = nn.Parameter(torch.empty(blocks(rows), blocks(cols), dtype=torch.float32),
                                              requires_grad=False)
        layer.slice_specs |= {"weight": spec, "weight_scale_inv": scales}

    def apply(self, layer: Linear, x: torch.Tensor, up: torch.Tensor | None = None) -> torch.Tensor:
        if self.outputs is None:
            return fp8_linear(x, layer.weight, layer.weight_scale_inv, layer.block_rows, layer.cublas_scale, up)
        assert up is None, "silu(x) · up goes to a projection of one output"
        return torch.cat(self.apply_parts(layer, x), -1)

    def apply_parts(self, layer: Linear, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        y = fp8_linear(x, layer.weight, layer.weight_scale_inv, layer.block_rows, layer.cublas_scale)
        rest = linear(x, layer.rest, layer.block_rows) if layer.rest is not None else None
        return tuple((rest if from_rest else y)[..., start : start + size] for from_rest, start, size in self.outputs)

    def after_loading(self, layer: Linear) -> None:
        """On CUDA: the scales also in the layout of torch's scaled_mm, for the prefill GEMMs, where
        cuBLAS has block-scaled FP8 for its shape (kernels.fp8.cublas_layout), and the decode
        kernel's split-K counters allocated before any CUDA graph is captured."""
        if kernels.enabled(layer.weight):
            kernels.fp8.prepare(layer.weight.device)
            layer.cublas_scale = kernels.fp8.cublas_layout(layer.weight, layer.weight_scale_inv)


def _in_blocks(ranges: Ranges) -> tuple[tuple[int, int], ...]:
    """Whole-block ranges of a weight as ranges of its scale blocks."""
    return tuple((start // BLOCK, blocks(end)) for start, end in ranges)


def _whole_blocks(key: str, ranges: Ranges, size: int) -> Ranges:
    """`ranges` with adjacent ones joined, once each is seen to start on a block boundary and to end
    on one or at the tensor's end (of `size` along the cut)."""
    joined: Ranges = []
    for start, end in ranges:
        if joined and joined[-1][1] == start:
            joined[-1] = (joined[-1][0], end)
        else:
            joined.append((start, end))
    for start, end in joined:
        if start % BLOCK or (end % BLOCK and end < size):
            raise BlockSplitError(f"splits the {BLOCK} × {BLOCK} FP8 blocks of {key!r} (a rank's slice "
                                  f"{start}:{end} of {size})")
    return joined
