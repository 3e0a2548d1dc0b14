"""Checkpoints in the FP8 releases' format: which weights they quantise, block-wise e4m3
quantisation with its scales, and the config that says so."""

from __future__ import annotations

import threading
from collections.abc import Callable

import torch
from torch import Tensor

from shardspec.testing.checkpoint_files import layout_name
from shardspec.testing.random_weights import parameter_shapes

# What the FP8 releases leave unquantised among the 2-D weights (docs/architecture.md, "FP8 checkpoints")
FP8_KEEP = ("embed_tokens", "lm_head", "in_proj_a", "in_proj_b", "mtp.fc", "mlp.gate.", "shared_expert_gate")
FP8_BLOCK, FP8_MAX = 128, 448.0


def fp8_quantized(name: str, shape: tuple[int, ...]) -> bool:
    """Whether an FP8 release stores this text-layout tensor as FP8 (with a weight_scale_inv)."""
    return name.endswith(".weight") and len(shape) == 2 and not any(part in name for part in FP8_KEEP)


def quantize_fp8(weight: Tensor) -> tuple[Tensor, Tensor]:
    """weight [N, K] -> (e4m3 [N, K], fp32 scales [⌈N/128⌉, ⌈K/128⌉]) with weight ≈ w8 · scale per
    128 × 128 block, each block's largest magnitude mapped to e4m3's largest (448)."""
    n, k = weight.shape
    nb, kb = -(-n // FP8_BLOCK), -(-k // FP8_BLOCK)
    tiles = weight.new_zeros(nb * FP8_BLOCK, kb * FP8_BLOCK, dtype=torch.float32)
    tiles[:n, :k] = weight
    tiles = tiles.view(nb, FP8_BLOCK, kb, FP8_BLOCK)
    amax = tiles.abs().amax(dim=(1, 3))
    scale = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    w8 = tiles.div_(scale[:, None, :, None]).clamp_(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return w8.view(nb * FP8_BLOCK, kb * FP8_BLOCK)[:n, :k].contiguous(), scale


def fp8_config(config: dict, layout: str) -> dict:
    """`config` with the quantization_config of an FP8 release in `layout`."""
    keep = sorted({layout_name(n, layout).removesuffix(".weight") for n, shape in parameter_shapes(config).items()
                   if len(shape) == 2 and not fp8_quantized(n, shape)})
    return {**config, "quantization_config": {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                              "weight_block_size": [FP8_BLOCK, FP8_BLOCK],
                                              "modules_to_not_convert": keep}}


class Quantizer:
    """Each weight quantised once, whichever of it and its scale a writer thread asks for first;
    forgotten once both are taken."""

    def __init__(self, make: Callable[[str], Tensor]):
        self.make, self.lock, self.slots = make, threading.Lock(), {}

    def get(self, name: str, part: int) -> Tensor:
        """Part 0 (the FP8 weight) or 1 (its scales) of weight `name`."""
        with self.lock:
            slot = self.slots.setdefault(name, [threading.Lock(), None, 2])
        with slot[0]:
            if slot[1] is None:
                slot[1] = quantize_fp8(self.make(name))
            value = slot[1][part]
            slot[2] -= 1
        if not slot[2]:
            with self.lock:
                self.slots.pop(name, None)
        return value



def fp8_entries(entries: list[tuple[str, tuple[int, ...], torch.dtype]]) -> list:
    """The (name, shape, dtype) entries of the FP8 form: each quantised weight as e4m3, followed
    by its fp32 weight_scale_inv."""
    out = []
    for name, shape, dtype in entries:
        if not fp8_quantized(name, shape):
            out.append((name, shape, dtype))
            continue
        blocks = tuple(-(-n // FP8_BLOCK) for n in shape)
        out += [(name, shape, torch.float8_e4m3fn), (name + "_scale_inv", blocks, torch.float32)]
    return out

