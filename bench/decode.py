"""Decode and prefill speed on GPUs, against the memory-bandwidth floor and against transformers.

    python bench/decode.py --size 9b --tp 1 --batch 1 8 32 --k 1 2 3 4 --forced 0.6 0.8 \
        --prefill 2048 8192 --hf --out results.json

Writes a random-weight Qwen3.5 checkpoint of the chosen class (bf16) unless one is there, measures
the device's copy bandwidth (bytes read + written by a large device-to-device copy), then through
the real engine (local workers, NCCL): decode tokens/s without MTP at each batch size, with MTP at
k drafts under forced acceptance (benchmark mode: each draft kept with probability P — random
weights never draft right), and prefill tokens/s at the given prompt lengths. Every decode figure
is set against its floor: the bytes a step must read and write (shardspec.testing.step_bytes: the
weights it reads — of the embedding table only the rows looked up, the MTP module and the drafts'
head once per draft pass, none of them at k = 0 —, the KV it attends over, the recurrent state
read and written) ÷ the copy bandwidth measured with CUDA events. With --hf, transformers'
`generate` runs on the same checkpoint and GPU in the same run. Results go to stdout as tables and
to --out as JSON, row by row.

Mixture-of-experts sizes (35b-a3b) take --ep (expert parallelism); their floor counts the routed
experts the step's tokens hit under uniform routing (step_bytes). With --zero-experts the written
checkpoint's routed experts are zeros stored as holes (35B-A3B: ~6 GB on disk instead of 70, for
machines whose disk cannot hold it); every other tensor, the routers too, is random, so the routing
is, and a step's speed does not depend on the experts' values. transformers loads the same folder.

With --pp P the workers form P pipeline stages (P × --tp of them); `--device cuda:0` puts every
stage on one GPU, whose floor is then the whole model's bytes (the stages run one after the other
on it). --link-cost adds what one stage-link message of this model's hidden states costs at each
batch size: its bytes, encode + send + receive through ZeroMQ, and the copies off and onto the GPU.

With --fp8 every row runs again, in the same run, on the checkpoint's block-wise FP8 twin (the same
seed quantised: `random_checkpoint --fp8`), its rows tagged "weights": "fp8" and set against the
FP8 floor (FP8 weights, their block scales and the 16-bit parts); --fp8-only runs the twin alone.
--fp8-decode w8a8 weight-only runs the twin's rows once per decode GEMV mode (the workers' option
fp8_decode), rows tagged "fp8_decode". The workers' other options are the flags of `shardspec
generate` (--allreduce, --no-fused-norm, --draft-head, --no-bf16-gemv, ...), sent to every worker.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import itertools
import json
import os
import random
import subprocess
import time
from dataclasses import asdict
from pathlib import Path
from types import SimpleNamespace

import torch
from gpu_timing import copy_bandwidth, sync

import shardspec
from shardspec.models.base import split_config
from shardspec.models.checkpoint import Checkpoint
from shardspec.models.qwen3_5 import HybridConfig, Qwen3_5MoeConfig
from shardspec.option_flags import add_flags, from_flags
from shardspec.orchestrator.config import FORCED_ACCEPTANCE_ENV
from shardspec.protocol.messages import FP8_DECODE_MODES, WorkerOptions
from shardspec.testing.random_checkpoint import write_random_checkpoint
from shardspec.testing.sizes import SIZES
from shardspec.testing.step_bytes import StepBytes, step_bytes

PROMPT_LEN = 128


class Bench:
    def __init__(self, engine, config: HybridConfig, bandwidth: float, last_rank: int = 0, fp8: bool = False):
        self.engine, self.config, self.bandwidth = engine, config, bandwidth
        self.last_rank = last_rank  # a rank of the last stage: it verifies, so it counts the drafts
        self.fp8 = fp8  # a block-wise FP8 checkpoint: its floor counts FP8 weights and their scales

    async def reload(self, slots: int, k: int | None, forced: float | None, deterministic: bool = False) -> None:
        """New caches, MTP settings and mode on the loaded weights (the workers keep them); the rest of
        the engine's load request as it is."""
        load = dataclasses.replace(self.engine.group.load_request, max_seqs=slots, mtp="on" if k else "off",
                                   draft_tokens=k or 1, forced_acceptance=-1.0 if forced is None else forced,
                                   deterministic=deterministic)
        await self.engine.reload(load)  # (new pools: the engine grants from them)
        self.engine.scheduler.max_seqs = slots

    async def decode(self, batch: int, new_tokens: int, prompt_len: int = PROMPT_LEN) -> dict:
        rng = random.Random(batch)
        prompts = [rng.choices(range(self.config.vocab_size), k=prompt_len) for _ in range(batch)]

        async def one(prompt, n):
            async for chunk in self.engine.generate(prompt, max_tokens=n, stop_at_eos=False):
                final = chunk
            return final.stats

        await asyncio.gather(*(one(p, 4) for p in prompts))  # warm-up
        every_before = await self.engine.stats()
        started = time.perf_counter()
        stats = await asyncio.gather(*(one(p, new_tokens) for p in prompts))
        wall = time.perf_counter() - started
        every_after = await self.engine.stats()
        before, after = every_before[self.last_rank], every_after[self.last_rank]
        steps = after.steps - before.steps
        ttft = max(s["time_to_first_token_s"] for s in stats)
        decode_s = wall - ttft
        tokens = sum(s["generated_tokens"] - 1 for s in stats)
        result = {"batch": batch, "tokens_per_s": tokens / decode_s, "step_ms": 1000 * decode_s / max(1, steps - 1),
                  "steps": steps, "idle_gap_ms": 1000 * (after.step_gap_total_s - before.step_gap_total_s)
                  / max(1, after.step_gaps - before.step_gaps),
                  # the share of steps whose pass was queued behind the step before (decoder.py: launch ahead)
                  "launched_ahead": (after.launched_ahead - before.launched_ahead) / max(1, steps)}
        if len(every_after) > 1:  # per rank: waits on the stage links, and the share of the run outside steps
            result["link_wait_ms_per_step"] = [1000 * (a.link_wait_s - b.link_wait_s) / max(1, steps)
                                               for a, b in zip(every_after, every_before)]
            result["idle"] = [1 - (a.busy_s - b.busy_s) / wall for a, b in zip(every_after, every_before)]
        drafts = after.drafts - before.drafts
        if drafts:
            result["mean_acceptance_length"] = 1 + (after.accepted_tokens - before.accepted_tokens) / drafts
        return result

    async def prefill(self, length: int) -> dict:
        """Time to first token, and the prefill step's time on the worker (the rest is the orchestrator
        and the wire)."""
        prompt = random.Random(length).choices(range(self.config.vocab_size), k=length)
        steps = []
        self.engine.observer = SimpleNamespace(on_step=lambda step_s, accepted: steps.append(step_s))
        for _ in range(2):  # the first run warms up kernels for this shape
            steps.clear()
            async for chunk in self.engine.generate(prompt, max_tokens=1, stop_at_eos=False):
                final = chunk
        self.engine.observer = None
        ttft = final.stats["time_to_first_token_s"]
        return {"prompt_tokens": length, "tokens_per_s": length / ttft, "ttft_ms": 1000 * ttft,
                "worker_step_ms": 1000 * sum(steps)}

    def floor(self, tp: int, batch: int, k: int, new_tokens: int) -> StepBytes:
        """What one step must move: the whole model's bytes of one rank (with --pp, every stage's
        share: one sequence's step runs them one after the other), at the run's mean context."""
        dtype_bytes = 4 if self.config.dtype == "float32" else 2
        return step_bytes(self.config, tp, batch, PROMPT_LEN + new_tokens // 2, k, dtype_bytes,
                          self.engine.config.worker_options.draft_head if dtype_bytes == 2 else "cublas", fp8=self.fp8)


