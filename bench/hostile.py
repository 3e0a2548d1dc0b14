"""A victim's stream beside hostile requests: its time to first token and largest gap between chunks,
alone and while each attack of the hardening issue runs.

    python bench/hostile.py [--runs 3] [--max-tokens 64] [--url http://127.0.0.1:8000/v1 | -- SERVE-ARGS...]

Without --url it starts `shardspec serve --port 0 --max-seqs 80` (the bundled model; room for the
victim beside n = 64; --device, and any SERVE-ARGS after `--`) and stops it at the end. The victim
is a streamed /v1/completions request (greedy, `ignore_eos`, --max-tokens tokens). The attacks,
each started 0.2 s before the victim and left to end on their own (their status codes are printed):
- compile: six `allOf` schemas of 20 string patterns at once (a compile of minutes and gigabytes);
- n64-schema: n = 64 of a schema of 10,000 required properties (378 KB), and n64-plain, the same
  64 sequences without it (what 64 more sequences in every step cost the victim);
- slow-masks: 48 requests of the regex `( {1000}){300}` (each mask 0.1-0.8 s);
- amplify: three requests of 4,000 prompt ids with echo, logprobs 20 and n = 128 (a 306 MB answer).
Per case: the victim's time to first token and largest gap, best and worst of --runs, and their
ratio to the victim alone (the issue's target: within 2x).
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import tempfile
import time
from pathlib import Path

import httpx
from serve import add_server_flags, server_args, start_server, stop_server

ALL_OF = {"allOf": [{"type": "string", "pattern": f".*{chr(97 + i)}.*"} for i in range(20)]}
PROPERTIES = {"type": "object", "properties": {f"p{i}": {"type": "integer"} for i in range(10_000)},
              "required": [f"p{i}" for i in range(10_000)]}


def attacks(model: str) -> dict[str, list[dict]]:
    completion = {"model": model, "prompt": "def f():", "max_tokens": 32}
    return {
        "compile": [completion | {"response_format": {"type": "json_schema", "json_schema": {
            "name": f"s{i}", "schema": ALL_OF | {"title": f"t{i}"}}}} for i in range(6)],
        "n64-plain": [completion | {"n": 64}],  # (the control: 64 more sequences in the steps, no grammar)
        "n64-schema": [completion | {"n": 64, "response_format": {"type": "json_schema", "json_schema": {
            "name": "big", "schema": PROPERTIES}}}],
        "slow-masks": [completion | {"structured_outputs": {"regex": "( {1000}){300}"}, "seed": i} for i in range(48)],
        "amplify": [{"model": model, "prompt": [7] * 4000, "max_tokens": 0, "echo": True, "logprobs": 20, "n": 128}
                    for _ in range(3)],
    }


async def victim(http: httpx.AsyncClient, url: str, model: str, max_tokens: int) -> tuple[float, float]:
    """(time to first token, largest gap between chunks) of one streamed request, in seconds."""
    body = {"model": model, "prompt": "def fibonacci(n):", "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, "stream": True}
    started = time.perf_counter()
    first, last, gap = None, started, 0.0
    async with http.stream("POST", f"{url}/completions", json=body) as response:
        response.raise_for_status()
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            now = time.perf_counter()
            if first is None:
                first = now - started
            else:
                gap = max(gap, now - last)
            last = now
    return first or 0.0, gap


async def attack(http: httpx.AsyncClient, url: str, bodies: list[dict]) -> list[int]:
    async def one(body: dict) -> int:
        endpoint = "chat/completions" if "messages" in body else "completions"
        try:
            return (await http.post(f"{url}/{endpoint}", json=body, timeout=900)).status_code
        except httpx.HTTPError:
            return -1
    return await asyncio.gather(*(one(b) for b in bodies))


async def run(url: str, runs: int, max_tokens: int) -> None:
    async with httpx.AsyncClient(timeout=900) as http:
        model = (await http.get(f"{url}/models")).json()["data"][0]["id"]
        await victim(http, url, model, max_tokens)  # (warm-up)
        alone = [await victim(http, url, model, max_tokens) for _ in range(runs)]
        base_first, base_gap = min(a[0] for a in alone), min(a[1] for a in alone)
        print(f"{'case':12} {'first token (s)':>18} {'x alone':>8} {'largest gap (s)':>18} {'x alone':>8}  codes")
        firsts, gaps = _span([a[0] for a in alone]), _span([a[1] for a in alone])
        print(f"{'alone':12} {firsts:>18} {'1.0':>8} {gaps:>18} {'1.0':>8}")
        for name, bodies in attacks(model).items():
            seen, codes = [], []
            for _ in range(runs):
                hostile = asyncio.create_task(attack(http, url, bodies))
                await asyncio.sleep(0.2)
                seen.append(await victim(http, url, model, max_tokens))
                codes = await hostile
            firsts, gaps = [s[0] for s in seen], [s[1] for s in seen]
            print(f"{name:12} {_span(firsts):>18} {max(firsts) / base_first:>8.1f} {_span(gaps):>18} "
                  f"{max(gaps) / base_gap:>8.1f}  {sorted(set(codes))}")


def _span(values: list[float]) -> str:
    return f"{min(values):.3f}-{max(values):.3f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=3, help="victim streams per case (default 3)")
    parser.add_argument("--max-tokens", type=int, default=64, help="the victim's tokens (default 64)")
    add_server_flags(parser)
    args = parser.parse_args()
    if args.url:
        asyncio.run(run(args.url, args.runs, args.max_tokens))
        return
    with tempfile.TemporaryDirectory() as folder:
        proc, url = start_server(["--max-seqs", "80", *server_args(args)], Path(folder) / "serve.log")
        try:
            asyncio.run(run(url, args.runs, args.max_tokens))
        finally:
            stop_server(proc)


if __name__ == "__main__":
    sys.exit(main())
