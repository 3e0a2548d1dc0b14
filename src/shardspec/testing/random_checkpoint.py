"""Random-weight Qwen3.5 (dense and mixture-of-experts, text) checkpoints in Hugging Face folder format.

The parts live apart: the model sizes (sizes), the parameters and their random values
(random_weights), the FP8 releases' format (fp8), the folder and its safetensors files
(checkpoint_files); this module writes a whole checkpoint from them and names what tests and
benchmarks use in one place.
"""

from __future__ import annotations

import math
import sys
from pathlib import Path

import torch
from torch import Tensor

from shardspec.testing.checkpoint_files import LAYOUTS, layout_name, text_layout_name, write_checkpoint, write_folder
from shardspec.testing.fp8 import Quantizer, fp8_config, fp8_entries, fp8_quantized
from shardspec.testing.random_weights import EXPERT_LAYOUTS, parameter_shapes, random_state_dict, random_tensor
from shardspec.testing.sizes import (
    SIZES,
    nine_b_config,
    thirty_five_b_a3b_config,
    tiny_config,
    tiny_moe_config,
    twenty_seven_b_config,
)

__all__ = ["SIZES", "fp8_quantized", "layout_name", "main", "nine_b_config", "parameter_shapes", "random_state_dict",
           "text_layout_name", "thirty_five_b_a3b_config", "tiny_config", "tiny_moe_config", "twenty_seven_b_config",
           "write_checkpoint", "write_random_checkpoint"]

KEEP_LIMIT_BYTES = 1 << 30  # write_random_checkpoint keeps tensors by default only below this


def write_random_checkpoint(
    path: str | Path,
    config: dict | None = None,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
    layout: str = "model",
    shards: int = 1,
    mtp: bool = True,
    keep: bool | None = None,
    fp8: bool = False,
    experts: str = "fused",
    zero_experts: bool = False,
) -> dict[str, Tensor]:
    """Stream a random checkpoint to `path`; returns its text-layout state dict, or {} if not kept.
    `experts`: the routed experts' layout of an MoE config (EXPERT_LAYOUTS). `zero_experts`: the
    routed experts are zeros, written as holes (benchmarks on small disks: 35B-A3B's experts are
    64 of its 70 GB; a step's speed does not depend on their values, and routing, which does,
    stays random); every other tensor is random.

    Tensors are generated a few at a time while writing, so peak memory is a few tensors plus what
    is kept; `keep=None` keeps (and returns) the state dict only below KEEP_LIMIT_BYTES. fp8: in an
    FP8 release's format, quantised from the `dtype` checkpoint of the same seed (fp8_quantized).
    """
    config = dict(tiny_config() if config is None else config)
    config["dtype"] = str(dtype).removeprefix("torch.")
    shapes = parameter_shapes(config, mtp, experts)
    entries = [(n, s, dtype) for n, s in shapes.items()]
    if fp8:
        config = fp8_config(config, layout)
        entries = fp8_entries(entries)
    if keep is None:
        keep = sum(math.prod(s) * d.itemsize for _, s, d in entries) < KEEP_LIMIT_BYTES
    kept: dict[str, Tensor] = {}
    written = {n: (s, d) for n, s, d in entries}  # FP8 weights and their scales included
    quantizer = Quantizer(lambda name: random_tensor(config, name, shapes[name], seed, dtype))

    def tensor_of(name: str) -> Tensor | None:
        if zero_experts and ".experts." in name:
            if keep:
                kept[name] = torch.zeros(written[name][0], dtype=written[name][1])
            return None
        if name.endswith("_scale_inv"):
            t = quantizer.get(name.removesuffix("_scale_inv"), 1)
        elif fp8 and fp8_quantized(name, shapes[name]):
            t = quantizer.get(name, 0)
        else:
            t = random_tensor(config, name, shapes[name], seed, dtype)
        if keep:
            kept[name] = t
        return t

    write_folder(path, config, entries, tensor_of, layout, shards)
    return {n: kept[n] for n, _, _ in entries} if keep else {}


def main(argv: list[str] | None = None) -> None:
    """`python -m shardspec.testing.random_checkpoint DIR`: write a random-weight checkpoint."""
    import argparse

    parser = argparse.ArgumentParser(description="Write a random-weight Qwen3.5 checkpoint folder.")
    parser.add_argument("path", type=Path)
    parser.add_argument("--size", choices=SIZES, default="tiny")
    parser.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default=None,
                        help="default: float32 for the tiny sizes, bfloat16 otherwise")
    parser.add_argument("--layout", choices=LAYOUTS, default="model")
    parser.add_argument("--shards", type=int, default=1)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--no-mtp", action="store_true", help="leave out the mtp.* weights")
    parser.add_argument("--fp8", action="store_true",
                        help="block-wise FP8 (e4m3, 128 × 128 scales) as the FP8 releases, quantised from the "
                             "--dtype checkpoint of the same seed; unquantised tensors in --dtype")
    parser.add_argument("--experts", choices=EXPERT_LAYOUTS, default="mixed",
                        help="MoE sizes: routed experts as fused 3-D tensors, one tensor per expert, or mixed (fused "
                             "in the layers, per expert in the MTP layer, as Qwen3.5-35B-A3B is released)")
    parser.add_argument("--zero-experts", action="store_true",
                        help="MoE sizes, for benchmarks on small disks: routed experts all zeros, written as holes of "
                             "sparse files (35B-A3B: ~6 GB on disk instead of 70); every other tensor random")
    args = parser.parse_args(argv)
    config = SIZES[args.size]()
    if args.zero_experts and "num_experts" not in config:
        moe = ", ".join(size for size, make in SIZES.items() if "num_experts" in make())
        parser.error(f"--zero-experts applies to the MoE sizes ({moe}), not {args.size}")
    dtype = getattr(torch, args.dtype or ("float32" if args.size.startswith("tiny") else "bfloat16"))
    try:
        write_random_checkpoint(args.path, config, seed=args.seed, dtype=dtype, layout=args.layout,
                                shards=args.shards, mtp=not args.no_mtp, keep=False, fp8=args.fp8,
                                experts=args.experts, zero_experts=args.zero_experts)
    except ValueError as exc:  # a --shards count the checkpoint's tensors cannot fill
        parser.error(str(exc))
    kind = "FP8 " if args.fp8 else ""
    print(f"wrote a random {kind}{args.size} checkpoint to {args.path}", file=sys.stderr)


if __name__ == "__main__":
    main()
