"""Structured output's cost: tokens/s and mean acceptance length (MAL) with a JSON schema against
without, MTP on and off, and the share of tokens the grammar forced (one token allowed).

    python bench/structured.py [--model DIR] [--device DEVICE] [--local N] [--mtp both] [--batch 1]
        [--requests 8] [--max-tokens 128] [--json PATH]

One engine per MTP setting on --device (as `shardspec.connect`: the GPU where there is one), its
`--local` workers (one GPU; on the CPU two, the main job's layout); each row runs --requests greedy
generations (one prompt each), --batch of them at once (waves of that many, started together),
and reports the decode speed: each request's tokens after its first ÷ its time after the first
token, summed over the requests of a wave that run at once (at batch 1 one request's speed; a JSON
object ends sooner than free text, so whole-request rates would weigh prefill differently; at
batch B the requests of a wave that end first leave the others a smaller batch), the MAL of its MTP steps,
and, under the schema, the share of output tokens where the grammar allowed a single token (which
MTP drafts, and the target accepts, as they are: jump-forward within the k drafts of a step), and the
last stage's host time in grammar work (masks, advances, rollbacks) per step that had any. The
schema: an object of a string, a bounded integer, an enum and an array of enums. Every output under
the schema must parse as its JSON, but for one that --max-tokens cut short (random weights can write
digits for ever): those are counted ("complete" says how many parsed).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from pathlib import Path

from llguidance import LLMatcher

import shardspec
from shardspec.cli import BUNDLED_MODEL
from shardspec.constraints import grammar_of, llg_tokenizer
from shardspec.option_flags import add_flags, from_flags
from shardspec.protocol.messages import WorkerOptions
from shardspec.utils import default_device

SCHEMA = {"type": "object",
          "properties": {"name": {"type": "string", "maxLength": 24}, "count": {"type": "integer", "minimum": 0},
                         "kind": {"enum": ["function", "class", "module"]},
                         "tags": {"type": "array", "items": {"enum": ["io", "math", "text", "net"]}, "maxItems": 4}},
          "required": ["name", "count", "kind", "tags"], "additionalProperties": False}
PROMPTS = ["def fibonacci(n):", "import os\n", "class Stack:\n    def", "for i in range(", "def main():\n    ",
           "x = [", "try:\n    import", "# Copyright"]


async def one(engine, prompt: str, max_tokens: int, constrained: bool) -> tuple[list[int], dict]:
    ids, stats = [], None
    async for chunk in engine.generate(prompt, max_tokens=max_tokens, temperature=0,
                                       structured_output={"json": SCHEMA} if constrained else None):
        ids += chunk.token_ids
        stats = chunk.stats or stats
    return ids, stats


async def row(engine, args: argparse.Namespace, constrained: bool, batch: int = 1) -> dict:
    tokens = steps = accepted = 0
    decode_tokens, decode_s = 0, 0.0
    outputs = []
    before = (await engine.stats())[-1]  # the last stage: the grammars' host time
    for start in range(0, args.requests, batch):
        wave = await asyncio.gather(*(one(engine, PROMPTS[i % len(PROMPTS)], args.max_tokens, constrained)
                                      for i in range(start, min(start + batch, args.requests))))
        for ids, stats in wave:
            outputs.append(ids)
            tokens += len(ids)
            steps += stats.get("drafts", 0)
            accepted += stats.get("accepted_tokens", 0)
            if len(ids) > 1:
                decode_tokens += len(ids) - 1
                decode_s += (len(ids) - 1) / stats["decode_tokens_per_s"] / len(wave)  # (they run at once)
    after = (await engine.stats())[-1]
    grammar_steps = after.grammar_steps - before.grammar_steps
    grammar_ms = 1e3 * (after.grammar_s - before.grammar_s) / grammar_steps if grammar_steps else 0.0
    return {"tokens": tokens, "tokens_per_s": decode_tokens / decode_s, "mal": 1 + accepted / steps if steps else 1.0,
            "grammar_ms_per_step": grammar_ms, "grammar_steps": grammar_steps, "outputs": outputs}


def forced_share(model: Path, outputs: list[list[int]], vocab: int, eos: list[int]) -> float:
    """The share of output tokens at which the schema's grammar allowed exactly one token."""
    tokenizer, grammar = llg_tokenizer(model / "tokenizer.json", vocab, eos), grammar_of({"json": SCHEMA})
    forced = total = 0
    for ids in outputs:
        matcher = LLMatcher(tokenizer, grammar)
        for token in ids:
            forced += sum(bin(byte).count("1") for byte in matcher.compute_bitmask()) == 1
            total += 1
            if matcher.is_stopped() or not matcher.consume_token(token):
                break
    return forced / total if total else 0.0


