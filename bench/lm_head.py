"""The drafts' LM-head pass on one GPU: cuBLAS logits + argmax against the head kernel
(shardspec.kernels.head) on the bf16 weight and on an fp8 copy, against the floor.

    python bench/lm_head.py [--hidden 4096 5120] [--rows 1 2 4 8 16] [--out lm_head.json]

A Qwen3.5 head (vocabulary 248,320) with random weights, for each hidden size and number of rows:
the median time of one argmax inside a CUDA graph (20 back to back per replay), and its floor, the
weight's bytes ÷ the copy bandwidth measured in the same run. The kernel runs at several block
shapes; the table gives each, so the default can be chosen from the numbers.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from gpu_timing import graph_time, start

from shardspec.kernels import head

VOCAB = 248_320
BLOCKS = [(32, 128), (64, 128), (64, 256), (128, 128)]  # (block_n, block_k)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hidden", type=int, nargs="+", default=[4096, 5120])
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 8, 16])
    parser.add_argument("--out", type=Path, default=Path("lm_head.json"))
    args = parser.parse_args()
    device, bandwidth, out = start("lm_head.py", ["hidden", "rows", "way"])
    for hidden in args.hidden:
        weight = torch.randn(VOCAB, hidden, device=device, dtype=torch.bfloat16)
        w8, scale = head.quantize_rows(weight)
        for rows in args.rows:
            x = torch.randn(rows, hidden, device=device, dtype=torch.bfloat16)
            ways = {"cublas": (lambda: torch.nn.functional.linear(x, weight).float().max(-1), weight.nbytes)}
            for n, k in BLOCKS:
                ways[f"bf16 {n}x{k}"] = (lambda n=n, k=k: head.argmax(x, weight, None, VOCAB, n, k), weight.nbytes)
                ways[f"fp8 {n}x{k}"] = (lambda n=n, k=k: head.argmax(x, w8, scale, VOCAB, n, k),
                                        w8.nbytes + scale.nbytes)
            reference = ways["cublas"][0]().indices
            for way, (fn, nbytes) in ways.items():
                if way.startswith("bf16") and not torch.equal(fn()[1], reference):
                    print(f"warning: {way} disagrees with cuBLAS's argmax at hidden {hidden}, rows {rows}")
                seconds = graph_time(fn)
                floor = nbytes / bandwidth
                row = {"hidden": hidden, "rows": rows, "way": way, "us": seconds * 1e6, "floor_us": floor * 1e6}
                out["rows"].append(row)
                print(f"| {hidden} | {rows} | {way} | {seconds * 1e6:.0f} | {floor * 1e6:.0f} "
                      f"| {floor / seconds:.0%} |",
                      flush=True)
        weight = w8 = scale = None  # (before the next size is allocated)
        torch.cuda.empty_cache()
    args.out.write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
