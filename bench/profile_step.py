"""Profile one rank's decode and verify steps in-process (no workers, no wire), by section.

    python bench/profile_step.py [--size 9b] [--batch 1] [--k 0 1 3] [--forced 0.8] [--tp 1] [--prefill 2048]

Builds the model with random weights directly on the device (no checkpoint on disk), runs the
the decoder's steps, and prints for each k the mean step time, PyTorch's profiler table of the
most expensive operators, and where the step's device time goes by part (matmuls, Gated DeltaNet,
attention, norms, ...) against each part's floor: the bytes it must move
(shardspec.testing.step_bytes) ÷ the copy bandwidth. The runner launches each step's pass ahead,
behind the step before, as a worker does on a GPU (decoder.py; --launch-ahead off: the peer). The
workers' options are `shardspec generate`'s flags (--allreduce, --no-fused-norm, --launch-ahead, ...),
set in each rank's process as a worker sets them from its init request. With
--tp N it starts N processes, one per GPU, in one NCCL group (each holding its own random shard);
rank 0 prints, with the all-reduce kernels of both ranks side by side: how long each ran, and how
far apart the ranks arrived. With
--prefill it also times prefills of those prompt lengths and profiles the last; with --cached-turn, the
step of a turn whose conversation is cached (bench/prefix_cache.py's case, on the worker alone).
"""

from __future__ import annotations

import argparse
import cProfile
import dataclasses
import io
import pstats
import statistics
import time
from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from gpu_timing import copy_bandwidth, sync

from shardspec import kernels
from shardspec.layers.parallel import TPGroup, use_symmetric_memory
from shardspec.models.qwen3_5 import Qwen3_5Config, Qwen3_5Model, Qwen3_5MoeConfig
from shardspec.option_flags import add_flags, from_flags
from shardspec.orchestrator.workers import free_port
from shardspec.protocol.messages import PrefillSpec, SamplingParams, SaveAt, StepRequest, WorkerOptions
from shardspec.shard_worker.decoder import Decoder
from shardspec.testing.grants import Grants
from shardspec.testing.sizes import SIZES
from shardspec.testing.step_bytes import StepBytes, step_bytes

# a step's parts: the first whose name fragment a kernel's name holds (lower case) takes its time
PARTS = {
    "all-reduce": ("allreduce", "all_reduce", "nccl"),
    "drafts' LM head": ("_argmax_kernel",),
    "FP8 quantiser": ("_quantize_kernel",),
    "matmuls (GEMV/GEMM, experts)": ("nvjet", "gemv", "gemm", "splitkreduce", "cutlass", "xmma", "_decode_kernel",
                                     "_w8a8_kernel", "_gate_up_kernel", "_down_kernel"),
    "MoE routing": ("_route_kernel",),
    "Gated DeltaNet": ("_delta_rule", "_causal_conv", "_gated_rms_norm", "chunk"),
    "attention": ("_cached_attention", "_qk_norm_rope", "flash", "fmha", "attention"),
    "norms, SiLU·up": ("_rms_norm", "_silu_mul"),
}


def part_of(kernel: str) -> str:
    name = kernel.lower()
    return next((part for part, pieces in PARTS.items() if any(p in name for p in pieces)),
                "other (elementwise, copies)")


def part_floors(moved: StepBytes) -> dict[str, int]:
    """The bytes each part must move in the step (the matmuls: every projection, the routed experts the
    tokens hit, the target's LM head and the MTP module)."""
    return {"matmuls (GEMV/GEMM, experts)": moved.weights + moved.mtp, "drafts' LM head": moved.draft_head,
            "Gated DeltaNet": moved.recurrent_state, "attention": moved.kv_cache + moved.block_tables}


