"""Collective latency between the CPU ranks of one host, as a decode or verify step sees it: shared
memory (layers.shm, the default where a TP group's ranks share a host) against Gloo over loopback.

    python bench/cpu_collectives.py [--ranks 2] [--hidden 384 4096] [--rows 1 4 8 32] [--calls 200]

One process per rank, one thread each, as local workers run. For each shape (rows × hidden: the
partial sums a row-parallel layer reduces; bfloat16 and float32) it times `calls` back-to-back
all-reduces and all-gathers and prints the microseconds per collective, the median of 5 rounds. A
Qwen3.5 decode step makes 2 all-reduces per layer, one for the vocabulary-parallel embedding and
an all-gather in the LM head; a verify step's rows are k + 1 per sequence.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from shardspec.layers.shm import ShmCollectives
from shardspec.orchestrator.workers import free_port

ROUNDS = 5


def per_call_us(fn, calls: int) -> float:
    fn()  # warm-up
    rounds = []
    for _ in range(ROUNDS):
        dist.barrier()
        started = time.perf_counter()
        for _ in range(calls):
            fn()
        rounds.append((time.perf_counter() - started) / calls * 1e6)
    return statistics.median(rounds)


def run(rank: int, args: argparse.Namespace, address: str, out: dict) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=address, rank=rank, world_size=args.ranks)
    shm = ShmCollectives.join(rank, args.ranks, None, timeout_s=60.0)
    assert shm is not None, "shared memory could not be set up"
    rows_out = []
    for dtype in (torch.bfloat16, torch.float32):
        for hidden in args.hidden:
            for rows in args.rows:
                x = torch.full((rows, hidden), float(rank + 1), dtype=dtype)
                row = {"dtype": str(dtype).removeprefix("torch."), "rows": rows, "hidden": hidden}
                row["shm_all_reduce_us"] = per_call_us(lambda: shm.all_reduce(x.fill_(rank + 1)), args.calls)
                assert float(x[0, 0]) == args.ranks * (args.ranks + 1) / 2
                row["gloo_all_reduce_us"] = per_call_us(lambda: dist.all_reduce(x.fill_(rank + 1)), args.calls)
                row["shm_all_gather_us"] = per_call_us(lambda: shm.all_gather(x, dim=-1), args.calls)
                parts = [torch.empty_like(x) for _ in range(args.ranks)]
                row["gloo_all_gather_us"] = per_call_us(lambda: dist.all_gather(parts, x), args.calls)
                rows_out.append(row)
    if rank == 0:
        out["rows"] = rows_out
    shm.close()
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--hidden", type=int, nargs="+", default=[384, 4096])
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 4, 8, 32])
    parser.add_argument("--calls", type=int, default=200, help="collectives per timed round")
    parser.add_argument("--out", default=None, help="write the figures as JSON here")
    args = parser.parse_args()
    address = f"tcp://127.0.0.1:{free_port()}"
    with mp.Manager() as manager:
        out = manager.dict()
        mp.spawn(run, args=(args, address, out), nprocs=args.ranks)
        rows = out["rows"]
    print("| dtype | rows × hidden | all-reduce shm µs | Gloo µs | ratio | all-gather shm µs | Gloo µs | ratio |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['dtype']} | {r['rows']} × {r['hidden']} | {r['shm_all_reduce_us']:.1f} | "
              f"{r['gloo_all_reduce_us']:.1f} | {r['gloo_all_reduce_us'] / r['shm_all_reduce_us']:.1f}× | "
              f"{r['shm_all_gather_us']:.1f} | {r['gloo_all_gather_us']:.1f} | "
              f"{r['gloo_all_gather_us'] / r['shm_all_gather_us']:.1f}× |")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"ranks": args.ranks, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