def transformers_decode(model: str, batches: list[int], new_tokens: int, vocab: int, device: str) -> list[dict]:
    """Greedy tokens/s of transformers' `generate` at each batch size, the model loaded once."""
    from transformers import GenerationConfig, Qwen3_5ForCausalLM, Qwen3_5MoeForCausalLM

    placed = {} if device == "cpu" else {"device_map": device}  # device_map needs accelerate
    moe = isinstance(Checkpoint.open(model).config, Qwen3_5MoeConfig)
    hf = (Qwen3_5MoeForCausalLM if moe else Qwen3_5ForCausalLM).from_pretrained(model, dtype=torch.bfloat16,
                                                                               **placed).eval()
    rows = []
    for batch in batches:
        ids = torch.tensor([random.Random(batch).choices(range(vocab), k=PROMPT_LEN) for _ in range(batch)],
                           device=device)
        with torch.inference_mode():
            for n in (2, new_tokens):  # a warm-up, then the timed run
                config = GenerationConfig(do_sample=False, max_new_tokens=n, min_new_tokens=n, eos_token_id=None,
                                          pad_token_id=0)
                sync(device)
                started = time.perf_counter()
                hf.generate(ids, attention_mask=torch.ones_like(ids), generation_config=config)
                sync(device)
        rows.append({"batch": batch, "tokens_per_s": batch * new_tokens / (time.perf_counter() - started)})
        print(f"transformers generate, batch {batch}: {rows[-1]['tokens_per_s']:.1f} tokens/s", flush=True)
    del hf
    if device == "cuda":
        torch.cuda.empty_cache()
    return rows