async def main(args: argparse.Namespace) -> dict:
    results = {}
    options = from_flags(args, WorkerOptions)
    for mtp in {"both": (True, False), "on": (True,), "off": (False,)}[args.mtp]:
        async with shardspec.connect(model=str(args.model), device=args.device, local=args.local, mtp=mtp,
                                     max_seqs=max(args.batch), worker_options=options) as engine:
            await row(engine, argparse.Namespace(requests=1, max_tokens=8), False)  # warm-up
            for batch in args.batch:
                plain, constrained = await row(engine, args, False, batch), await row(engine, args, True, batch)
                results[f"{'on' if mtp else 'off'}, batch {batch}"] = {"plain": plain, "schema": constrained}
            vocab, eos = engine.load_info.vocab_size, list(engine.load_info.eos_token_ids)
            tokenizer = engine.tokenizer
    for r in results.values():
        outputs = r["schema"].pop("outputs")
        r["schema"]["complete"] = sum(complete(tokenizer.decode(output, skip_special_tokens=True), len(output),
                                               args.max_tokens) for output in outputs)
        r["forced_share"] = forced_share(Path(args.model), outputs, vocab, eos)
        r["plain"].pop("outputs")
    print(f"{args.requests} greedy requests of up to {args.max_tokens} tokens, {args.local} local worker(s) on "
          f"{args.device}\n")
    print("| MTP, batch | tokens/s, no schema | tokens/s, JSON schema | ratio | MAL, no schema | MAL, schema | "
          "tokens the grammar forced | grammar host ms a step |")
    print("|---|---|---|---|---|---|---|---|")
    for name, r in results.items():
        print(f"| {name} | {r['plain']['tokens_per_s']:.1f} | {r['schema']['tokens_per_s']:.1f} | "
              f"{r['schema']['tokens_per_s'] / r['plain']['tokens_per_s']:.2f}× | {r['plain']['mal']:.2f} | "
              f"{r['schema']['mal']:.2f} | {100 * r['forced_share']:.0f} % | "
              f"{r['schema']['grammar_ms_per_step']:.3f} |")
    for name, r in results.items():
        print(f"MTP {name}: {r['schema']['complete']} of {args.requests} outputs under the schema complete, the others "
              f"cut at {args.max_tokens} tokens")
    return results


def complete(text: str, tokens: int, max_tokens: int) -> bool:
    """Whether an output under the schema is a whole JSON value; one that ended before --max-tokens must be."""
    try:
        json.loads(text)
    except ValueError:
        if tokens < max_tokens:
            raise
        return False
    return True


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawTextHelpFormatter)
    parser.add_argument("--model", type=Path, default=Path(BUNDLED_MODEL), help="model folder (default: the bundled "
                        "model)")
    parser.add_argument("--device", default=default_device(), help="cpu, cuda or cuda:N (default: cuda where "
                        "there is a GPU, as shardspec.connect)")
    parser.add_argument("--local", type=int, default=None, help="local workers, TP (default: 1 on a GPU, 2 on the "
                        "CPU: the main job's layout)")
    parser.add_argument("--mtp", choices=["both", "on", "off"], default="both",
                        help="the engines to run: MTP on, off or both (default both)")
    parser.add_argument("--batch", type=int, nargs="+", default=[1], help="requests at once, a row each (default 1; "
                        "the engine takes the largest as max_seqs)")
    parser.add_argument("--requests", type=int, default=8, help="generations per row (default 8)")
    parser.add_argument("--max-tokens", type=int, default=128, help="tokens per generation at most (default 128)")
    parser.add_argument("--json", type=Path, default=None, help="write the figures to this file")
    add_flags(parser, WorkerOptions, "worker options", "how the workers compute, as `shardspec generate` takes them "
              "(--launch-ahead off: the peer of launch ahead)")
    args = parser.parse_args(argv)
    if args.local is None:
        args.local = 2 if args.device == "cpu" else 1
    for name in ("local", "requests", "max_tokens"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1")
    if min(args.batch) < 1:
        parser.error("--batch must be at least 1")
    return args


if __name__ == "__main__":
    arguments = parse_args()
    try:
        figures = asyncio.run(main(arguments))
    except KeyboardInterrupt:
        sys.exit("interrupted")
    if arguments.json is not None:
        arguments.json.write_text(json.dumps(figures, indent=1))
