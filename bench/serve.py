"""Serving throughput and latency: 1, 4, 16 and 64 concurrent streaming clients against `shardspec serve`.

    python bench/serve.py [--clients 1 4 16 64] [--requests-per-client 3] [--max-tokens 128]
                          [--url http://127.0.0.1:8000/v1 | -- SERVE-ARGS...]

Without --url it starts `shardspec serve --port 0` (plus any SERVE-ARGS after `--`) on 127.0.0.1 as a
subprocess and stops it at the end, Ctrl-C included. Each client sends --requests-per-client
streamed /v1/completions requests one after the other (sampling as the main job: temperature 0.8,
top-k 40, top-p 0.95, its own seed; `ignore_eos`, so every request generates exactly --max-tokens
tokens). Per level: aggregate tokens/s (all generated tokens ÷ the level's wall time), time to
first token and time per output token (after the first) at p50 and p99, and the mean acceptance
length of the MTP drafts from the server's /metrics.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import re
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families

PROMPTS = ["def fibonacci(n):", "import os\n", "class Stack:\n    def", "for i in range(", "def main():\n    ",
           "x = [", "try:\n    import", "# Copyright", "async def fetch(", "with open(", "if __name__ ==",
           "return self.", "raise ValueError(", "from typing import", "while True:\n", "lambda x:"]


@dataclass
class Sample:
    tokens: int
    ttft: float
    tpot: float


def percentile(values: list[float], q: float) -> float:
    """Nearest-rank percentile."""
    ordered = sorted(values)
    return ordered[max(0, math.ceil(q / 100 * len(ordered)) - 1)]


async def one_request(http: httpx.AsyncClient, url: str, model: str, n: int, max_tokens: int) -> Sample:
    body = {"model": model, "prompt": PROMPTS[n % len(PROMPTS)], "max_tokens": max_tokens, "temperature": 0.8,
            "top_k": 40, "top_p": 0.95, "seed": n, "stream": True, "stream_options": {"include_usage": True},
            "ignore_eos": True}
    started = time.perf_counter()
    first = last = None
    tokens = 0
    async with http.stream("POST", f"{url}/completions", json=body) as response:
        response.raise_for_status()
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[len("data: "):])
            if "error" in event:
                raise RuntimeError(event["error"]["message"])
            if event["choices"]:
                last = time.perf_counter()
                first = first or last
            if event.get("usage"):
                tokens = event["usage"]["completion_tokens"]
    assert first is not None and last is not None
    return Sample(tokens, first - started, (last - first) / (tokens - 1) if tokens > 1 else 0.0)


async def level(url: str, model: str, clients: int, per_client: int, max_tokens: int) -> tuple[float, list[Sample]]:
    """Aggregate tokens/s and the samples of `clients` concurrent clients."""
    limits = httpx.Limits(max_connections=clients + 4, max_keepalive_connections=clients + 4)
    async with httpx.AsyncClient(timeout=600, limits=limits) as http:
        async def client(c: int) -> list[Sample]:
            return [await one_request(http, url, model, c * per_client + i, max_tokens) for i in range(per_client)]

        started = time.perf_counter()
        samples = [s for group in await asyncio.gather(*(client(c) for c in range(clients))) for s in group]
        wall = time.perf_counter() - started
    return sum(s.tokens for s in samples) / wall, samples


def spec_counters(url: str) -> tuple[float, float]:
    """(drafts, accepted draft tokens) so far, from /metrics."""
    text = httpx.get(url.removesuffix("/v1") + "/metrics", timeout=60).text
    values = {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples}
    drafts = values.get("shardspec_spec_decode_drafts_total", 0.0)
    return drafts, values.get("shardspec_spec_decode_accepted_tokens_total", 0.0)


def add_server_flags(parser: argparse.ArgumentParser) -> None:
    """--url (a running server) or the server this script starts: --device and the serve arguments
    after `--` (server_args)."""
    parser.add_argument("--url", help="a running server's base URL (.../v1); default: start one")
    parser.add_argument("--device", help="the server's workers' device, cpu, cuda or cuda:N (default: serve's, the "
                        "GPUs where there are some)")
    parser.add_argument("serve_args", nargs="*", help="after --: arguments for `shardspec serve`")


def server_args(args: argparse.Namespace) -> list[str]:
    """The arguments of the `shardspec serve` to start, from add_server_flags's."""
    return (["--device", args.device] if args.device else []) + args.serve_args


def start_server(serve_args: list[str], log: Path) -> tuple[subprocess.Popen, str]:
    cmd = [sys.executable, "-m", "shardspec", "serve", "--port", "0", "--host", "127.0.0.1", "--log-level", "WARNING",
           *serve_args]
    with open(log, "wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    deadline = time.monotonic() + 300
    while not (found := re.search(r"serving \S+ at (http://\S+)", log.read_text(errors="replace"))):
        if proc.poll() is not None or time.monotonic() > deadline:
            stop_server(proc)
            raise SystemExit(f"the server did not start:\n{log.read_text(errors='replace')}")
        time.sleep(0.2)
    print(log.read_text(errors="replace").strip().splitlines()[-1], file=sys.stderr)
    return proc, found.group(1)


def stop_server(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def run(url: str, args: argparse.Namespace) -> None:
    model = httpx.get(f"{url}/models", timeout=60).json()["data"][0]["id"]
    asyncio.run(level(url, model, 1, 1, 16))  # warm-up
    print(f"{args.max_tokens} tokens per request, {args.requests_per_client} requests per client, streamed")
    print("| clients | requests | tokens/s | vs 1 client | TTFT p50 (ms) | TTFT p99 (ms) | TPOT p50 (ms) | "
          "TPOT p99 (ms) | mean acceptance length |")
    print("|---|---|---|---|---|---|---|---|---|")
    base = None
    for clients in args.clients:
        drafts0, accepted0 = spec_counters(url)
        rate, samples = asyncio.run(level(url, model, clients, args.requests_per_client, args.max_tokens))
        drafts, accepted = (a - b for a, b in zip(spec_counters(url), (drafts0, accepted0)))
        base = base or rate
        ttft = [s.ttft * 1e3 for s in samples]
        tpot = [s.tpot * 1e3 for s in samples]
        mal = f"{1 + accepted / drafts:.2f}" if drafts else "–"
        print(f"| {clients} | {len(samples)} | {rate:.1f} | {rate / base:.2f}× | {percentile(ttft, 50):.0f} | "
              f"{percentile(ttft, 99):.0f} | {percentile(tpot, 50):.1f} | {percentile(tpot, 99):.1f} | {mal} |",
              flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--clients", type=int, nargs="+", default=[1, 4, 16, 64])
    parser.add_argument("--requests-per-client", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=128)
    add_server_flags(parser)
    args = parser.parse_args()
    if args.url:
        run(args.url.rstrip("/"), args)
        return
    with tempfile.TemporaryDirectory(prefix="shardspec-bench-") as folder:
        proc, url = start_server(server_args(args), Path(folder) / "server.log")
        try:
            run(url, args)
        finally:
            stop_server(proc)


if __name__ == "__main__":
    main()