def link_costs(config: HybridConfig, batches: list[int], ks: list[int], device: torch.device) -> list[dict]:
    """One stage-link message of a verify pass at each batch and k: bytes, encode + send + receive
    (bench/pipeline.py's link_cost, best of 200), and the copy off the GPU into a reused pinned
    buffer plus the copy of the received frame onto it (best of 200)."""
    from pipeline import link_cost

    from shardspec.shard_worker.links import PinnedStaging

    rows = []
    for batch in batches:
        for k in ks:
            size, seconds = link_cost(config.hidden_size, batch * (k + 1))
            row = {"batch": batch, "k": k, "bytes": size, "encode_send_receive_us": 1e6 * seconds}
            if device.type == "cuda":
                hidden = torch.randn(batch, k + 1, config.hidden_size, dtype=torch.bfloat16, device=device)
                staging, inputs, best = PinnedStaging(), torch.empty_like(hidden), float("inf")
                for _ in range(200):
                    sync(device)
                    started = time.perf_counter()
                    host = staging.host_copy(hidden)
                    inputs.copy_(host)
                    sync(device)
                    best = min(best, time.perf_counter() - started)
                row["copies_us"] = 1e6 * best
            rows.append(row)
            copies = f"; off + onto the GPU {row['copies_us']:.0f} us" if "copies_us" in row else ""
            print(f"stage link, batch {batch}, k = {k}: {size} bytes per message; encode + send + receive "
                  f"{row['encode_send_receive_us']:.0f} us{copies}", flush=True)
    return rows


async def run(args: argparse.Namespace, out: dict, save) -> None:
    device = torch.device(args.device)
    out["bandwidth_GBps"] = copy_bandwidth(device) / 1e9
    print(f"copy bandwidth {out['bandwidth_GBps']:.0f} GB/s", flush=True)
    if args.link_cost:
        out["link_cost"] = link_costs(Checkpoint.open(args.ckpt).config, args.batch, sorted({0, *args.k}), device)
        save()
    out["decode"], out["prefill"] = [], []
    if not args.fp8_only:
        await run_checkpoint(args, args.ckpt, "bf16", out, save)
    for mode in args.fp8_decode if args.fp8 else []:
        await run_checkpoint(args, args.fp8_ckpt, "fp8", out, save, mode)


