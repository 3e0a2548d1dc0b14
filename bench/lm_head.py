"""The drafts' LM-head pass on one GPU: cuBLAS logits + argmax against the head kernel
(shardspec.kernels.head) on the bf16 weight and on an fp8 copy, against the floor.

    python bench/lm_head.py [--hidden 4096 5120] [--rows 1 2 4 8 16] [--out lm_head.json] [--device cuda:N]

A Qwen3.5 head (vocabulary 248,320) with random weights, for each hidden size and number of rows:
the median time of one argmax inside a CUDA graph (20 back to back per replay), and its floor, the
weight's bytes ÷ the copy bandwidth measured in the same run. The kernel runs at several block
shapes; the table gives each, so the default can be chosen from the numbers.

Each way's argmax is checked against the exact logits (fp32, of the weight it reads): of the rows
where it differs from cuBLAS's (the argmax of bf16-rounded logits), those whose exact logit is
within a bf16 ulp of the exact maximum are ties (bf16 logits cannot tell the two apart; for the
fp8 copy, the weight's own rounding), the others wrong indices; the last two columns count each.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from gpu_timing import add_device, graph_time, start

from shardspec.kernels import head

VOCAB = 248_320
BLOCKS = [(32, 128), (64, 128), (64, 256), (128, 128)]  # (block_n, block_k)


def ties_and_wrong(index: torch.Tensor, reference: torch.Tensor, exact: torch.Tensor) -> tuple[int, int]:
    """Of the rows where `index` differs from cuBLAS's `reference`: (ties, wrong). A tie: the exact
    logit at `index` is within one bf16 ulp of the row's exact maximum."""
    rows = (index != reference).nonzero()[:, 0]
    best = exact[rows].max(-1).values
    ulp = torch.exp2(torch.floor(torch.log2(best.abs())) - 7)  # bf16: 8 significant bits
    tie = exact[rows, index[rows]] >= best - ulp
    return int(tie.sum()), int((~tie).sum())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hidden", type=int, nargs="+", default=[4096, 5120])
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 8, 16])
    parser.add_argument("--out", type=Path, default=Path("lm_head.json"))
    add_device(parser)
    args = parser.parse_args()
    device, bandwidth, out = start("lm_head.py", ["hidden", "rows", "way"], ("ties", "wrong"), device=args.device)
    for hidden in args.hidden:
        weight = torch.randn(VOCAB, hidden, device=device, dtype=torch.bfloat16)
        w8, scale = head.quantize_rows(weight)
        for rows in args.rows:
            x = torch.randn(rows, hidden, device=device, dtype=torch.bfloat16)
            exact = {"bf16": x.float() @ weight.float().T, "fp8": x.float() @ (w8.float() * scale[:, None]).T}
            ways = {"cublas": (lambda: torch.nn.functional.linear(x, weight).float().max(-1), weight.nbytes)}
            for n, k in BLOCKS:
                ways[f"bf16 {n}x{k}"] = (lambda n=n, k=k: head.argmax(x, weight, None, VOCAB, n, k), weight.nbytes)
                ways[f"fp8 {n}x{k}"] = (lambda n=n, k=k: head.argmax(x, w8, scale, VOCAB, n, k),
                                        w8.nbytes + scale.nbytes)
            reference = ways["cublas"][0]().indices
            for way, (fn, nbytes) in ways.items():
                index = fn()[1]
                ties, wrong = ties_and_wrong(index, reference, exact[way.split()[0]]) if way != "cublas" else (0, 0)
                if wrong and way.startswith("bf16"):
                    print(f"warning: {way} picks an index that is not the maximum at hidden {hidden}, rows {rows}")
                seconds = graph_time(fn)
                floor = nbytes / bandwidth
                row = {"hidden": hidden, "rows": rows, "way": way, "us": seconds * 1e6, "floor_us": floor * 1e6,
                       "ties": ties, "wrong": wrong}
                out["rows"].append(row)
                print(f"| {hidden} | {rows} | {way} | {seconds * 1e6:.0f} | {floor * 1e6:.0f} "
                      f"| {floor / seconds:.0%} | {ties} | {wrong} |",
                      flush=True)
            exact = None
        weight = w8 = scale = None  # (before the next size is allocated)
        torch.cuda.empty_cache()
    args.out.write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
