"""Fine-grained FP8 checkpoints (the block-wise FP8 releases): the format in config.json, which of
a checkpoint's tensors are FP8, and how a rank reads them.

config.json's `quantization_config` is {quant_method: fp8, fmt: e4m3, weight_block_size: [128,
128], activation_scheme: dynamic, modules_to_not_convert: [...]}; each quantised weight [N, K] is
float8 e4m3 beside its `weight_scale_inv` [⌈N/128⌉, ⌈K/128⌉], W = W8 · scale per block. Which
tensors are FP8 is read from the safetensors headers (their dtype), so what the checkpoint holds
decides, whatever the skip list names; every other tensor (embeddings, LM head, norms, ...) loads
as in a bf16 checkpoint.

Two ways to load one: dequantised at load into the model's dtype (the CPU path: any slice of a
weight works), or kept FP8 (the GPU path): the model is built with a layers.quantization.QuantConfig
naming the FP8 weights, and each projection whose checkpoint weights are FP8 takes the block-wise
FP8 method (layers.fp8.Fp8LinearMethod), holding the rank's slice of the weight and of its scale
blocks, so a rank's slice must consist of whole 128 × 128 blocks.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from shardspec.layers.fp8 import BLOCK, blocks, dequantize
from shardspec.models.config import ConfigError, text_config

SUPPORTED = ("supported: fine-grained FP8 (quant_method 'fp8', fmt 'e4m3', weight_block_size [128, 128], "
             "activation_scheme 'dynamic', float scales)")
FP8_DTYPE = "F8_E4M3"  # the safetensors dtype of a quantised weight
SCALE_DTYPES = ("F32", "BF16", "F16")
MAX_FP8_TP = 64  # the largest TP degree a refusal considers when it names the degrees that work



@dataclass(frozen=True)
class Fp8Format:
    """A checkpoint's fine-grained FP8 quantization (the only one supported)."""

    modules_to_not_convert: tuple[str, ...] = ()


def read_format(raw: dict[str, Any]) -> Fp8Format | None:
    """The FP8 format config.json declares, None for an unquantised checkpoint; ConfigError naming
    what is supported for any other quantization."""
    config = raw.get("quantization_config", text_config(raw).get("quantization_config"))
    if config is None:
        return None
    if not isinstance(config, dict):
        raise ConfigError(f"quantization_config must be a JSON object, got {config!r}; {SUPPORTED}")
    method = config.get("quant_method")
    if method != "fp8":
        raise ConfigError(f"quantization quant_method {method!r} is not supported; {SUPPORTED}")
    checks = {"fmt": ("e4m3", "e4m3"), "activation_scheme": ("dynamic", "dynamic"), "scale_fmt": ("float", "float"),
              "weight_block_size": (None, [BLOCK, BLOCK])}
    for field, (default, wanted) in checks.items():
        value = config.get(field, default)
        if value != wanted:
            raise ConfigError(f"FP8 quantization with {field} {value!r} is not supported; {SUPPORTED}")
    skip = config.get("modules_to_not_convert") or []
    if not isinstance(skip, list) or not all(isinstance(name, str) for name in skip):
        raise ConfigError(f"quantization_config.modules_to_not_convert must be a list of module names, got {skip!r}")
    return Fp8Format(tuple(skip))


def scale_key(key: str) -> str:
    """The scale tensor of a quantised weight: `x.weight` -> `x.weight_scale_inv`."""
    return key + "_scale_inv"


def quantized_keys(entries: dict[str, tuple[list[int], str]], fmt: Fp8Format | None, folder: Any) -> set[str]:
    """The FP8 weights among `entries` (checkpoint key -> (shape, safetensors dtype)), each checked
    to be a 2-D `.weight` of e4m3 with a float scale of the shape its blocks imply (`entries` must
    hold the scales too)."""
    quantized = {key for key, (_, dtype) in entries.items() if dtype == FP8_DTYPE}
    other_fp8 = sorted(key for key, (_, dtype) in entries.items() if dtype.startswith("F8_") and dtype != FP8_DTYPE)
    if other_fp8:
        raise ConfigError(f"tensor {other_fp8[0]!r} is {entries[other_fp8[0]][1]}; {SUPPORTED}")
    if quantized and fmt is None:
        raise ConfigError(f"{folder}: tensor {min(quantized)!r} is FP8 but config.json has no quantization_config; "
                          f"{SUPPORTED}")
    for key in sorted(quantized):
        shape = entries[key][0]
        if not key.endswith(".weight") or len(shape) != 2:
            raise ConfigError(f"FP8 tensor {key!r} of shape {shape}: only 2-D .weight tensors can be FP8")
        scale = entries.get(scale_key(key))
        if scale is None:
            raise ConfigError(f"FP8 weight {key!r} has no {scale_key(key)!r} in the checkpoint")
        expected = [blocks(shape[0]), blocks(shape[1])]
        if scale[0] != expected or scale[1] not in SCALE_DTYPES:
            raise ConfigError(f"{scale_key(key)!r} is {scale[1]} {scale[0]}; a weight of shape {shape} needs "
                              f"float scales of shape {expected} (one per {BLOCK} × {BLOCK} block)")
    return quantized


def split_problem(config: Any, tp: int, quantized: set[str]) -> str | None:
    """Why `tp` ranks would cut through the blocks of a weight in `quantized`, from the config's
    `tp_splits` (a family without it: None, and the loader finds out when it builds the model), or None."""
    splits = getattr(config, "tp_splits", None)
    for name, segments in (splits(tp) if splits else {}).items():
        key = min((key for key in quantized if key.endswith(f".{name}.weight")), default=None)
        if key is None:
            continue
        for whole, part in segments:
            if part != whole and part % BLOCK:
                return (f"tensor-parallel degree {tp} splits the {BLOCK} × {BLOCK} FP8 blocks of {key!r} (a rank "
                        f"holds {part} of its {whole} rows or columns along the split)")
    return None


def whole_block_degrees(config: Any, quantized: set[str]) -> list[int] | None:
    """The TP degrees (up to MAX_FP8_TP) that split the model and keep every FP8 weight's blocks
    whole; None for a family whose config has no `tp_splits`."""
    if getattr(config, "tp_splits", None) is None:
        return None
    degrees = []
    for tp in range(1, MAX_FP8_TP + 1):
        try:
            config.check_tp(tp)
        except ConfigError:
            continue
        if split_problem(config, tp, quantized) is None:
            degrees.append(tp)
    return degrees


def dequantize_slice(w8: torch.Tensor, scale: torch.Tensor, spec: tuple | None, shape: list[int],
                     dtype: torch.dtype) -> torch.Tensor:
    """A rank's slice `spec` (loader: None or (dim, ranges)) of an FP8 weight of `shape`, dequantised."""
    index = [torch.arange(n) for n in shape]
    if spec is not None:
        dim, ranges = spec  # rows past the end (padding) are zeros: any block's scale does
        index[dim] = torch.cat([torch.arange(start, end) for start, end in ranges]).clamp(max=shape[dim] - 1)
    return dequantize(w8, scale, dtype, *index)
