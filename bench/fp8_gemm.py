"""The FP8 GEMMs at the 9B-class projection shapes on one GPU, against their floor and against bf16.

    python bench/fp8_gemm.py [--rows 1 8 32] [--prefill 2048] [--out fp8-gemm.json] [--sweep read stages]
        [--device cuda:N]

Per shape and row count, timed inside a CUDA graph: the decode kernel at the plan its rule picks
(kernels.fp8.plan) in both modes, weight-only (bf16 activations) and W8A8 (activations rounded to
e4m3 by quantize_groups first: both launches timed), and the W8A8 mode at a few other plans (half
and twice the K splits, 64-row weight strips, 8 warps, 4 weight tiles in flight), each against
its floor (the FP8 weight, its scales, x and y ÷ the copy bandwidth measured in the same run);
and cuBLAS's bf16 GEMV of the same shape against its own floor (the bf16 weight's bytes). Each
FP8 result is checked against the fp32 product with the dequantised weight first (max error ÷
max |y|, printed). Then the W8A8 prefill
GEMM at --prefill rows: cuBLAS block-scaled (where its probe passes for the shape) and our Triton
kernel, in TFLOP/s. Printed as a table and written to --out as JSON.

--sweep, instead: `read` times a kernel that only reads the weight, in strips of many launch
shapes (what any GEMV reading it so could reach); `stages`, the decode table over the decode
kernel's plans around its rule (splits, strips, weight tiles in flight, both modes: `neighbours`).
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
from pathlib import Path

import torch
import triton
import triton.language as tl
from gpu_timing import add_device, graph_time, row, start

from shardspec.kernels import fp8
from shardspec.layers.fp8 import dequantize

SHAPES = {  # name: (N, K) of the 9B-class projections at TP = 1 (merged as the model runs them)
    "mlp gate_up": (24576, 4096),
    "mlp down": (4096, 12288),
    "gdn in_proj qkvz": (12288, 4096),
    "gdn out_proj": (4096, 4096),
    "attn qkv": (10240, 4096),
    "attn o_proj": (4096, 4096),
}


def variants(M: int, N: int, K: int, sms: int) -> dict[str, fp8.Plan]:
    """The rule's plan in both modes (weight-only: bf16 activations; W8A8: rounded to e4m3 first)
    and the W8A8 kernel's neighbours: what the rule is measured against."""
    w8a8 = fp8.plan(M, N, K, sms, quantize=True)
    other = {
        "w8a8 split ÷ 2": dataclasses.replace(w8a8, split=max(1, w8a8.split // 2)),
        "w8a8 split × 2": dataclasses.replace(w8a8, split=min(32, w8a8.split * 2)),
        "w8a8 strips of 128": dataclasses.replace(w8a8, block_n=128),
        "w8a8 8 warps": dataclasses.replace(w8a8, warps=8),
        f"w8a8 {7 - w8a8.stages} stages": dataclasses.replace(w8a8, stages=7 - w8a8.stages),  # 3 <-> 4
    }
    return {"weight-only": fp8.plan(M, N, K, sms), "w8a8": w8a8,
            **{name: plan for name, plan in other.items() if plan != w8a8}}


def neighbours(M: int, N: int, K: int, sms: int) -> dict[str, fp8.Plan]:
    """--sweep stages: the rule's plans and every mix of half or twice its split, strips of 64 or
    128, 2–4 weight tiles in flight and 4 or 8 warps, in both modes."""
    rule = fp8.plan(M, N, K, sms)
    plans = {"weight-only": rule, "w8a8": fp8.plan(M, N, K, sms, quantize=True)}
    for split in sorted({max(1, rule.split // 2), rule.split, min(32, rule.split * 2)}):
        for block_n, stages, warps, quantize in itertools.product((64, 128), (2, 3, 4), (4, 8), (False, True)):
            plan = dataclasses.replace(rule, split=split, block_n=block_n, stages=stages, warps=warps,
                                       quantize=quantize)
            if plan not in plans.values():
                mode = "w8a8" if quantize else "weight-only"
                plans[f"{mode} split {split}, strips of {block_n}, {stages} stages, {warps} warps"] = plan
    return plans


def operands(N: int, K: int, device: torch.device):
    gen = torch.Generator(device=device).manual_seed(0)
    weight = (torch.randn(N, K, device=device, generator=gen) * 3).clamp(-448, 448).to(torch.float8_e4m3fn)
    scale = torch.rand(-(-N // 128), -(-K // 128), device=device, generator=gen) * 0.01 + 0.001
    return weight, scale


@torch.inference_mode()
def decode(args, device: torch.device, bandwidth: float, out: dict, plans=variants) -> None:
    for name, (N, K) in SHAPES.items():
        decode_shape(name, N, K, args.rows, device, bandwidth, out, plans)
        torch.cuda.empty_cache()


def decode_shape(name: str, N: int, K: int, rows: list[int], device: torch.device, bandwidth: float,
                 out: dict, plans=variants) -> None:
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    weight, scale = operands(N, K, device)
    dense, exact = dequantize(weight, scale, torch.bfloat16), dequantize(weight, scale, torch.float32)
    fp8_bytes = N * K + scale.numel() * 4
    for M in rows:
        x = torch.randn(M, K, device=device, dtype=torch.bfloat16)
        io_bytes = 2 * M * (K + N)
        reference = x.float() @ exact.T
        for label, launch in plans(M, N, K, sms).items():
            y = fp8.decode(x, weight, scale, launch=launch)
            error = ((y.float() - reference).abs().max() / reference.abs().max()).item()
            seconds = graph_time(lambda launch=launch: fp8.decode(x, weight, scale, launch=launch))
            fields = {"shape": name, "N × K": f"{N} × {K}", "rows": M, "kernel": f"fp8 {label}"}
            row(out, fields, seconds, fp8_bytes + io_bytes, bandwidth,
                f"BM {launch.block_m} BN {launch.block_n} split {launch.split} stages {launch.stages} "
                f"warps {launch.warps}, "
                f"error {error:.1e}")
        seconds = graph_time(lambda: torch.nn.functional.linear(x, dense))
        fields = {"shape": name, "N × K": f"{N} × {K}", "rows": M, "kernel": "bf16 cuBLAS"}
        row(out, fields, seconds, 2 * N * K + io_bytes, bandwidth)


@torch.inference_mode()
def prefill(args, device: torch.device, out: dict) -> None:
    print(f"\nW8A8 prefill GEMM at {args.prefill} rows (TFLOP/s)")
    print("| shape | cuBLAS block-scaled | Triton |\n|---|---|---|")
    M = args.prefill
    for name, (N, K) in SHAPES.items():
        weight, scale = operands(N, K, device)
        x = torch.randn(M, K, device=device, dtype=torch.bfloat16)
        cublas = fp8.cublas_layout(weight, scale)
        flops = 2 * M * N * K
        rates = {"triton": flops / graph_time(lambda: fp8.w8a8(x, weight, scale), calls=5) / 1e12}
        if cublas is not None:
            rates["cublas"] = flops / graph_time(lambda: fp8.w8a8(x, weight, scale, cublas), calls=5) / 1e12
        cells = [f"{rates['cublas']:.0f}" if "cublas" in rates else "refused (probe)", f"{rates['triton']:.0f}"]
        print(f"| {name} | " + " | ".join(cells) + " |", flush=True)
        out["prefill"].append({"shape": name, "N": N, "K": K, "rows": M, "tflops": rates})


@triton.jit
def _read_kernel(w_ptr, out_ptr, N, K4, stride_w4, steps_per_split, BN: tl.constexpr, BK4: tl.constexpr):
    """Reads the weight as a GEMV's programs would (BN rows × 4·BK4 bytes a step over a K slice),
    four bytes a value, and keeps their XOR: the read bandwidth of a launch shape, no arithmetic."""
    pid_n, pid_s = tl.program_id(0), tl.program_id(1)
    n = pid_n.to(tl.int64) * BN + tl.arange(0, BN)
    kk = tl.arange(0, BK4)
    acc = tl.zeros([BN, BK4], dtype=tl.int32)
    first = pid_s * steps_per_split
    for step in range(first, tl.minimum(first + steps_per_split, tl.cdiv(K4, BK4))):
        acc ^= tl.load(w_ptr + n[:, None] * stride_w4 + (step * BK4 + kk)[None, :])
    tl.store(out_ptr + pid_s * tl.num_programs(0) + pid_n, tl.reduce_or(acc, axis=None))


def read_only(weight: torch.Tensor, block_n: int, block_k: int, split: int, warps: int) -> torch.Tensor:
    N, K = weight.shape
    words = weight.view(torch.int32)
    steps = K // block_k
    out = torch.empty(split * (N // block_n), dtype=torch.int32, device=weight.device)
    _read_kernel[(N // block_n, split)](words, out, N, K // 4, words.stride(0), -(-steps // split), BN=block_n,
                                       BK4=block_k // 4, num_warps=warps)
    return out


@torch.inference_mode()
def read_sweep(device: torch.device, bandwidth: float, out: dict) -> None:
    """The read bandwidth of launch shapes (rows × bytes a step, warps, programs per SM) on two
    weights: what any kernel that reads the weight this way could reach."""
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    out["read"] = []
    for name in ("mlp gate_up", "attn o_proj"):
        N, K = SHAPES[name]
        weight, _ = operands(N, K, device)
        results = []
        for block_n in (8, 16, 32, 64):
            for block_k in (128, 256, 512, 1024):
                for warps in (1, 2, 4, 8):
                    if not 16 <= block_n * block_k // (32 * warps) <= 256:
                        continue
                    for per_sm in (4, 16, 64):
                        tiles, steps, split = N // block_n, K // block_k, 1
                        while tiles * split < per_sm * sms and steps // (2 * split) >= 1 and split < 64:
                            split *= 2
                        seconds = graph_time(lambda: read_only(weight, block_n, block_k, split, warps))
                        results.append((N * K / bandwidth / seconds, block_n, block_k, warps, split, seconds * 1e6))
                        out["read"].append({"shape": name, "block_n": block_n, "block_k": block_k, "warps": warps,
                                            "split": split, "us": seconds * 1e6})
        results.sort(reverse=True)
        print(f"\nreading {name} ({N} × {K} bytes), best launches: (of floor, rows, bytes a step, warps, split, µs)")
        for result in results[:10]:
            print(f"  {result[0]:.0%} {result[1:5]} {result[5]:.1f}")
        print(f"  worst: {results[-1][0]:.0%} {results[-1][1:5]}")
        torch.cuda.empty_cache()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--prefill", type=int, default=2048)
    parser.add_argument("--out", type=Path, default=Path("fp8-gemm.json"))
    parser.add_argument("--sweep", nargs="+", choices=["read", "stages"], default=[],
                        help="instead of the tables: time launch shapes of reading the weight alone (read), or "
                             "of the weight-only kernel around its rule (stages) (default: neither)")
    add_device(parser)
    args = parser.parse_args()
    device, bandwidth, out = start("fp8_gemm.py", ["shape", "N × K", "rows", "kernel"], after=("plan, error",),
                                   device=args.device)
    fp8.prepare(device)
    out["prefill"] = []
    if args.sweep:
        if "read" in args.sweep:
            read_sweep(device, bandwidth, out)
        if "stages" in args.sweep:
            decode(args, device, bandwidth, out, plans=neighbours)
        args.out.write_text(json.dumps(out, indent=1))
        return
    decode(args, device, bandwidth, out)
    prefill(args, device, out)
    args.out.write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