def parts_table(prof, steps: int, wall_ms: float, moved: StepBytes, bandwidth: float, say) -> None:
    """The profiled steps' device time by part, per step, against each part's floor; the gaps are the
    time the device ran nothing (the profiler slows the host, so they read high)."""
    times: dict[str, float] = {}
    counts: dict[str, int] = {}
    for e in prof.key_averages():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            part = part_of(e.key)
            times[part] = times.get(part, 0.0) + e.self_device_time_total / steps
            counts[part] = counts.get(part, 0) + e.count
    floors = {part: 1e6 * nbytes / bandwidth for part, nbytes in part_floors(moved).items()}
    say("| part | kernels per step | µs per step | floor µs | of floor |")
    say("|---|---|---|---|---|")
    for part in sorted(times, key=times.get, reverse=True):
        floor = floors.get(part)
        shown = f"{floor:.0f} | {floor / times[part]:.0%}" if floor else "- | -"
        say(f"| {part} | {counts[part] / steps:.0f} | {times[part]:.0f} | {shown} |")
    busy = sum(times.values())
    say(f"| gaps (nothing on the device) | - | {1000 * wall_ms - busy:.0f} | - | - |")
    say(f"| step | - | {1000 * wall_ms:.0f} | {1e6 * moved.total / bandwidth:.0f} | "
        f"{1e6 * moved.total / bandwidth / (1000 * wall_ms):.0%} |")


def random_model(size: str, device: torch.device, dtype: torch.dtype, tp: TPGroup | None = None) -> Qwen3_5Model:
    """Normal random weights (a mixture of experts then routes each token to random-looking experts)."""
    raw = SIZES[size]()
    config = (Qwen3_5MoeConfig if "num_experts" in raw else Qwen3_5Config).from_dict(raw)
    with torch.device("meta"):
        model = Qwen3_5Model(config, tp or TPGroup(), with_mtp=True)
    model = model.to(dtype).to_empty(device=device)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.02) if p.dim() > 1 else p.normal_(0, 0.1)
    return model


def all_reduce_timing(prof, device: torch.device, say) -> None:
    """Where the all-reduce time of a TP step goes: each rank's all-reduce kernels in the profiled
    steps, matched in order across ranks. A kernel runs from its rank's arrival until the last
    rank's data is there, so on the earlier rank it also counts the wait for the later one."""
    kernels = [e for e in prof.profiler.kineto_results.events()
               if e.device_type() == torch.autograd.DeviceType.CUDA
               and "allreduce" in e.name().lower().replace("_", "")]
    kernels.sort(key=lambda e: e.start_ns())
    local = torch.tensor([[e.start_ns(), e.duration_ns()] for e in kernels], dtype=torch.int64, device=device)
    counts = [torch.zeros(1, dtype=torch.long, device=device) for _ in range(dist.get_world_size())]
    dist.all_gather(counts, torch.tensor([len(kernels)], device=device))
    if len({int(c) for c in counts}) != 1 or not kernels:
        say(f"all-reduce kernels per rank differ or are missing: {[int(c) for c in counts]}")
        return
    parts = [torch.empty_like(local) for _ in counts]
    dist.all_gather(parts, local)
    start = torch.stack([p[:, 0] for p in parts])  # [rank, kernel] ns on the host clock (one machine)
    start = (start - start.min()).double() / 1000  # µs, exact before the conversion
    duration = torch.stack([p[:, 1] for p in parts]).double() / 1000
    gap = start.max(0).values - start.min(0).values
    last = start.argmax(0)
    say(f"{len(kernels)} all-reduce kernels: mean duration per rank "
        + ", ".join(f"{d:.1f}" for d in duration.mean(1).tolist())
        + f" µs; mean arrival gap {gap.mean():.1f} µs (median {gap.median():.1f}); the last to arrive was rank "
        + ", ".join(f"{r}: {(last == r).float().mean():.0%}" for r in range(len(parts)))
        + f"; the last arrival's kernel took {duration.gather(0, last[None])[0].mean():.1f} µs")


def prefill_profile(model: Qwen3_5Model, device: torch.device, length: int, chunk: int, say, profile: bool) -> None:
    """Median prefill tokens/s of one prompt through the runner, in chunks of `chunk` tokens (the
    engine's prefill_chunk), and the operators of one prefill by device time."""
    runner = Decoder(model, device, 1, length + 8, chunk, 0, None)
    grants = Grants(runner)
    torch.manual_seed(0)
    prompt = torch.randint(0, model.config.vocab_size, (length,))

    def once() -> None:
        grants.step(StepRequest(prefill=[PrefillSpec(seq=0, length=length, max_tokens=1)]), prompt)
        grants.release([0])

    times = []
    for _ in range(5):  # the first two warm up (fla's autotuning)
        sync(device)
        started = time.perf_counter()
        once()
        sync(device)
        times.append(time.perf_counter() - started)
    say(f"prefill {length} tokens in chunks of {chunk}: median {1000 * statistics.median(times[2:]):.1f} ms, "
        f"{length / statistics.median(times[2:]):.0f} tokens/s", flush=True)
    if profile:
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                                torch.profiler.ProfilerActivity.CUDA]) as prof:
            once()
            sync(device)
        sort = "self_device_time_total" if device.type == "cuda" else "cpu_time_total"
        say(prof.key_averages().table(sort_by=sort, row_limit=25, max_name_column_width=60))
        if device.type == "cuda":  # a prefill whose kernels keep the device busy takes as long as they do
            kernels = [e for e in prof.key_averages() if e.device_type == torch.autograd.DeviceType.CUDA]
            busy = sum(e.self_device_time_total for e in kernels) / 1e3
            say(f"device busy {busy:.1f} ms of a {1000 * statistics.median(times[2:]):.1f} ms prefill")
    runner.close()


