"""The routed experts of one 35B-A3B MoE layer on one GPU: the grouped GEMM and the fused kernels.

    python bench/moe_kernels.py [--tokens 1 2 4 8 16 32] [--sweep] [--out moe-kernels.json] [--device cuda:N]

Hidden 2048, 256 experts, top 8, width 512, bf16. For each token count, the experts' part of the
block (layers.moe: routing excluded, the grouped backend's sorting included) timed inside a CUDA
graph, against its floor: the bytes of the distinct experts hit, x and out ÷ the copy bandwidth
measured in the same run. Each captured call takes its own tokens and routes (20 of them, random),
so one call's experts are not in L2 from the call before. --sweep adds the fused kernels at other
tile sizes, warps and stages (kernels.moe.Blocks), one kernel's at a time, next to the default. The
fused result is checked against the grouped one first (max difference ÷ max |out|, printed).
Printed as a markdown table, written to --out as JSON.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from itertools import cycle
from pathlib import Path

import torch
from gpu_timing import add_device, graph_time, row, start

from shardspec.kernels import moe as kernel_moe
from shardspec.layers.moe import EXPERT_BACKENDS, Experts, route
from shardspec.layers.parallel import TPGroup

HIDDEN, EXPERTS, TOP_K, WIDTH = 2048, 256, 8, 512
CALLS = 20  # calls per graph, each on its own inputs

def sweep() -> dict[str, dict]:
    """Tile sizes around the default, one kernel at a time (the other keeps its default): gate/up
    columns a program × step along H, down columns × step along the width, warps, stages."""
    gate_up = {f"gate_up {i} × {k}, {warps}w, {stages}s": dict(gate_up_i=i, gate_up_k=k, gate_up_warps=warps,
                                                               gate_up_stages=stages)
               for i in (8, 16, 32) for k in (256, 512, 1024) for warps in (4, 8) for stages in (3, 4)}
    down = {f"down {h} × {i}, {warps}w": dict(down_h=h, down_i=i, down_warps=warps)
            for h in (2, 4, 8) for i in (128, 256, 512) for warps in (4, 8)}  # (3 or 4 stages: within 1 %)
    return gate_up | down


def inputs(N: int, device: torch.device) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    gen = torch.Generator(device=device).manual_seed(N)
    out = []
    for _ in range(CALLS):
        x = torch.randn(N, HIDDEN, device=device, generator=gen).bfloat16()
        weights, ids = route(torch.randn(N, EXPERTS, device=device, generator=gen).bfloat16(), TOP_K)
        out.append((x, weights, ids))
    return out


def timed(experts: Experts, backend: str, calls: list, blocks: kernel_moe.Blocks | None = None) -> float:
    """Seconds per call, each of the graph's calls on the next of `calls`."""
    feed = cycle(calls)

    def one() -> torch.Tensor:
        x, weights, ids = next(feed)
        if blocks is not None:
            return kernel_moe.experts(x, weights, ids, experts.gate_up_proj, experts.down_proj, blocks=blocks)
        return EXPERT_BACKENDS[backend](experts, x, weights, ids)

    return graph_time(one, calls=CALLS)


@torch.inference_mode()
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32],
                        help="tokens per call, each routed to the top 8 of 256 experts (default: 1 2 4 8 16 32)")
    parser.add_argument("--sweep", action="store_true",
                        help="also the fused kernels at other tiles, warps and stages, one kernel's at a time")
    parser.add_argument("--out", type=Path, default=Path("moe-kernels.json"),
                        help="the results as JSON (default moe-kernels.json)")
    add_device(parser)
    args = parser.parse_args()
    device, bandwidth, out = start("moe_kernels.py", ["tokens", "rows", "experts hit", "backend"],
                                   after=("tiles, difference",), device=args.device)
    experts = Experts(EXPERTS, HIDDEN, WIDTH, TPGroup()).to(device)
    experts.gate_up_proj.data.normal_(0, HIDDEN ** -0.5)
    experts.down_proj.data.normal_(0, WIDTH ** -0.5)
    experts = experts.bfloat16()
    expert_bytes = (experts.gate_up_proj[0].numel() + experts.down_proj[0].numel()) * 2
    variants = {"fused": kernel_moe.BLOCKS}
    if args.sweep:
        others = {f"fused {name}": dataclasses.replace(kernel_moe.BLOCKS, **change) for name, change in sweep().items()}
        variants |= {name: blocks for name, blocks in others.items() if blocks != kernel_moe.BLOCKS}
    for N in args.tokens:
        calls = inputs(N, device)
        hit = sum(ids.unique().numel() for _, _, ids in calls) / len(calls)
        floor_bytes = hit * expert_bytes + 2 * 2 * N * HIDDEN
        x, weights, ids = calls[0]
        grouped = EXPERT_BACKENDS["grouped"](experts, x, weights, ids).float()
        scale = grouped.abs().max().item()
        fields = {"tokens": N, "rows": N * TOP_K, "experts hit": f"{hit:.1f}"}
        row(out, {**fields, "backend": "grouped"}, timed(experts, "grouped", calls), floor_bytes, bandwidth)
        for name, blocks in variants.items():
            fused = kernel_moe.experts(x, weights, ids, experts.gate_up_proj, experts.down_proj, blocks=blocks).float()
            difference = (fused - grouped).abs().max().item() / scale
            tiles = f"gate_up {blocks.gate_up_i} × {blocks.gate_up_k} / {blocks.gate_up_warps}w " \
                    f"{blocks.gate_up_stages}s, down {blocks.down_h} × {blocks.down_i} / {blocks.down_warps}w " \
                    f"{blocks.down_stages}s"
            row(out, {**fields, "backend": name}, timed(experts, "fused", calls, blocks), floor_bytes, bandwidth,
                f"{tiles}, difference {difference:.1e}")
    args.out.write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
