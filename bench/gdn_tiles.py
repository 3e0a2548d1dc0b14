"""The gated delta rule kernel of a decode/verify step on one GPU, at several tile shapes, against
its floor: the recurrent state's bytes ÷ the copy bandwidth measured in the same run.

    python bench/gdn_tiles.py [--batch 1 8 32] [--out kernels.json] [--device cuda:N]

The 9B-class Gated DeltaNet shape (16 key heads, 32 value heads, head dims 128), per batch size:
a decode step (1 token; reads and writes the state), a verify pass of 4 tokens (k = 3; reads it)
and the commit's replay of its accepted prefix (reads and writes it), each at (block_v, warps)
choices, timed inside a CUDA graph. The current choice is (16, 2).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from gpu_timing import add_device, graph_time, start

from shardspec.kernels import gdn

HK, HV, D = 16, 32, 128
TILES = [(16, 2), (16, 4), (32, 2), (32, 4), (64, 4), (64, 8)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--out", type=Path, default=Path("kernels.json"))
    add_device(parser)
    args = parser.parse_args()
    device, bandwidth, out = start("gdn_tiles.py", ["batch", "pass", "block_v × warps"], device=args.device)
    width = 2 * HK * D + HV * D
    for batch in args.batch:
        state = torch.randn(batch + 1, HV, D, D, device=device) * 0.01
        slots = torch.arange(batch, device=device)
        state_bytes = batch * HV * D * D * 4
        for name, T, write_out, write_state, lengths, moved in [
            ("decode", 1, True, True, None, 2 * state_bytes),
            ("verify k=3", 4, True, False, None, state_bytes),
            ("commit", 4, False, True, torch.full((batch,), 3, device=device), 2 * state_bytes),
        ]:
            qkv = torch.randn(batch, T, width, device=device, dtype=torch.bfloat16)
            ab = torch.randn(batch, T, 2 * HV, device=device, dtype=torch.bfloat16)
            a, b = ab[..., :HV], ab[..., HV:]
            A_log, dt_bias = torch.randn(HV, device=device), torch.randn(HV, device=device)
            for block_v, warps in TILES:
                def run(block_v=block_v, warps=warps):
                    gdn.delta_rule(qkv, a, b, A_log, dt_bias, state, slots, HK, D, write_out=write_out,
                                   write_state=write_state, lengths=lengths, block_v=block_v, num_warps=warps)

                seconds = graph_time(run)
                floor = moved / bandwidth
                out["rows"].append({"batch": batch, "pass": name, "block_v": block_v, "warps": warps,
                                    "us": seconds * 1e6, "floor_us": floor * 1e6})
                print(f"| {batch} | {name} | {block_v} × {warps} | {seconds * 1e6:.1f} | {floor * 1e6:.1f} "
                      f"| {floor / seconds:.0%} |", flush=True)
    args.out.write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
