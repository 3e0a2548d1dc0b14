"""Where the GPU waits: the device gaps in the traces of workers profiled in one run.

    SHARDSPEC_PROFILE=DIR python bench/decode.py ...         # every worker writes DIR/worker-<pid>-<n>.json.gz
    python bench/trace_gaps.py DIR/worker-*-1.json.gz [--gap-us 5] [--top 12]

For each trace: the window, its steps (the worker's `step` marks), the device's busy time (the union
of its kernels and copies) and the host's marks (`step`, `link wait`, `link send`, `reply`) a step.
Then all traces together, on the host clock they share: the time no device work of any of them ran,
the gaps of at least --gap-us, and the largest gaps with what each worker's host was in at their
middle (its innermost mark, or the CUDA runtime call it was in), which is what the device waited for.
"""

from __future__ import annotations

import argparse
import gzip
import itertools
import json
import statistics
from dataclasses import dataclass, field
from pathlib import Path

MARKS = ("step", "link wait", "link send", "reply")
DEVICE_CATEGORIES = ("kernel", "gpu_memcpy", "gpu_memset")


@dataclass
class Trace:
    name: str
    device: list[tuple[float, float]]  # merged busy intervals (µs, host clock)
    marks: dict[str, list[tuple[float, float]]]
    runtime: list[tuple[float, float, str]]  # CUDA runtime calls (start, end, name)
    spans: list[tuple[float, float, str]] = field(default_factory=list)  # marks and runtime calls, by start

    def inside(self, t: float) -> str:
        """The innermost mark or runtime call that holds host time t ('-' for none)."""
        best = None
        for start, end, name in self.spans:
            if start > t:
                break
            if end >= t and (best is None or start >= best[0]):
                best = (start, end, name)
        return best[2] if best else "-"


def merge(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    out: list[list[float]] = []
    for start, end in sorted(intervals):
        if out and start <= out[-1][1]:
            out[-1][1] = max(out[-1][1], end)
        else:
            out.append([start, end])
    return [(a, b) for a, b in out]


def load(path: Path) -> Trace:
    with gzip.open(path) if path.suffix == ".gz" else path.open() as f:
        data = json.load(f)
    base = data.get("baseTimeNanoseconds", 0) / 1000
    device, runtime, marks = [], [], {m: [] for m in MARKS}
    for e in data["traceEvents"]:
        if e.get("ph") != "X":
            continue
        start = e["ts"] + base
        end = start + e.get("dur", 0)
        cat = e.get("cat", "")
        if cat in DEVICE_CATEGORIES:
            device.append((start, end))
        elif cat == "cuda_runtime":
            runtime.append((start, end, e["name"]))
        elif cat == "user_annotation" and e["name"] in MARKS:
            marks[e["name"]].append((start, end))
    trace = Trace(path.name.split(".")[0], merge(device), marks, runtime)
    trace.spans = sorted([(a, b, n) for n, spans in marks.items() for a, b in spans] + runtime)
    return trace


def busy_within(intervals: list[tuple[float, float]], start: float, end: float) -> float:
    return sum(max(0.0, min(b, end) - max(a, start)) for a, b in intervals)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("traces", type=Path, nargs="+")
    parser.add_argument("--gap-us", type=float, default=5.0, help="the shortest gap counted (µs; default 5)")
    parser.add_argument("--top", type=int, default=12, help="the largest gaps listed (default 12)")
    args = parser.parse_args()
    traces = [load(p) for p in args.traces]
    for t in traces:
        steps = t.marks["step"]
        if not steps:
            print(f"{t.name}: no step marks")
            continue
        start, end = steps[0][0], steps[-1][1]
        n = len(steps)
        busy = busy_within(t.device, start, end)
        figures = ", ".join(f"{m} {statistics.median(b - a for a, b in t.marks[m]):.0f} µs x {len(t.marks[m]) / n:.1f}"
                            for m in MARKS if t.marks[m])
        print(f"{t.name}: {n} steps, {(end - start) / n:.0f} µs a step, device busy {busy / n:.0f} µs a step "
              f"({100 * busy / (end - start):.0f} %); medians: {figures}")
    window = (max(t.marks["step"][0][0] for t in traces if t.marks["step"]),
              min(t.marks["step"][-1][1] for t in traces if t.marks["step"]))
    union = merge([iv for t in traces for iv in t.device])
    span = window[1] - window[0]
    busy = busy_within(union, *window)
    gaps = [(max(a, window[0]), min(b, window[1])) for (_, a), (b, _) in itertools.pairwise(union)]
    gaps = [(a, b) for a, b in gaps if b - a >= args.gap_us]
    print(f"\nall {len(traces)} together: {span / 1000:.2f} ms window, device busy {100 * busy / span:.1f} %; "
          f"{len(gaps)} gaps of >= {args.gap_us:g} µs, {sum(b - a for a, b in gaps) / 1000:.2f} ms in all")
    sizes = sorted(b - a for a, b in gaps)
    if sizes:
        print(f"gap sizes (µs): median {statistics.median(sizes):.0f}, p90 {sizes[int(0.9 * (len(sizes) - 1))]:.0f}, "
              f"max {sizes[-1]:.0f}")
    by_cause: dict[str, float] = {}
    for a, b in gaps:
        cause = " | ".join(f"{t.name}: {t.inside((a + b) / 2)}" for t in traces)
        by_cause[cause] = by_cause.get(cause, 0.0) + b - a
    print("\ngap time by what the hosts were in at the gap's middle:")
    for cause, total in sorted(by_cause.items(), key=lambda kv: -kv[1])[: args.top]:
        print(f"  {total / 1000:7.3f} ms  {cause}")
    print(f"\nthe {args.top} largest gaps:")
    for a, b in sorted(gaps, key=lambda g: g[0] - g[1])[: args.top]:
        cause = " | ".join(f"{t.name}: {t.inside((a + b) / 2)}" for t in traces)
        print(f"  {b - a:7.0f} µs at +{(a - window[0]) / 1000:8.3f} ms  {cause}")


if __name__ == "__main__":
    main()