async def run_checkpoint(args: argparse.Namespace, ckpt: Path, weights: str, out: dict, save,
                         fp8_decode: str | None = None) -> None:
    """Every decode and prefill row of one checkpoint; `weights` (bf16 or fp8) and `fp8_decode` tag its rows."""
    config = split_config(Checkpoint.open(ckpt).config, args.tp, args.ep)  # the floor counts a rank's experts
    max_seq_len = max([PROMPT_LEN + args.new_tokens + 64, *(p + 8 for p in args.prefill)])
    stages = {"micro_batches": args.micro_batches} if args.micro_batches else {}
    options = from_flags(args, WorkerOptions, fp8_decode=fp8_decode or WorkerOptions.fp8_decode)
    async with shardspec.connect(model=str(ckpt), local=args.tp * args.pp, pp=args.pp, tp=args.tp, ep=args.ep,
                                 **stages, worker_options=options,
                                 device=args.device, mtp=None, max_seqs=max(args.batch), max_seq_len=max_seq_len,
                                 cache_memory=args.cache_memory,
                                 connect_timeout=600) as engine:  # a fresh VM loads a large checkpoint slowly
        bench = Bench(engine, config, out["bandwidth_GBps"] * 1e9, last_rank=(args.pp - 1) * args.tp,
                      fp8=weights == "fp8")
        suffix = "" if weights == "bf16" else f"_{weights}"
        out["weight_bytes_per_rank" + suffix] = engine.load_info.weight_bytes  # loaded: what a step reads
        out["weight_bytes_per_stage" + suffix] = [s.weight_bytes for s in (await engine.stats())[:: args.tp]]
        tags = {"weights": weights} | ({"fp8_decode": fp8_decode} if fp8_decode else {})
        print(f"{weights} weights ({ckpt})" + (f", {fp8_decode} decode GEMVs" if fp8_decode else ""), flush=True)
        print("| batch | MTP | tokens/s | step ms | floor ms | of floor | MAL | idle gap ms | ahead |", flush=True)
        print("|---|---|---|---|---|---|---|---|---|", flush=True)
        for batch in args.batch:
            configs = [(None, None)] + [(k, f) for f in args.forced for k in args.k]
            modes = [False, True] if args.deterministic else [False]
            for (k, forced), deterministic in itertools.product(configs, modes):
                await bench.reload(max(args.batch), k, forced, deterministic)
                row = await bench.decode(batch, args.new_tokens)
                moved = bench.floor(args.tp, batch, k or 0, args.new_tokens)
                floor = 1000 * moved.total / bench.bandwidth
                row |= tags | {"k": k or 0, "forced": forced, "deterministic": deterministic,
                        "floor_bytes": asdict(moved), "floor_ms": floor, "of_floor": floor / row["step_ms"]}
                out["decode"].append(row)
                save()
                label = ("off" if not k else f"k={k} @{forced}") + (" deterministic" if deterministic else "")
                print(f"| {batch} | {label} | {row['tokens_per_s']:.1f} | {row['step_ms']:.2f} | {floor:.2f} "
                      f"| {row['of_floor']:.0%} | {row.get('mean_acceptance_length', 1):.2f} "
                      f"| {row['idle_gap_ms']:.3f} | {row['launched_ahead']:.0%} |", flush=True)
        await bench.reload(1, None, None)
        rows = [await bench.prefill(length) | tags for length in args.prefill]
        out["prefill"] += rows
        save()
        for row in rows:
            print(f"prefill {row['prompt_tokens']} tokens: {row['tokens_per_s']:.0f} tokens/s (first token "
                  f"{row['ttft_ms']:.1f} ms, of which the worker's step {row['worker_step_ms']:.1f})", flush=True)


