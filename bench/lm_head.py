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
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from decode import copy_bandwidth  # noqa: E402

from shardspec.kernels import head  # noqa: E402

VOCAB = 248_320
BLOCKS = [(32, 128), (64, 128), (64, 256), (128, 128)]  # (block_n, block_k)


def graph_time(fn, repeat: int = 20, samples: int = 15) -> float:
    """Median seconds per call of fn, replayed from a CUDA graph of `repeat` calls."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(repeat):
            fn()
    times = []
    for _ in range(samples):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1000 / repeat)
    return statistics.median(times)


def start(script: str, columns: list[str]) -> tuple[torch.device, float, dict]:
    """A GPU micro-benchmark's start: the device, its copy bandwidth (bytes/s, measured now), the
    results dict, and the table's header printed."""
    if not torch.cuda.is_available():
        sys.exit(f"bench/{script} needs a CUDA GPU")
    device = torch.device("cuda")
    bandwidth = copy_bandwidth(device)
    print(f"copy bandwidth {bandwidth / 1e9:.0f} GB/s")
    header = [*columns, "µs", "floor µs", "of floor"]
    print("| " + " | ".join(header) + " |")
    print("|" + "---|" * len(header))
    return device, bandwidth, {"device": torch.cuda.get_device_name(), "bandwidth_GBps": bandwidth / 1e9, "rows": []}


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
                print(f"| {hidden} | {rows} | {way} | {seconds * 1e6:.0f} | {floor * 1e6:.0f} | {floor / seconds:.0%} |",
                      flush=True)
        weight = w8 = scale = None  # (before the next size is allocated)
        torch.cuda.empty_cache()
    args.out.write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
