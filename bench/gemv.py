"""The bf16 decode GEMV (kernels.gemv) at the 9B-class projection shapes on one GPU, against its
floor and against cuBLAS in the same run.

    python bench/gemv.py [--rows 1 2 4 8 16 32] [--out gemv.json] [--sweep] [--device cuda:N]

Per shape and row count, timed inside a CUDA graph (µs per call): cuBLAS (torch's linear) and our
kernel at the plan its rule picks (kernels.gemv.plan), each against its floor: the weight, x and y
÷ the copy bandwidth measured in the same run. Each result of ours is checked against cuBLAS first (max
error ÷ max |y|, printed).

--sweep, instead of the table: our kernel over a grid of plans (weight rows per program, K tile,
programs per SM, weight tiles in flight, warps) at rows 1, 4 and 8; the best ten per shape and the
rule's place among them.
"""

from __future__ import annotations

import argparse
import itertools
import json
from pathlib import Path

import torch
import triton
from fp8_gemm import SHAPES as FP8_SHAPES
from gpu_timing import add_device, graph_time, row, start

from shardspec.kernels import gemv

SHAPES = {name: shape for name, shape in FP8_SHAPES.items() if name != "attn o_proj"}  # (gdn out_proj's shape)


def operands(M: int, N: int, K: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator(device=device).manual_seed(M)
    x = torch.randn(M, K, device=device, generator=gen, dtype=torch.bfloat16)
    return x, torch.randn(N, K, device=device, generator=gen, dtype=torch.bfloat16) * K**-0.5


def error(y: torch.Tensor, reference: torch.Tensor) -> float:
    return ((y.float() - reference.float()).abs().max() / reference.float().abs().max()).item()


def table(rows: list[int], device: torch.device, bandwidth: float, out: dict) -> None:
    sms = gemv.sm_count(device)
    for (name, (N, K)), M in itertools.product(SHAPES.items(), rows):
        x, weight = operands(M, N, K, device)
        fields = {"shape": name, "N × K": f"{N} × {K}", "rows": M}
        floor_bytes = 2 * (N * K + M * (K + N))
        cublas = torch.nn.functional.linear(x, weight)
        row(out, {**fields, "kernel": "cuBLAS"}, graph_time(lambda: torch.nn.functional.linear(x, weight)),
            floor_bytes, bandwidth)
        launch = gemv.plan(M, N, K, sms)
        row(out, {**fields, "kernel": "ours"}, graph_time(lambda: gemv.launch(x, weight, launch)), floor_bytes,
            bandwidth, f"{describe(launch)}, error {error(gemv.launch(x, weight, launch), cublas):.1e}")
        torch.cuda.empty_cache()


def describe(plan: gemv.Plan) -> str:
    return (f"BM {plan.block_m} BN {plan.block_n} BK {plan.block_k} split {plan.split} stages {plan.stages} "
            f"warps {plan.warps}")


def grid(M: int, N: int, K: int, sms: int) -> list[gemv.Plan]:
    """Plans around the rule: 64 or 128 weight rows a program, K tiles of 128 or 256, split until
    1-4 programs per SM (at least two K tiles a split), 3 or 4 tiles in flight, 4 or 8 warps."""
    def split_for(block_n: int, block_k: int, per_sm: int) -> int:
        tiles, blocks, split = triton.cdiv(N, block_n), triton.cdiv(K, block_k), 1
        while tiles * split < per_sm * sms and blocks // (2 * split) >= 2 and split < 32:
            split *= 2
        return split

    block_m = min(64, max(16, triton.next_power_of_2(M)))
    plans = [gemv.Plan(block_m, block_n, split_for(block_n, block_k, per_sm), stages, warps=warps, block_k=block_k)
             for block_n, block_k, per_sm, stages, warps in itertools.product((64, 128), (128, 256), (1, 2, 4), (3, 4),
                                                                               (4, 8))]
    return list(dict.fromkeys(plans))


def sweep(device: torch.device, bandwidth: float, out: dict, path: Path) -> None:
    sms = gemv.sm_count(device)
    out["sweep"] = []
    shapes = sorted(SHAPES.items(), key=lambda shape: shape[1][0])  # the narrow ones first: most to win there
    for (name, (N, K)), M in itertools.product(shapes, (1, 4, 8)):
        x, weight = operands(M, N, K, device)
        floor = 2 * (N * K + M * (K + N)) / bandwidth
        cublas = graph_time(lambda: torch.nn.functional.linear(x, weight))
        rule = gemv.plan(M, N, K, sms)
        results = []
        plans = grid(M, N, K, sms)
        for plan in plans if rule in plans else [rule, *plans]:
            try:
                seconds = graph_time(lambda plan=plan: gemv.launch(x, weight, plan))
            except triton.runtime.errors.OutOfResources:
                continue
            results.append((seconds, plan))
            out["sweep"].append({"shape": name, "rows": M, "plan": describe(plan), "us": seconds * 1e6,
                                 "of_floor": floor / seconds})
        results.sort(key=lambda result: result[0])
        rank = next(i for i, (_, plan) in enumerate(results) if plan == rule) + 1
        print(f"\n{name} ({N} × {K}), {M} rows: cuBLAS {cublas * 1e6:.1f} µs ({floor / cublas:.0%}); "
              f"the rule {describe(rule)} ranks {rank} of {len(results)}")
        for seconds, plan in results[:10]:
            print(f"  {seconds * 1e6:6.1f} µs {floor / seconds:4.0%}  {describe(plan)}", flush=True)
        path.write_text(json.dumps(out, indent=1))
        torch.cuda.empty_cache()


@torch.inference_mode()
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32],
                        help="activation rows (default: 1 2 4 8 16 32)")
    parser.add_argument("--out", type=Path, default=Path("gemv.json"), help="the results as JSON (default gemv.json)")
    parser.add_argument("--sweep", action="store_true", help="instead of the table: our kernel over a grid of plans")
    add_device(parser)
    args = parser.parse_args()
    device, bandwidth, out = start("gemv.py", ["shape", "N × K", "rows", "kernel"], after=("plan, error",),
                                   device=args.device)
    gemv.prepare(device)
    if args.sweep:
        sweep(device, bandwidth, out, args.out)
    else:
        table(args.rows, device, bandwidth, out)
        args.out.write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
