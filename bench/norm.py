"""The residual add + RMSNorm kernel (kernels.norm.rms_norm) at the 9B-class hidden size on one
GPU, at several warp counts, against its floor and against the PyTorch ops it replaces.

    python bench/norm.py [--rows 1 4 8 16 32] [--hidden 4096] [--out norm.json] [--device cuda:N]

Per row count, timed inside a CUDA graph (µs per call): norm(x + residual) · (1 + w) and
x + residual, as a decoder layer calls it between two projections. The floor: x, the residual and
the weight read, the two outputs written, ÷ the copy bandwidth measured in the same run. A call of
this size is latency, not bytes: the table says what one launch costs at each warp count (the
current rule is kernels.norm.warps).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from gpu_timing import add_device, graph_time, row, start

from shardspec.kernels import norm

WARPS = [1, 2, 4, 8, 16]


def eager(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float):
    total = x + residual
    xf = total.float()
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * (1.0 + weight.float())
    return y.to(x.dtype), total


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 4, 8, 16, 32],
                        help="rows per call (default: 1 4 8 16 32)")
    parser.add_argument("--hidden", type=int, default=4096, help="the row width (default: 4096, the 9B's)")
    parser.add_argument("--out", type=Path, default=Path("norm.json"), help="the results as JSON (default norm.json)")
    add_device(parser)
    args = parser.parse_args()
    device, bandwidth, out = start("norm.py", ["rows", "kernel"], after=("error",), device=args.device)
    D, eps = args.hidden, 1e-6
    gen = torch.Generator(device=device).manual_seed(0)
    weight = torch.randn(D, device=device, generator=gen) * 0.1
    for M in args.rows:
        x, residual = (torch.randn(M, D, device=device, generator=gen, dtype=torch.bfloat16) for _ in range(2))
        floor_bytes = 2 * 4 * M * D + 4 * D
        reference, _ = eager(x, residual, weight, eps)
        row(out, {"rows": M, "kernel": "PyTorch ops"}, graph_time(lambda: eager(x, residual, weight, eps)),
            floor_bytes, bandwidth)
        for warps in WARPS:
            y, _ = norm.rms_norm(x, weight, eps, residual, num_warps=warps)
            err = ((y.float() - reference.float()).abs().max() / reference.float().abs().max()).item()
            label = f"kernel, {warps} warps" + (" (the rule)" if warps == norm.warps(D) else "")
            row(out, {"rows": M, "kernel": label},
                graph_time(lambda warps=warps: norm.rms_norm(x, weight, eps, residual, num_warps=warps)),
                floor_bytes, bandwidth, f"{err:.1e}")
    args.out.write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