def setup(args: argparse.Namespace) -> dict:
    """What produced the figures: the code's commit, the library versions, the workers' options (the
    FP8 decode mode: per row)."""
    from importlib.metadata import PackageNotFoundError, version

    def installed(name: str) -> str | None:
        try:
            return version(name)
        except PackageNotFoundError:
            return None

    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=False,
                                cwd=Path(__file__).parent, timeout=10).stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        commit = None
    return {"commit": commit, "torch": torch.__version__, "triton": installed("triton"),
            "fla-core": installed("fla-core"), "transformers": installed("transformers"),
            "worker_options": asdict(from_flags(args, WorkerOptions, fp8_decode=WorkerOptions.fp8_decode))}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", choices=SIZES, default="9b")
    parser.add_argument("--ckpt", type=Path, default=None, help="checkpoint folder (written if missing)")
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--ep", type=int, default=1, help="expert parallelism of MoE sizes (it divides --tp)")
    parser.add_argument("--zero-experts", action="store_true",
                        help="MoE sizes: write the checkpoint's routed experts as zeros in holes (small disks)")
    parser.add_argument("--pp", type=int, default=1, help="pipeline stages (with --device cuda:N: all on that GPU)")
    parser.add_argument("--micro-batches", type=int, default=None, help="micro-batches in flight (default: --pp)")
    parser.add_argument("--link-cost", action="store_true", help="also time one stage-link message per batch and k")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--deterministic", action="store_true",
                        help="also each row in deterministic (batch-invariant) mode, next to the default")
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--k", type=int, nargs="*", default=[1, 2, 3, 4])
    parser.add_argument("--forced", type=float, nargs="*", default=[0.6, 0.8])
    parser.add_argument("--prefill", type=int, nargs="*", default=[2048, 8192])
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--cache-memory", default=None,
                        help="each worker's cache (K/V blocks and states), e.g. 8GiB; default: the worker's own (90 %% "
                             "of a GPU less its weights; with --pp on one GPU the first stage to size its cache "
                             "takes that)")
    parser.add_argument("--hf", action="store_true", help="also time transformers' generate (batch sizes ≤ 8)")
    parser.add_argument("--fp8", action="store_true",
                        help="then every row again on the block-wise FP8 twin of the checkpoint (same seed)")
    parser.add_argument("--fp8-ckpt", type=Path, default=None,
                        help="the FP8 twin (default: CKPT-fp8; written if missing)")
    parser.add_argument("--fp8-only", action="store_true", help="with --fp8: the FP8 twin's rows alone")
    parser.add_argument("--fp8-decode", nargs="+", choices=FP8_DECODE_MODES, default=[WorkerOptions.fp8_decode],
                        help="with --fp8: the twin's rows once per decode GEMV mode: activations rounded to e4m3 "
                             f"(w8a8) or kept bf16 (weight-only) (default: {WorkerOptions.fp8_decode})")
    add_flags(parser, WorkerOptions, "worker options", "sent to every worker, as shardspec generate's",
              skip=("fp8_decode",))
    parser.add_argument("--out", type=Path, default=Path("decode-results.json"))
    args = parser.parse_args()
    args.fp8 = args.fp8 or args.fp8_only
    os.environ[FORCED_ACCEPTANCE_ENV] = "1"  # a benchmark: forced acceptance is meant here
    args.ckpt = args.ckpt or Path(f"/tmp/shardspec-{args.size}")
    args.fp8_ckpt = args.fp8_ckpt or args.ckpt.with_name(args.ckpt.name + "-fp8")
    dtype = torch.float32 if args.size.startswith("tiny") else torch.bfloat16
    moe = "num_experts" in SIZES[args.size]()
    experts = {"experts": "mixed", "zero_experts": args.zero_experts} if moe else {}
    if not args.fp8_only and not (args.ckpt / "config.json").exists():
        write_random_checkpoint(args.ckpt, SIZES[args.size](), seed=0, dtype=dtype, keep=False, **experts)
    if args.fp8 and not (args.fp8_ckpt / "config.json").exists():  # quantised from the same seed: the twin
        write_random_checkpoint(args.fp8_ckpt, SIZES[args.size](), seed=0, dtype=dtype, keep=False, fp8=True,
                                **experts)
    out: dict = {"size": args.size, "tp": args.tp, "ep": args.ep, "pp": args.pp, "zero_experts": args.zero_experts,
                 "micro_batches": args.micro_batches,
                 "device": torch.cuda.get_device_name() if
                 torch.cuda.is_available() else "cpu", "setup": setup(args)}

    def save() -> None:
        args.out.write_text(json.dumps(out, indent=1))

    if args.hf:  # first, so that a run cut short still has its peer
        vocab = Checkpoint.open(args.ckpt).config.vocab_size
        try:
            out["transformers"] = transformers_decode(str(args.ckpt), [b for b in args.batch if b <= 8],
                                                      min(args.new_tokens, 32), vocab, args.device)
        except Exception as e:  # the peer failing must not cost the run its own figures
            out["transformers_error"] = f"{type(e).__name__}: {e}"
            print(f"transformers generate failed: {out['transformers_error']}", flush=True)
        save()
    asyncio.run(run(args, out, save))

if __name__ == "__main__":
    main()
