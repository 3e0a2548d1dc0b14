"""The quantization a model is built with: read from its checkpoint (models.loader), given to the
model's constructor, asked by each projection for its method (layers.linear.LinearMethod) when the
projection is built."""

from __future__ import annotations

from dataclasses import dataclass, field

from shardspec.layers.fp8 import Fp8LinearMethod
from shardspec.layers.linear import UNQUANTIZED, LinearMethod


@dataclass(frozen=True)
class QuantConfig:
    """The checkpoint weights the model keeps quantised. `fp8_weights`: the block-wise FP8 ones
    (checkpoint keys, text layout `model.…`) and their full shapes; a weight left out is read in
    the model's dtype (an FP8 one dequantised at load)."""

    fp8_weights: dict[str, tuple[int, int]] = field(default_factory=dict)

    def linear_method(self, keys: list[str]) -> LinearMethod:
        """The method of a projection read from `keys` (one per part): block-wise FP8 where any of
        them is kept FP8, else unquantised."""
        shapes = [self.fp8_weights.get(key) for key in keys]
        if any(shape is not None for shape in shapes):
            return Fp8LinearMethod(keys, shapes)
        return UNQUANTIZED
