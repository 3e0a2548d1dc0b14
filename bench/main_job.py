"""The main job's speed: `shardspec generate` on the bundled model with and without MTP, against
Hugging Face transformers' `generate` on the same checkpoint, in one run on this machine's CPU.

    python bench/main_job.py [--tokens 128] [--repeats 3] [--dtype bfloat16 float32] [--device cpu]
    python bench/main_job.py --sampled --model DIR [DIR ...] [--generate ARGS ...] [--repeats 5] [--device cpu]

Greedy decoding of the same prompt everywhere (so every row produces the same tokens); tokens/s
is generated tokens ÷ the time from request to last token, median of --repeats runs after a
warm-up, every row loaded at once and the rows taking turns in each repeat (a change in the
machine's speed falls on all of them). transformers runs in this process with all cores;
shardspec runs its workers as the main job does (2 local CPU workers, TP = 2) and also with one
worker (TP = 1).

--sampled measures the main job itself, for one or more model folders (an A/B of two bundled
models) and sets of generate options (--generate): `shardspec generate`'s defaults otherwise (2
local workers, MTP on, its temperature, top-k, top-p and penalties; seed r in repeat r), the rows
taking turns in each repeat so that a change in the machine's load falls on all of them.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import shlex
import statistics
import time

import torch

import shardspec
from shardspec.cli import BUNDLED_MODEL, build_parser, sampling_penalties
from shardspec.protocol.messages import WorkerOptions

PROMPT = "def fibonacci(n):"


# (TP, MTP, collectives) of the shardspec rows: TP = 2 through shared memory (the default), and the
# main job again through Gloo, the peer of that path
ROWS = ((2, False, "auto"), (2, True, "auto"), (2, True, "gloo"), (1, False, "auto"), (1, True, "auto"))


async def greedy_rows(dtype: str, tokens: int, repeats: int, device: str) -> dict:
    """Every row's tokens/s (median), tokens and mean acceptance length: transformers and the
    shardspec engines, all loaded at once and taking turns in each repeat, so that a change in the
    machine's speed falls on every row alike."""
    hf_once = transformers_once(dtype, tokens, device)
    async with contextlib.AsyncExitStack() as stack:
        engines = {row: await stack.enter_async_context(shardspec.connect(
            model=str(BUNDLED_MODEL), local=row[0], device=device, mtp=row[1], dtype=dtype, max_seqs=1,
            worker_options=WorkerOptions(allreduce=row[2]))) for row in rows_on(device)}

        async def once(engine) -> tuple[float, list[int], float]:
            out, final = [], None
            async for chunk in engine.generate(PROMPT, max_tokens=tokens, stop_at_eos=False):
                out += chunk.token_ids
                final = chunk
            return final.stats["tokens_per_s"], out, final.stats.get("mean_acceptance_length", 1.0)

        runs: dict = {"transformers": [], **{row: [] for row in engines}}
        for repeat in range(repeats + 1):  # the first: a warm-up
            results = {"transformers": hf_once(), **{row: await once(engine) for row, engine in engines.items()}}
            for row, result in results.items():
                if repeat:
                    runs[row].append(result)
    return {row: (statistics.median(r[0] for r in rs), rs[0][1], rs[0][2]) for row, rs in runs.items()}


def rows_on(device: str) -> tuple:
    """The shardspec rows on `device`: Gloo's is the CPU's peer alone."""
    return tuple(row for row in ROWS if device == "cpu" or row[2] != "gloo")


def transformers_once(dtype: str, tokens: int, device: str):
    """A function that runs transformers' generate once on `device`: (tokens/s, tokens, 1.0)."""
    from transformers import AutoTokenizer, GenerationConfig, Qwen3_5ForCausalLM

    model = Qwen3_5ForCausalLM.from_pretrained(BUNDLED_MODEL, dtype=getattr(torch, dtype)).to(device).eval()
    tokenizer = AutoTokenizer.from_pretrained(BUNDLED_MODEL)
    ids = torch.tensor([tokenizer.encode(PROMPT, add_special_tokens=False)], device=device)
    config = GenerationConfig(do_sample=False, max_new_tokens=tokens, min_new_tokens=tokens, eos_token_id=None,
                              pad_token_id=0)

    def once():
        started = time.perf_counter()
        with torch.inference_mode():
            out = model.generate(ids, attention_mask=torch.ones_like(ids), generation_config=config)
        return tokens / (time.perf_counter() - started), out[0, ids.shape[1]:].tolist(), 1.0

    return once


