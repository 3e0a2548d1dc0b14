"""What a hand-off costs on this machine: a CUDA graph's launch, and a message between two processes.

    python bench/host_latency.py [--nodes 50 200 400 800] [--bytes 16384] [--out results.json] [--device cuda:N]

1. Graph launch. Graphs of N small kernels, replayed: the host time of `replay()`; whether the
   device starts the graph before the call returns (a graph opening with a 1 ms sleep kernel ends
   1 ms + the kernels after the call began if it does, 1 ms + the launch if it does not); and the
   same N kernels as S graphs replayed one after the other (the device runs the first while the
   host launches the rest).
2. Messages. Two processes on ZeroMQ PUSH/PULL over ipc:// bounce a message of --bytes back and
   forth: the round trip with the receiver blocked in poll, and with it spinning on poll(0).
Best and median of many tries each; the figures are host wall time.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import statistics
import tempfile
import time
from pathlib import Path

import torch

TRIES = 200


def graph_of(n: int, x: torch.Tensor, sleep_cycles: int = 0) -> torch.cuda.CUDAGraph:
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        x.add_(1)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        if sleep_cycles:
            torch.cuda._sleep(sleep_cycles)
        for _ in range(n):
            x.add_(1)
    return graph


def timed(fn, tries: int = TRIES) -> tuple[float, float]:
    """(best, median) µs of fn() followed by a device sync; fn returns the host µs it wants counted
    or None for the whole call."""
    times = []
    for _ in range(tries):
        torch.cuda.synchronize()
        started = time.perf_counter()
        inner = fn()
        torch.cuda.synchronize()
        times.append(inner if inner is not None else 1e6 * (time.perf_counter() - started))
    return min(times), statistics.median(times)


def cycles_per_ms() -> int:
    """torch.cuda._sleep's cycles in one millisecond on this device (timed)."""
    torch.cuda._sleep(1_000_000)
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    torch.cuda._sleep(10_000_000)
    end.record()
    torch.cuda.synchronize()
    return int(10_000_000 / start.elapsed_time(end))


def graph_launches(nodes: list[int]) -> list[dict]:
    x = torch.zeros(1024, device=torch.cuda.current_device())
    per_ms = cycles_per_ms()
    rows = []
    for n in nodes:
        graph, slept = graph_of(n, x), graph_of(n, x, sleep_cycles=per_ms)
        sleep_only = graph_of(0, x, sleep_cycles=per_ms)
        for g in (graph, slept, sleep_only):
            g.replay()
        torch.cuda.synchronize()

        def launch_only(g=graph):
            started = time.perf_counter()
            g.replay()
            return 1e6 * (time.perf_counter() - started)

        launch = timed(launch_only)
        whole = timed(graph.replay)
        with_sleep = timed(slept.replay)
        sleep_alone = timed(sleep_only.replay)
        row = {"nodes": n, "launch_us": launch, "replay_and_sync_us": whole, "with_1ms_sleep_us": with_sleep,
               "sleep_alone_us": sleep_alone}
        # the same kernels as 4 graphs: the device runs the first while the host launches the others
        parts = [graph_of(n // 4, x) for _ in range(4)]

        def in_parts():
            for g in parts:
                g.replay()

        in_parts()
        row["four_parts_replay_and_sync_us"] = timed(in_parts)
        rows.append(row)
        print(f"{n} nodes: launch {launch[1]:.0f} µs (best {launch[0]:.0f}); replay + sync {whole[1]:.0f}; "
              f"as 4 graphs {row['four_parts_replay_and_sync_us'][1]:.0f}; opening with a 1 ms sleep "
              f"{with_sleep[1]:.0f} against the sleep alone {sleep_alone[1]:.0f} (the excess: what of the "
              "launch the device waited for, and the kernels)", flush=True)
    return rows


def _echo(address_in: str, address_out: str, spin: bool, count: int) -> None:
    import zmq

    ctx = zmq.Context()
    inbox, outbox = ctx.socket(zmq.PULL), ctx.socket(zmq.PUSH)
    inbox.bind(address_in)
    outbox.connect(address_out)
    for _ in range(count):
        if spin:
            while not inbox.poll(0):
                pass
        else:
            inbox.poll(10_000)
        outbox.send_multipart(inbox.recv_multipart(copy=False), copy=False)
    inbox.close(linger=1000)
    outbox.close(linger=1000)
    ctx.term()


def messages(size: int) -> dict:
    import zmq

    out = {}
    folder = tempfile.mkdtemp(prefix="shardspec-latency-")
    payload = os.urandom(size)
    for spin in (False, True):
        a, b = f"ipc://{folder}/a-{spin}", f"ipc://{folder}/b-{spin}"
        count = 2000
        echo = mp.get_context("spawn").Process(target=_echo, args=(a, b, spin, count))
        echo.start()
        ctx = zmq.Context()
        inbox, outbox = ctx.socket(zmq.PULL), ctx.socket(zmq.PUSH)
        inbox.bind(b)
        outbox.connect(a)
        times = []
        for i in range(count):
            started = time.perf_counter()
            outbox.send_multipart([b"header", payload], copy=False)
            if spin:
                while not inbox.poll(0):
                    pass
            else:
                inbox.poll(10_000)
            inbox.recv_multipart()
            if i >= 100:
                times.append(1e6 * (time.perf_counter() - started))
        echo.join(10)
        inbox.close(linger=0)
        outbox.close(linger=0)
        ctx.term()
        key = "spinning" if spin else "blocking"
        out[key] = {"best_us": min(times), "median_us": statistics.median(times),
                    "p90_us": sorted(times)[int(0.9 * len(times))]}
        print(f"round trip of {size} bytes over ipc://, both receivers {key}: median {out[key]['median_us']:.0f} µs "
              f"(best {out[key]['best_us']:.0f}, p90 {out[key]['p90_us']:.0f})", flush=True)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nodes", type=int, nargs="+", default=[50, 200, 400, 800])
    parser.add_argument("--bytes", type=int, default=16384)
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                        help="the GPU whose graph launches are timed, cuda or cuda:N (default cuda where there is "
                             "one); cpu: the messages alone")
    args = parser.parse_args()
    result = {"messages": messages(args.bytes)}
    if torch.device(args.device).type == "cuda":
        torch.cuda.set_device(torch.device(args.device))
        result["graphs"] = graph_launches(args.nodes)
    if args.out:
        args.out.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