def cached_turn_profile(model: Qwen3_5Model, device: torch.device, context: int, tail: int, k: int,
                        forced: float | None, graphs: bool, say) -> None:
    """A cached turn on the worker: a sequence whose first `context` positions are cached (its saved
    recurrent state restored, the boundary block copied) prefills its `tail` new tokens and samples
    and drafts its first token; the median time of that step and the operators of one. Then the
    same turn with the prefix cache's state saved at the first block boundary in it (one replay
    where the tail passes save within it), and at the first two (split there: a replay a piece).
    (The cached K/V is random here: the time is the same.)"""
    runner = Decoder(model, device, 3, context + tail + 64, 2048, k, forced, cuda_graphs=graphs, prefix_cache=True)
    grants = Grants(runner)
    torch.manual_seed(0)
    prompt = torch.randint(0, model.config.vocab_size, (context + tail,))
    grants.step(StepRequest(prefill=[PrefillSpec(seq=0, length=context, max_tokens=1,
                                                 saves=[SaveAt(context, 0)])]), prompt[:context])
    grants.release([0])
    bt = runner.paging.block_tokens
    boundary = (context - 1) // bt
    boundaries = list(range((context // bt + 1) * bt, context + tail + 1, bt))[:2]  # (where saves may go)

    def once(seq: int, saves: int = 0) -> None:
        at = [SaveAt(p, 1 + i) for i, p in enumerate(boundaries[:saves])]
        spec = dataclasses.replace(grants(StepRequest(prefill=[PrefillSpec(seq=seq, length=context + tail,
                                                                           max_tokens=16, saves=at)])).prefill[0])
        spec = dataclasses.replace(spec, cached=context, state=0,
                                   copy_from=spec.blocks[boundary] if context % bt else -1)
        runner.step(StepRequest(prefill=[spec]), prompt)
        grants.release([seq])

    def timed(seqs: range, saves: int) -> list[float]:
        times = []
        for seq in seqs:
            sync(device)
            started = time.perf_counter()
            once(seq, saves)
            sync(device)
            times.append(time.perf_counter() - started)
        return times

    tails = runner.tails
    for saves in range(len(boundaries) + 1):
        saved = "" if not saves else f", {'a state' if saves == 1 else 'states'} saved at " + \
            " and ".join(map(str, boundaries[:saves]))
        for how in ("from the tail graphs", "eagerly (the peer)"):
            if tails is None and how != "eagerly (the peer)":
                continue  # (no graphs: no tail graphs)
            runner.tails = tails if how == "from the tail graphs" else None
            first = 1000 * (1 + saves) + 100 * (how != "from the tail graphs")  # (fresh sequence ids)
            times = timed(range(first, first + 7), saves)[2:]  # the first two warm up
            runs = ", ".join(f"{1000 * t:.1f}" for t in times)
            say(f"cached turn: {tail} new tokens after {context} cached{saved}, k = {k}, {how}: median "
                f"{1000 * statistics.median(times):.2f} ms (of {len(times)}: {runs})", flush=True)
    runner.tails = tails
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
                                if device.type == "cuda" else [torch.profiler.ProfilerActivity.CPU]) as prof:
        once(100)
        sync(device)
    sort = "self_device_time_total" if device.type == "cuda" else "self_cpu_time_total"
    say(prof.key_averages().table(sort_by=sort, row_limit=30, max_name_column_width=60))
    if device.type == "cuda":  # a prefill whose kernels keep the device busy takes as long as they do
        events = [e for e in prof.key_averages() if e.device_type == torch.autograd.DeviceType.CUDA]
        say(f"device busy {sum(e.self_device_time_total for e in events) / 1e3:.1f} ms of the profiled turn")
    host_profile(lambda: (once(101), sync(device)), say)
    runner.close()


def long_context_decode(model: Qwen3_5Model, device: torch.device, context: int, k: int, forced: float | None,
                        graphs: bool, say, steps: int = 20) -> None:
    """Decode steps of one sequence at a `context`-token context, the attention kernels' keys split over
    more programs (kernels.attention.splits_for) and in one range each (the peer), in the same run."""
    if device.type != "cuda" or not kernels.active():
        return  # (the kernels' splits: CUDA only)
    from shardspec.kernels import attention

    for how, cap in (("keys split", attention.MAX_SPLITS), ("keys in one range (the peer)", 1)):
        default, attention.MAX_SPLITS = attention.MAX_SPLITS, cap
        try:  # (the graphs are captured with the splits of this cap)
            runner = Decoder(model, device, 1, context + steps * (k + 1) + 64, 2048, k, forced, cuda_graphs=graphs)
            grants = Grants(runner)
            torch.manual_seed(0)
            prompt = torch.randint(0, model.config.vocab_size, (context,))
            grants.step(StepRequest(prefill=[PrefillSpec(seq=0, length=context, max_tokens=steps * (k + 1) + 8)]),
                        prompt)
            times = []
            for _ in range(steps):
                sync(device)
                started = time.perf_counter()
                runner.step(StepRequest(decode=[0]), torch.empty(0, dtype=torch.long))
                sync(device)
                times.append(time.perf_counter() - started)
            runner.close()
        finally:
            attention.MAX_SPLITS = default
        say(f"decode at a {context:,}-token context, k = {k}, {how}: median step "
            f"{1000 * statistics.median(times[3:]):.2f} ms (of {steps - 3})", flush=True)


def host_profile(fn: Callable[[], object], say, rows: int = 40) -> None:
    """Where the host's time goes in one call of fn (Python's profiler: the functions by their own
    time, then by the time under them), for work whose device is idle while the host dispatches."""
    profiler = cProfile.Profile()
    profiler.runcall(fn)
    for order in ("tottime", "cumtime"):
        text = io.StringIO()
        pstats.Stats(profiler, stream=text).strip_dirs().sort_stats(order).print_stats(rows)
        say(f"the host's time by {order}:\n" + text.getvalue().split("\n\n", 1)[-1].strip())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", choices=SIZES, default="9b")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--k", type=int, nargs="+", default=[0, 1, 3])
    parser.add_argument("--forced", type=float, default=0.8)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--tp", type=int, default=1, help="tensor-parallel ranks (one process per GPU)")
    parser.add_argument("--no-graphs", action="store_true")
    parser.add_argument("--by-shape", action="store_true",
                        help="with --no-graphs: also the operators' device time by input shape (which matmul is which)")
    parser.add_argument("--prefill", type=int, nargs="*", default=[],
                        help="also time (and profile the last of) prefills of these prompt lengths, batch 1")
    parser.add_argument("--prefill-chunk", type=int, nargs="+", default=[2048],
                        help="the prefills' chunk sizes (the engine's prefill_chunk; default 2048)")
    parser.add_argument("--cached-turn", type=int, nargs=2, metavar=("CONTEXT", "TAIL"), default=None,
                        help="also time and profile a cached turn: TAIL new tokens after CONTEXT cached ones "
                             "(restored state, copied boundary block), with each --k")
    add_flags(parser, WorkerOptions, "worker options", "as shardspec generate's, set in each rank's process")
    args = parser.parse_args()
    if args.tp == 1:
        run(0, args, "")
        return
    address = f"tcp://127.0.0.1:{free_port()}"  # the rendezvous
    mp.spawn(run, args=(args, address), nprocs=args.tp)


def run(rank: int, args: argparse.Namespace, address: str) -> None:
    device = torch.device(args.device, rank) if args.device == "cuda" else torch.device(args.device)
    options = from_flags(args, WorkerOptions)
    kernels.use(options)  # before the all-reduce choice and the model, as a worker's init
    tp = TPGroup()
    if args.tp > 1:
        if device.type == "cuda":
            torch.cuda.set_device(device)
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo", init_method=address, rank=rank,
                                world_size=args.tp, device_id=device if device.type == "cuda" else None)
        tp = TPGroup(rank, args.tp, symmetric=use_symmetric_memory(device, args.tp))
    say = print if rank == 0 else (lambda *a, **k: None)
    if device.type == "cuda":  # as the worker daemon sets them
        torch.backends.cuda.enable_cudnn_sdp(False)
    else:
        torch.set_flush_denormal(True)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    model = random_model(args.size, device, dtype, tp)
    bandwidth = copy_bandwidth(device) if device.type == "cuda" else 0.0
    for k in args.k:
        seqs = list(range(args.batch))
        runner = Decoder(model, device, args.batch, 1024, 512, k, args.forced if k else None,
                         cuda_graphs=not args.no_graphs, draft_head=options.draft_head,
                         launch_ahead=options.launch_ahead,
                         peek=lambda _until: StepRequest(decode=seqs))  # every next step is already here
        prefill = [PrefillSpec(seq=s, length=64, sampling=SamplingParams(seed=s), max_tokens=500) for s in seqs]
        torch.manual_seed(0)  # the same prompts on every rank
        Grants(runner).step(StepRequest(prefill=prefill), torch.randint(0, model.config.vocab_size, (64 * args.batch,)))
        for _ in range(3):  # warm-up
            runner.step(StepRequest(decode=seqs), torch.empty(0, dtype=torch.long))
        sync(device)  # (with launch ahead a step returns with the next one queued: time them together)
        started = time.perf_counter()
        for _ in range(args.steps):
            runner.step(StepRequest(decode=seqs), torch.empty(0, dtype=torch.long))
        sync(device)
        step_ms = 1000 * (time.perf_counter() - started) / args.steps
        say(f"tp={args.tp} k={k} batch={args.batch}: mean step {step_ms:.2f} ms over {args.steps} "
            f"(launch ahead {'on' if runner.ahead.count else 'off'})", flush=True)
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                                torch.profiler.ProfilerActivity.CUDA],
                                    record_shapes=args.by_shape) as prof:
            sync(device)
            began = time.perf_counter()
            for _ in range(3):
                runner.step(StepRequest(decode=seqs), torch.empty(0, dtype=torch.long))
            sync(device)
            wall_ms = 1000 * (time.perf_counter() - began) / 3
        sort = "self_device_time_total" if device.type == "cuda" else "cpu_time_total"
        device_events = [e for e in prof.key_averages() if e.device_type == torch.autograd.DeviceType.CUDA]
        launches = sum(e.count for e in device_events)
        busy_ms = sum(e.self_device_time_total for e in device_events) / 1000 / 3
        say(f"{launches / 3:.0f} GPU kernels per step; device busy {busy_ms:.2f} ms of a {wall_ms:.2f} ms "
            "step under the profiler")
        say(prof.key_averages().table(sort_by=sort, row_limit=40, max_name_column_width=60))
        if device.type == "cuda":
            context = max(s.length for s in runner.sequences.values())
            moved = step_bytes(model.config, args.tp, args.batch, context, k, 2, runner.draft_head)
            say(f"where a step's device time goes (k = {k}, batch {args.batch}; floors at "
                f"{bandwidth / 1e9:,.0f} GB/s, the profiler's steps at {wall_ms:.2f} ms):")
            parts_table(prof, 3, wall_ms, moved, bandwidth, say)
        if args.by_shape:
            say(prof.key_averages(group_by_input_shape=True).table(
                sort_by="device_time_total", row_limit=40, max_name_column_width=40, max_shapes_column_width=60))
        if args.tp > 1 and device.type == "cuda":
            all_reduce_timing(prof, device, say)
        runner.close()
        del runner
    if args.cached_turn is not None:
        for k in args.k:
            cached_turn_profile(model, device, *args.cached_turn, k, args.forced if k else None,
                                not args.no_graphs, say)
            for context in (512, args.cached_turn[0]):  # (a short context: what the splits cost where they are idle)
                long_context_decode(model, device, context, k, args.forced if k else None, not args.no_graphs, say)
    for chunk in args.prefill_chunk:
        for length in args.prefill:
            last = chunk == args.prefill_chunk[-1] and length == args.prefill[-1]
            prefill_profile(model, device, length, chunk, say, profile=last)
    if args.tp > 1:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
