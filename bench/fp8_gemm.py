"""The FP8 GEMMs at the 9B-class projection shapes on one GPU, against their floor and against bf16.

    python bench/fp8_gemm.py [--rows 1 8 32] [--prefill 2048] [--out fp8-gemm.json]

Per shape and row count, timed inside a CUDA graph: the weight-only decode kernel at the plan its
rule picks (kernels.fp8.plan) and at a few other plans (half the K splits, 128-row weight strips,
and unsplit 16-row strips, the tiles of the kernel it replaced), each against its floor (the FP8 weight, its
scales, x and y ÷ the copy bandwidth measured in the same run); and cuBLAS's bf16 GEMV of the same
shape against its own floor (the bf16 weight's bytes). Each FP8 result is checked against the fp32
product with the dequantised weight first (max error ÷ max |y|, printed). Then the W8A8 prefill
GEMM at --prefill rows: cuBLAS block-scaled (where its probe passes for the shape) and our Triton
kernel, in TFLOP/s. Printed as a table and written to --out as JSON.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path

import torch
from gpu_timing import graph_time, row, start

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


def variants(rule: fp8.Plan) -> dict[str, fp8.Plan]:
    """The rule's plan and its neighbours: what the rule is measured against."""
    other = {
        "split ÷ 2": dataclasses.replace(rule, split=max(1, rule.split // 2)),
        "strips of 128": dataclasses.replace(rule, block_n=128),
        "unsplit, strips of 16": fp8.Plan(16, 16, 1),  # the tiles of the kernel this one replaced
    }
    return {"rule": rule, **{name: plan for name, plan in other.items() if plan != rule}}


def operands(N: int, K: int, device: torch.device):
    gen = torch.Generator(device=device).manual_seed(0)
    weight = (torch.randn(N, K, device=device, generator=gen) * 3).clamp(-448, 448).to(torch.float8_e4m3fn)
    scale = torch.rand(-(-N // 128), -(-K // 128), device=device, generator=gen) * 0.01 + 0.001
    return weight, scale


@torch.inference_mode()
def decode(args, device: torch.device, bandwidth: float, out: dict) -> None:
    for name, (N, K) in SHAPES.items():
        decode_shape(name, N, K, args.rows, device, bandwidth, out)
        torch.cuda.empty_cache()


def decode_shape(name: str, N: int, K: int, rows: list[int], device: torch.device, bandwidth: float,
                 out: dict) -> None:
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    weight, scale = operands(N, K, device)
    dense, exact = dequantize(weight, scale, torch.bfloat16), dequantize(weight, scale, torch.float32)
    fp8_bytes = N * K + scale.numel() * 4
    for M in rows:
        x = torch.randn(M, K, device=device, dtype=torch.bfloat16)
        io_bytes = 2 * M * (K + N)
        reference = x.float() @ exact.T
        for label, launch in variants(fp8.plan(M, N, K, sms)).items():
            y = fp8.weight_only(x, weight, scale, launch=launch)
            error = ((y.float() - reference).abs().max() / reference.abs().max()).item()
            seconds = graph_time(lambda launch=launch: fp8.weight_only(x, weight, scale, launch=launch))
            fields = {"shape": name, "N × K": f"{N} × {K}", "rows": M, "kernel": f"fp8 {label}"}
            row(out, fields, seconds, fp8_bytes + io_bytes, bandwidth,
                f"BM {launch.block_m} BN {launch.block_n} split {launch.split}, error {error:.1e}")
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--prefill", type=int, default=2048)
    parser.add_argument("--out", type=Path, default=Path("fp8-gemm.json"))
    args = parser.parse_args()
    device, bandwidth, out = start("fp8_gemm.py", ["shape", "N × K", "rows", "kernel"], after=("plan, error",))
    fp8.prepare(device)
    out["prefill"] = []
    decode(args, device, bandwidth, out)
    prefill(args, device, out)
    args.out.write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