async def main_job_once(model: str, generate_args: str, tokens: int, seed: int, device: str) -> dict:
    """One sampled completion at `shardspec generate`'s defaults and generate_args (its options),
    after a warm-up request."""
    defaults = build_parser().parse_args(["generate", PROMPT, *shlex.split(generate_args)])
    penalties = sampling_penalties(defaults)
    async with shardspec.connect(model=model, local=defaults.local or 2, device=device, mtp=True) as engine:
        async def once():
            async for chunk in engine.generate(PROMPT, max_tokens=tokens, temperature=defaults.temperature,
                                               top_k=defaults.top_k, top_p=defaults.top_p, seed=seed,
                                               stop_at_eos=False, **penalties):
                final = chunk
            return final.stats

        await once()
        return await once()


def sampled_main_job(models: list[str], options: list[str], tokens: int, repeats: int, device: str) -> None:
    runs: dict[tuple[str, str], list[dict]] = {(m, o): [] for m in models for o in options}
    for seed in range(repeats):
        for model, generate_args in runs:
            runs[model, generate_args].append(asyncio.run(main_job_once(model, generate_args, tokens, seed, device)))
    print(f"prompt {PROMPT!r}, {tokens} sampled tokens at the main job's defaults, {repeats} repeats")
    print("| model | generate options | tokens/s (median) | tokens/s (each repeat) | mean acceptance length (mean) |")
    print("|---|---|---|---|---|")
    for (model, generate_args), stats in runs.items():
        rates = [s["tokens_per_s"] for s in stats]
        acceptance = statistics.mean(s["mean_acceptance_length"] for s in stats)
        print(f"| {model} | {generate_args or '(defaults)'} | {statistics.median(rates):.1f} | "
              f"{', '.join(f'{r:.1f}' for r in rates)} | {acceptance:.2f} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--dtype", nargs="+", default=["bfloat16", "float32"])
    parser.add_argument("--sampled", action="store_true", help="the main job at its defaults, for each --model")
    parser.add_argument("--model", nargs="+", default=[str(BUNDLED_MODEL)], metavar="DIR",
                        help="model folders for --sampled (default: the bundled model)")
    parser.add_argument("--generate", nargs="+", default=[""], metavar="ARGS",
                        help="for --sampled: `shardspec generate` options, one row each, e.g. "
                             "'--repetition-penalty 1' '' (default: '', its defaults)")
    parser.add_argument("--device", default="cpu",
                        help="where every engine and transformers run: cpu, cuda or cuda:N (default cpu: the main job)")
    args = parser.parse_args()
    if args.sampled:
        sampled_main_job(args.model, args.generate, args.tokens, args.repeats, args.device)
        return
    print(f"prompt {PROMPT!r}, {args.tokens} greedy tokens, {args.device}, {torch.get_num_threads()} CPU threads")
    print("| dtype | engine | tokens/s | vs transformers | mean acceptance length | same tokens as transformers |")
    print("|---|---|---|---|---|---|")
    for dtype in args.dtype:
        rows = asyncio.run(greedy_rows(dtype, args.tokens, args.repeats, args.device))
        hf, hf_tokens, _ = rows["transformers"]
        print(f"| {dtype} | transformers generate (1 process) | {hf:.1f} | 1.00× | – | – |", flush=True)
        for tp, mtp, collectives in rows_on(args.device):
            rate, out, mal = rows[tp, mtp, collectives]
            name = f"shardspec TP={tp}, MTP {'on (k=3)' if mtp else 'off'}"
            name += ", through Gloo" if collectives == "gloo" else " — the main job" if tp == 2 and mtp else ""
            print(f"| {dtype} | {name} | {rate:.1f} | {rate / hf:.2f}× | {mal:.2f} | {out == hf_tokens} |", flush=True)

if __name__ == "__main__":
    main()
