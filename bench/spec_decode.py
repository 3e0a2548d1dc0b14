"""Speculative decoding with the MTP head: tokens/s with and without MTP, for k = 1..4.

    python bench/spec_decode.py [--model DIR] [--tp 2] [--k 1 2 3 4] [--forced 0.8] [--batch 1]

For each k it reports tokens/s, acceptance per position, mean acceptance length (MAL), the step
times, and the speedup realised as a fraction of the ideal one:
    ideal = MAL × (plain decode step time) ÷ (verify step time);  realised = tokens/s ÷ plain tokens/s.
On a random-weight checkpoint drafts are never right, so `--forced P` (benchmark mode) accepts each
draft with probability P to time the machinery; with a trained model (the bundled one) leave it
out to measure real acceptance. It also measures each worker's idle gap between consecutive steps
with the pipelined step loop on and off. Without --model it writes a random checkpoint first.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import tempfile
import time
from pathlib import Path

import shardspec
from shardspec.orchestrator.config import FORCED_ACCEPTANCE_ENV
from shardspec.testing.random_checkpoint import tiny_config, write_random_checkpoint

BENCH_CONFIG = tiny_config(  # ~60M parameters: big enough that compute, not Python, dominates a step
    vocab_size=8192, hidden_size=768, intermediate_size=2048, num_hidden_layers=8, num_attention_heads=8,
    num_key_value_heads=4, head_dim=96, linear_num_key_heads=8, linear_num_value_heads=16,
    linear_key_head_dim=48, linear_value_head_dim=48,
)


async def run(model: str, tp: int, k: int | None, forced: float | None, batch: int, tokens: int,
              pipeline: bool, device: str, prompt_len: int) -> dict:
    """One configuration: k None = MTP off."""
    rng = random.Random(0)
    async with shardspec.connect(model=model, local=tp, device=device, mtp=k is not None, draft_tokens=k or 1,
                                 pipeline=pipeline, forced_acceptance=forced if k else None,
                                 max_seqs=batch) as engine:
        vocab = engine.load_info.vocab_size
        prompts = [rng.choices(range(vocab), k=prompt_len) for _ in range(batch)]

        async def one(prompt, n):
            final = None
            async for chunk in engine.generate(prompt, max_tokens=n, stop_at_eos=False):
                final = chunk
            return final.stats

        await asyncio.gather(*(one(p, 8) for p in prompts))  # warm-up
        before = (await engine.stats())[0]
        started = time.perf_counter()
        stats = await asyncio.gather(*(one(p, tokens) for p in prompts))
        elapsed = time.perf_counter() - started
        after = (await engine.stats())[0]
    steps = after.steps - before.steps
    generated = sum(s["generated_tokens"] for s in stats)
    result = {
        "k": k or 0,
        "pipeline": pipeline,
        "tokens_per_s": generated / elapsed,
        "steps": steps,
        "step_ms": 1000 * elapsed / steps,
        "idle_gap_ms": 1000 * (after.step_gap_total_s - before.step_gap_total_s)
        / max(1, after.step_gaps - before.step_gaps),
    }
    if k:
        drafts = after.drafts - before.drafts
        accepted = after.accepted_tokens - before.accepted_tokens
        result["acceptance_per_position"] = [
            (a - b) / drafts for a, b in zip(after.accepted_per_position, before.accepted_per_position)
        ]
        result["mean_acceptance_length"] = 1 + accepted / drafts
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", help="checkpoint folder (default: write a random one)")
    parser.add_argument("--tp", type=int, default=2)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--k", type=int, nargs="+", default=[1, 2, 3, 4])
    parser.add_argument("--forced", type=float, nargs="*", default=None,
                        help="forced acceptance rates to time (benchmark mode); omit for real acceptance")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--json", type=Path, help="also write the results here")
    args = parser.parse_args()
    model = args.model
    if model is None:
        model = str(Path(tempfile.gettempdir()) / "shardspec-bench-spec")
        if not (Path(model) / "config.json").exists():
            write_random_checkpoint(model, BENCH_CONFIG, seed=0)
    rates = args.forced or [None]
    if args.forced:
        os.environ[FORCED_ACCEPTANCE_ENV] = "1"  # this script is a benchmark: the switch is meant here

    def bench(k, forced, pipeline=True):
        return asyncio.run(run(model, args.tp, k, forced, args.batch, args.tokens, pipeline, args.device,
                               args.prompt_len))

    plain = bench(None, None)
    plain_unpipelined = bench(None, None, pipeline=False)
    rows = []
    print(f"model {model}, TP {args.tp}, batch {args.batch}, {args.tokens} tokens per sequence, {args.device}")
    print(f"plain decode: {plain['tokens_per_s']:.1f} tokens/s, step {plain['step_ms']:.2f} ms, "
          f"idle gap {plain['idle_gap_ms']:.3f} ms pipelined / {plain_unpipelined['idle_gap_ms']:.3f} ms not")
    print("| forced acceptance | k | tokens/s | speedup | acceptance per position | MAL | verify step ms "
          "| ideal speedup | realised / ideal | idle gap ms (pipelined / not) |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for forced in rates:
        for k in args.k:
            r = bench(k, forced)
            unpiped = bench(k, forced, pipeline=False)
            ideal = r["mean_acceptance_length"] * plain["step_ms"] / r["step_ms"]
            speedup = r["tokens_per_s"] / plain["tokens_per_s"]
            r |= {"forced": forced, "speedup": speedup, "ideal_speedup": ideal,
                  "idle_gap_unpipelined_ms": unpiped["idle_gap_ms"]}
            rows.append(r)
            acc = " ".join(f"{a:.2f}" for a in r["acceptance_per_position"])
            print(f"| {forced if forced is not None else 'off (real)'} | {k} | {r['tokens_per_s']:.1f} "
                  f"| {speedup:.2f}× | {acc} | {r['mean_acceptance_length']:.2f} | {r['step_ms']:.2f} "
                  f"| {ideal:.2f}× | {speedup / ideal:.0%} | {r['idle_gap_ms']:.3f} / {unpiped['idle_gap_ms']:.3f} |",
                  flush=True)
    if args.json:
        args.json.write_text(json.dumps({"plain": plain, "plain_unpipelined": plain_unpipelined, "mtp": rows},
                                        indent=1))


if __name__ == "__main__":
    main()
