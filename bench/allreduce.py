"""All-reduce latency between the GPUs of one host, as a decode step sees it: inside a CUDA graph.

    python bench/allreduce.py [--gpus 2] [--hidden 4096 5120] [--rows 1 8 32] [--calls 100]

One process per GPU. For each shape (rows × hidden, bf16: the partial sums a row-parallel layer
reduces) it captures `calls` back-to-back all-reduces in one graph and prints the microseconds per
all-reduce, for NCCL and for the symmetric-memory one-shot kernel (--allreduce symm), and
the peer-to-peer copy bandwidth. A Qwen3.5 decode step makes 2 all-reduces per layer plus one for
the vocabulary-parallel embedding, so this times the collectives' share of a TP step.

Every all-reduce of a layer feeds the residual add and RMSNorm, so it also times what a step runs:
NCCL then the add + norm kernel, the one-shot kernel then the add + norm, and the one kernel that
does all three (kernels.norm.all_reduce_rms_norm, the --allreduce symm path).
"""

from __future__ import annotations

import argparse
import json

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from gpu_timing import graph_time

from shardspec.kernels.norm import rms_norm
from shardspec.layers.parallel import SymmetricReducer
from shardspec.orchestrator.workers import free_port


def run(rank: int, args: argparse.Namespace, address: str) -> None:
    device = torch.device("cuda", rank)
    torch.cuda.set_device(device)
    dist.init_process_group("nccl", init_method=address, rank=rank, world_size=args.gpus, device_id=device)
    reducer = SymmetricReducer(None)
    results = []
    for hidden in args.hidden:
        for rows in args.rows:
            x = torch.full((rows, hidden), float(rank + 1), dtype=torch.bfloat16, device=device)
            expected = args.gpus * (args.gpus + 1) / 2
            check = x.clone()
            dist.all_reduce(check)
            assert torch.all(check == expected) and torch.all(reducer(x) == expected), "wrong sum"
            residual, weight = torch.full_like(x, 0.5), torch.zeros(hidden, dtype=x.dtype, device=device)
            assert torch.all(reducer.rms_norm(x, residual, weight, 1e-6)[1] == expected + 0.5), "wrong fused sum"
            x.fill_(1e-3)  # NCCL's in-place sums overflow to inf after ~130 calls: the timing does not care
            nccl = graph_time(lambda x=x: dist.all_reduce(x), args.calls, before=dist.barrier)
            symm = graph_time(lambda x=x: reducer(x), args.calls, before=dist.barrier)
            nccl_norm = graph_time(lambda x=x: rms_norm(dist.all_reduce(x) or x, weight, 1e-6, residual), args.calls,
                                   before=dist.barrier)
            symm_norm = graph_time(lambda x=x: rms_norm(reducer(x), weight, 1e-6, residual), args.calls,
                                   before=dist.barrier)
            fused = graph_time(lambda x=x: reducer.rms_norm(x, residual, weight, 1e-6), args.calls, before=dist.barrier)
            results.append({"hidden": hidden, "rows": rows, "bytes": x.nbytes,
                            "nccl_us": 1e6 * nccl, "symm_us": 1e6 * symm, "nccl_norm_us": 1e6 * nccl_norm,
                            "symm_norm_us": 1e6 * symm_norm, "fused_norm_us": 1e6 * fused})
            if rank == 0:
                print(f"{rows:>3} × {hidden} bf16 ({x.nbytes / 1024:.0f} KiB): NCCL {1e6 * nccl:6.1f} µs, "
                      f"symm one-shot {1e6 * symm:6.1f} µs per all-reduce; with the add + norm: NCCL "
                      f"{1e6 * nccl_norm:6.1f}, one-shot {1e6 * symm_norm:6.1f}, fused {1e6 * fused:6.1f} µs",
                      flush=True)
    if rank == 0:  # peer-to-peer copy bandwidth, GPU 0 -> GPU 1
        src = torch.empty(1 << 30, dtype=torch.uint8, device=device)
        dst = torch.empty(1 << 30, dtype=torch.uint8, device=torch.device("cuda", 1))
        dst.copy_(src)
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(5):
            dst.copy_(src)
        end.record()
        torch.cuda.synchronize()
        p2p = 5 * src.nbytes / (start.elapsed_time(end) / 1000) / 1e9
        print(f"peer-to-peer copy GPU 0 -> 1: {p2p:.0f} GB/s", flush=True)
        if args.out:
            with open(args.out, "w") as f:
                json.dump({"gpus": args.gpus, "p2p_GBps": p2p, "allreduce": results}, f, indent=1)
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gpus", type=int, default=2)
    parser.add_argument("--hidden", type=int, nargs="+", default=[4096, 5120])
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--calls", type=int, default=100, help="all-reduces captured in one graph")
    parser.add_argument("--out", default=None, help="write the figures as JSON here")
    args = parser.parse_args()
    if torch.cuda.device_count() < args.gpus:
        raise SystemExit(f"allreduce.py: needs {args.gpus} GPUs, this machine has {torch.cuda.device_count()}")
    address = f"tcp://127.0.0.1:{free_port()}"  # the rendezvous
    mp.spawn(run, args=(args, address), nprocs=args.gpus)


if __name__ == "__main__":
    main()
