"""What the GPU benchmarks share: synchronising, the copy bandwidth their floors divide by, and
timing a function inside a CUDA graph."""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable

import torch


def sync(device: torch.device | str) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def copy_bandwidth(device: torch.device, nbytes: int = 2 << 30) -> float:
    """Bytes per second moved (read + written) by a device-to-device copy, timed with CUDA events:
    the best of 20, after 10 to warm the clocks up (the floor is what the device can do, so the
    best, not the median). On the CPU, a wall-clock copy (no floor is quoted from it)."""
    src = torch.empty(nbytes // 2, dtype=torch.bfloat16, device=device).normal_()
    dst = torch.empty_like(src)
    times = []
    for i in range(30):
        if torch.device(device).type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            dst.copy_(src)
            end.record()
            end.synchronize()
            seconds = start.elapsed_time(end) / 1000
        else:
            started = time.perf_counter()
            dst.copy_(src)
            seconds = time.perf_counter() - started
        if i >= 10:
            times.append(seconds)
    return 2 * src.nbytes / min(times)


def graph_time(fn: Callable[[], object], calls: int = 20, samples: int = 15,
               before: Callable[[], object] = lambda: None) -> float:
    """Median seconds per call of fn, captured `calls` times back to back in one CUDA graph (warmed
    up outside the capture first); `before` runs ahead of the timed replays (a barrier between
    processes, say)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    graph.replay()
    torch.cuda.synchronize()
    before()
    times = []
    for _ in range(samples):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1000 / calls)
    return statistics.median(times)


def add_device(parser: argparse.ArgumentParser) -> None:
    """--device of a GPU micro-benchmark: the GPU it runs on."""
    parser.add_argument("--device", default="cuda", help="the GPU to run on: cuda or cuda:N (default cuda)")


def start(script: str, columns: list[str], after: tuple[str, ...] = (), device: str = "cuda"
          ) -> tuple[torch.device, float, dict]:
    """A GPU micro-benchmark's start on `device` (add_device): the device, its copy bandwidth (bytes/s,
    measured now), the results dict, and the table's header printed (`after`: columns after the floor's)."""
    if not torch.cuda.is_available() or torch.device(device).type != "cuda":
        sys.exit(f"bench/{script} needs a CUDA GPU (--device cuda or cuda:N), got --device {device}")
    device = torch.device(device)
    torch.cuda.set_device(device)  # (Triton launches on the current device)
    bandwidth = copy_bandwidth(device)
    print(f"copy bandwidth {bandwidth / 1e9:.0f} GB/s")
    header = [*columns, "µs", "floor µs", "of floor", *after]
    print("| " + " | ".join(header) + " |")
    print("|" + "---|" * len(header))
    return device, bandwidth, {"device": torch.cuda.get_device_name(), "bandwidth_GBps": bandwidth / 1e9, "rows": []}


def row(out: dict, fields: dict, seconds: float, floor_bytes: float, bandwidth: float, note: str = "") -> None:
    """One row of the table `start` began: the fields, µs per call, the floor's µs (floor_bytes at
    `bandwidth`), the fraction of the floor and a note; printed, and appended to out["rows"]."""
    floor = floor_bytes / bandwidth
    cells = [*map(str, fields.values()), f"{seconds * 1e6:.1f}", f"{floor * 1e6:.1f}", f"{floor / seconds:.0%}", note]
    print("| " + " | ".join(cells) + " |", flush=True)
    out["rows"].append({**fields, "us": seconds * 1e6, "floor_us": floor * 1e6, "of_floor": floor / seconds,
                        "note": note})
