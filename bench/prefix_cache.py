"""The prefix cache: a multi-turn chat trace against `shardspec serve` with the cache on and off, or
(--sweep) how many sequences run at once in a fixed cache.

    python bench/prefix_cache.py [--conversations 16] [--turns 5] [--system-tokens 1500] [--user-tokens 40]
                                 [--max-tokens 48] [--concurrency 4] [--seed 0] [--json PATH] [-- SERVE-ARGS...]
    python bench/prefix_cache.py --sweep [--sweep-requests 1 2 4 8 16 32] [--cache-memory 16MiB|default]
                                 [--sweep-prompt-tokens 1024] [--sweep-max-tokens 128] [-- SERVE-ARGS...]

Each run starts `shardspec serve --port 0` (plus SERVE-ARGS) on 127.0.0.1 as a subprocess and stops it
at the end, Ctrl-C and SIGTERM included. Stdout gets markdown tables; --json PATH every figure, and
the trace's requests one by one (TTFT, prompt, cached and reusable tokens).

The trace (seeded): C conversations of T turns, all opening with one system prompt of about S tokens;
every user message is about U tokens. Text is cut from the Python standard library's source with the
model's tokenizer, so the token counts come out about right. Each turn sends /v1/chat/completions with
the whole history (the system prompt, the user messages and the replies as returned, the new user
message), streamed with stream_options.include_usage, greedy and with ignore_eos: every reply is
exactly --max-tokens tokens, and the same from run to run where the server's greedy output does not
depend on the batch (float32 on CPU, its default there, or --deterministic). Up to --concurrency
conversations run at once; the turns of one conversation run one after the other. The trace runs
twice: against a server with the prefix cache on (its default) and one given --no-prefix-cache; a
server that rejects that flag is said so, and only the cache-on run is reported.

Figures, per run: time to first token (TTFT) at p50 and p95 (nearest rank) for each turn index;
completion tokens/s over the whole trace; the hit rate, cached ÷ prompt tokens, where cached is the
response's usage.prompt_tokens_details.cached_tokens (0 when absent); the hit rate of reusable tokens,
cached ÷ reusable; the deltas of shardspec_prefix_cache_queries_total and _hits_total on /metrics
when the server has them; at --concurrency 1, where each turn's time to first token goes (the deltas of
the server's shardspec_time_to_first_token_phase_seconds around it, and the client's TTFT less the
server's); and, with the cache on, the second-turn figures: over the conversations
whose first turn found nothing cached, the median of TTFT(turn 1) ÷ TTFT(turn 2); and the median TTFT
of turn 1 ÷ that of turn 2 over all conversations.

A request's reusable tokens: the longest prefix of its prompt's token ids (rendered with the model's
chat template and tokenized, as the server does) that an earlier request had already put in the
server before this one was sent: the prompt of a request whose first token had arrived, or the prompt
and reply (its text re-encoded) of one that had finished; at most the prompt less its last token,
which must run to give the first output token. So turn 1 of a conversation can reuse the system
prompt once another conversation's turn 1 has started answering, and turn t > 1 its own history.

--sweep: one server with --cache-memory (and --max-seqs as many as the largest level, unless
SERVE-ARGS set it); for each level N, N concurrent /v1/completions requests with distinct prompts of
--sweep-prompt-tokens tokens, each generating --sweep-max-tokens tokens; /metrics is polled while they
run (every 0.1 s) for the peak of shardspec_requests_running (and _waiting; the peak is at least the
largest step batch of shardspec_step_sequences, which a short request cannot slip past) and the preemptions. The
K/V positions that the ready line reports ("cache: N tokens of K/V ...") ÷ the longest sequence is how
many sequences the old fixed reservation (--max-seq-len positions a sequence) would have run in the
same memory; ÷ the sweep's sequence length, how many of its sequences fit at once.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import os
import random
import re
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families
from serve import stop_server  # (bench/serve.py: this script's folder is on the path)

from shardspec.orchestrator.config import BUNDLED_MODEL
from shardspec.orchestrator.tokenizer import Tokenizer
from shardspec.server.chat import ChatTemplate
from shardspec.utils import parse_size

NO_CACHE_FLAG = "--no-prefix-cache"
PREFIX_METRICS = {"queries": "shardspec_prefix_cache_queries_total", "hits": "shardspec_prefix_cache_hits_total"}
CAPACITY = re.compile(r"cache: ([\d,]+) tokens of K/V.*? of up to ([\d,]+) tokens")


class BenchError(Exception):
    """What stops the benchmark, said to the user in one line."""


class FlagRejected(BenchError):
    """The server does not take one of the flags this script passes it."""


# --- the trace ----------------------------------------------------------------------------------


class Text:
    """The model's tokenizer and chat template, and a corpus of Python source to cut prompts from."""

    def __init__(self, model: Path):
        tokenizer = Tokenizer.from_folder(model)
        template = ChatTemplate.from_folder(model)
        if tokenizer is None or template is None:
            raise BenchError(f"{model} needs a tokenizer.json and a chat template (tokenizer_config.json): this "
                             "benchmark renders and tokenizes the chat prompts as the server does")
        self.tokenizer, self.template = tokenizer, template
        stdlib = sorted(Path(os.__file__).parent.glob("*.py"))
        self.corpus = self.tokenizer.encode("".join(path.read_text(errors="replace") for path in stdlib[:60]))

    def cut(self, rng: random.Random, tokens: int) -> str:
        """About `tokens` tokens of the corpus, from a random place."""
        if tokens >= len(self.corpus):
            raise BenchError(f"{tokens:,} tokens is more than the corpus of prompt text ({len(self.corpus):,})")
        start = rng.randrange(len(self.corpus) - tokens)
        return self.tokenizer.decode(self.corpus[start : start + tokens])

    def prompt_ids(self, messages: list[dict[str, str]]) -> list[int]:
        return self.tokenizer.encode(self.template.render(messages, add_generation_prompt=True))


@dataclass
class Trace:
    system: str
    users: list[list[str]]  # [conversation][turn]


def make_trace(text: Text, args: argparse.Namespace) -> Trace:
    rng = random.Random(args.seed)
    system = text.cut(rng, args.system_tokens)
    return Trace(system, [[text.cut(rng, args.user_tokens) for _ in range(args.turns)]
                          for _ in range(args.conversations)])


@dataclass
class Turn:
    """One request of the trace, as sent and as answered (times: time.perf_counter())."""

    conversation: int
    turn: int  # 1-based
    messages: list[dict[str, str]]
    sent: float = 0.0
    first: float = math.inf
    done: float = math.inf
    reply: str = ""
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int | None = None  # None: the response did not say
    phases: dict[str, float] | None = None  # where its TTFT went, ms (concurrency 1: read off /metrics)

    @property
    def ttft(self) -> float:
        return self.first - self.sent


async def chat_turn(http: httpx.AsyncClient, url: str, model: str, turn: Turn, max_tokens: int) -> None:
    body = {"model": model, "messages": turn.messages, "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    turn.sent = time.perf_counter()
    async with http.stream("POST", f"{url}/chat/completions", json=body) as response:
        if response.status_code != 200:
            await response.aread()
            raise BenchError(f"/v1/chat/completions answered {response.status_code}: {response.text}")
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[len("data: "):])
            if "error" in event:
                raise BenchError(f"a streamed request failed: {event['error']['message']}")
            for choice in event["choices"]:
                turn.first = min(turn.first, time.perf_counter())
                turn.reply += choice["delta"].get("content") or ""
            if usage := event.get("usage"):
                turn.prompt_tokens, turn.completion_tokens = usage["prompt_tokens"], usage["completion_tokens"]
                turn.cached_tokens = (usage.get("prompt_tokens_details") or {}).get("cached_tokens")
    turn.done = time.perf_counter()


async def run_trace(url: str, model: str, trace: Trace, args: argparse.Namespace) -> tuple[list[Turn], float]:
    """Every turn of the trace, and the wall time of the whole."""
    turns: list[Turn] = []
    pending = iter(range(len(trace.users)))
    limits = httpx.Limits(max_connections=args.concurrency + 4, max_keepalive_connections=args.concurrency + 4)
    async with httpx.AsyncClient(timeout=600, limits=limits) as http:
        async def conversation(c: int) -> None:
            messages = [{"role": "system", "content": trace.system}]
            for t, user in enumerate(trace.users[c], 1):
                messages.append({"role": "user", "content": user})
                turn = Turn(c, t, list(messages))
                turns.append(turn)
                before = await phase_sums(http, url) if args.concurrency == 1 else None
                await chat_turn(http, url, model, turn, args.max_tokens)
                if before is not None:
                    after = await phase_sums(http, url)
                    turn.phases = {name: 1e3 * (after.get(name, 0.0) - before.get(name, 0.0)) for name in after}
                    if SERVER_TTFT in turn.phases:  # the rest of the client's TTFT: HTTP, the server's parsing
                        turn.phases["HTTP"] = turn.ttft * 1e3 - turn.phases.pop(SERVER_TTFT)
                messages.append({"role": "assistant", "content": turn.reply})

        async def client() -> None:
            for c in pending:  # a shared iterator: each client takes the next conversation
                await conversation(c)

        started = time.perf_counter()
        await asyncio.gather(*(client() for _ in range(args.concurrency)))
    return turns, time.perf_counter() - started


SERVER_TTFT = "server TTFT"
PHASES = ("prepare", "queue", "first step", "wire", "stream", "HTTP")


async def phase_sums(http: httpx.AsyncClient, url: str) -> dict[str, float]:
    """The server's sums (s) of shardspec_time_to_first_token_phase_seconds by phase, and of its
    time to first token (SERVER_TTFT); empty where the server has none."""
    text = (await http.get(url.removesuffix("/v1") + "/metrics")).text
    sums = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == "shardspec_time_to_first_token_phase_seconds_sum":
                sums[sample.labels["phase"]] = sample.value
            elif sample.name == "shardspec_time_to_first_token_seconds_sum":
                sums[SERVER_TTFT] = sample.value
    return sums


def reusable_tokens(turns: list[Turn], text: Text) -> tuple[list[int], int]:
    """Each turn's reusable tokens (the module docstring defines them), and how many prompts the
    client tokenized to another length than the server reported (0: the count is exact)."""
    prompts = [text.prompt_ids(turn.messages) for turn in turns]
    replies = [text.tokenizer.encode(turn.reply) for turn in turns]
    reusable = []
    for turn, ids in zip(turns, prompts):
        best = 0
        for other, other_ids, reply in zip(turns, prompts, replies):
            if other.done < turn.sent:
                best = max(best, common_prefix(ids, other_ids + reply))
            elif other.first < turn.sent:
                best = max(best, common_prefix(ids, other_ids))
        reusable.append(min(best, len(ids) - 1))
    return reusable, sum(len(ids) != turn.prompt_tokens for turn, ids in zip(turns, prompts))


def common_prefix(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    return next((i for i in range(n) if a[i] != b[i]), n)


def percentile(values: list[float], q: float) -> float:
    """Nearest-rank percentile."""
    ordered = sorted(values)
    return ordered[max(0, math.ceil(q / 100 * len(ordered)) - 1)]


def summarize(turns: list[Turn], wall: float, reusable: list[int], mismatched: int,
              metrics: dict[str, float | None], ready: str) -> dict[str, Any]:
    prompt = sum(t.prompt_tokens for t in turns)
    cached = sum(t.cached_tokens or 0 for t in turns)
    completion = sum(t.completion_tokens for t in turns)
    start = min(t.sent for t in turns)
    return {"ready_line": ready, "requests": len(turns), "wall_s": wall, "prompt_tokens": prompt,
            "completion_tokens": completion, "cached_tokens": cached,
            "cached_tokens_reported": any(t.cached_tokens is not None for t in turns),
            "reusable_tokens": sum(reusable), "reusable_prompts_mismatched": mismatched,
            "hit_rate": cached / prompt if prompt else 0.0,
            "reusable_hit_rate": cached / sum(reusable) if sum(reusable) else 0.0,
            "completion_tokens_per_s": completion / wall,
            "per_turn": per_turn(turns, reusable), "prefix_cache_metrics": metrics,
            "turns": [{"conversation": t.conversation + 1, "turn": t.turn, "sent_s": t.sent - start,
                       "ttft_ms": t.ttft * 1e3, "prompt_tokens": t.prompt_tokens, "cached_tokens": t.cached_tokens,
                       "reusable_tokens": r, "phases_ms": t.phases} for t, r in zip(turns, reusable)]}


def per_turn(turns: list[Turn], reusable: list[int]) -> dict[str, dict[str, float]]:
    """By turn index: TTFT at p50 and p95, reusable ÷ prompt tokens, cached ÷ reusable tokens."""
    rows = {}
    for index in sorted({t.turn for t in turns}):
        mine = [(t, r) for t, r in zip(turns, reusable) if t.turn == index]
        ms = [t.ttft * 1e3 for t, _ in mine]
        reused = sum(r for _, r in mine)
        rows[str(index)] = {"ttft_p50_ms": percentile(ms, 50), "ttft_p95_ms": percentile(ms, 95),
                            "reusable_share": reused / sum(t.prompt_tokens for t, _ in mine),
                            "cached_of_reusable": sum(t.cached_tokens or 0 for t, _ in mine) / reused if reused
                            else 0.0}
        if all(t.phases for t, _ in mine):
            rows[str(index)]["phases_p50_ms"] = {name: percentile([t.phases.get(name, 0.0) for t, _ in mine], 50)
                                                 for name in PHASES}
    return rows


# --- the server ---------------------------------------------------------------------------------


def step_batch_buckets(url: str) -> dict[float, float]:
    """The counts of shardspec_step_sequences's buckets (sequences a step advanced), by upper bound."""
    text = httpx.get(url.removesuffix("/v1") + "/metrics", timeout=60).text
    return {float(s.labels["le"]): s.value for f in text_string_to_metric_families(text) for s in f.samples
            if s.name == "shardspec_step_sequences_bucket"}


def largest_batch_at_least(before: dict[float, float], after: dict[float, float]) -> int:
    """A lower bound of the most sequences one step advanced between two readings of the buckets: one
    more than the largest bound below which not every new step fell (0: no step)."""
    new = {bound: after[bound] - before.get(bound, 0.0) for bound in after}
    total = new.get(float("inf"), 0.0)
    if not total:
        return 0
    below = [bound for bound, count in sorted(new.items()) if count < total]
    return int(max(below)) + 1 if below else 1


def metric_values(url: str) -> dict[str, float]:
    text = httpx.get(url.removesuffix("/v1") + "/metrics", timeout=60).text
    return {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples}


@contextlib.contextmanager
def serving(serve_args: list[str]) -> Iterator[tuple[str, str]]:
    """(base URL, ready line) of a `shardspec serve` that is stopped when the block ends, however."""
    cmd = [sys.executable, "-m", "shardspec", "serve", "--port", "0", "--host", "127.0.0.1", "--log-level", "WARNING",
           *serve_args]
    with tempfile.TemporaryDirectory(prefix="shardspec-bench-") as folder:
        log = Path(folder) / "server.log"
        with open(log, "wb") as out:
            proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        try:
            ready = wait_ready(proc, log)
            print(ready, file=sys.stderr)
            yield re.search(r"serving \S+ at (http://\S+)", ready).group(1), ready  # type: ignore[union-attr]
        finally:
            stop_server(proc)


def wait_ready(proc: subprocess.Popen, log: Path) -> str:
    deadline = time.monotonic() + 300
    while not (found := re.search(r".*serving \S+ at http://.*", log.read_text(errors="replace"))):
        if proc.poll() is not None or time.monotonic() > deadline:
            output = log.read_text(errors="replace").strip()
            if rejected := re.search(r"unrecognized arguments: (.*)", output):
                raise FlagRejected(f"this shardspec serve does not accept {rejected.group(1)}")
            raise BenchError(f"the server did not start:\n{output}")
        time.sleep(0.2)
    return found.group(0).strip()


def served_model(url: str) -> tuple[str, int]:
    """The model id and its context (max_model_len) from /v1/models."""
    card = httpx.get(f"{url}/models", timeout=60).json()["data"][0]
    return card["id"], card["max_model_len"]


def warm_up(url: str, model: str) -> None:
    """One short request unlike the trace's, so that the first turn does not pay for a cold start."""
    body = {"model": model, "prompt": "def fibonacci(n):", "max_tokens": 8, "temperature": 0}
    httpx.post(f"{url}/completions", json=body, timeout=600).raise_for_status()


# --- the trace's runs ---------------------------------------------------------------------------


def check_fits(text: Text, trace: Trace, args: argparse.Namespace, context: int) -> None:
    """The longest conversation (every reply at --max-tokens) must fit the served context."""
    messages = [{"role": "system", "content": trace.system}]
    for c, users in enumerate(trace.users):
        history = messages + [m for u in users for m in ({"role": "user", "content": u}, {"role": "assistant",
                                                                                            "content": ""})]
        longest = len(text.prompt_ids(history[:-1])) + args.turns * (args.max_tokens + 2)
        if longest > context:
            raise BenchError(f"conversation {c + 1} would reach about {longest:,} tokens, more than the served "
                             f"context of {context:,}: lower --system-tokens, --user-tokens, --turns or --max-tokens")


def trace_run(serve_args: list[str], text: Text, trace: Trace, args: argparse.Namespace) -> dict[str, Any]:
    with serving(serve_args) as (url, ready):
        model, context = served_model(url)
        check_fits(text, trace, args, context)
        warm_up(url, model)
        before = metric_values(url)
        turns, wall = asyncio.run(run_trace(url, model, trace, args))
        after = metric_values(url)
    metrics = {key: after[name] - before.get(name, 0.0) if name in after else None
               for key, name in PREFIX_METRICS.items()}
    reusable, mismatched = reusable_tokens(turns, text)
    return summarize(turns, wall, reusable, mismatched, metrics, ready)


def trace_main(args: argparse.Namespace) -> dict[str, Any]:
    text = Text(model_folder(args.serve_args))
    trace = make_trace(text, args)
    runs: dict[str, Any] = {"on": trace_run(args.serve_args, text, trace, args)}
    try:
        runs["off"] = trace_run([*args.serve_args, NO_CACHE_FLAG], text, trace, args)
    except FlagRejected as exc:
        print(f"cache off: not run: {exc} (the prefix cache cannot be turned off in this build)", file=sys.stderr)
        runs["off"] = {"error": str(exc)}
    result = {"config": config_of(args), "runs": runs}
    on = runs["on"]["per_turn"]
    result["second_turn_ttft_ratio"] = on["1"]["ttft_p50_ms"] / on["2"]["ttft_p50_ms"] if "2" in on else None
    result["cold_second_turn_ttft_ratio"] = cold_second_turn(runs["on"]["turns"])
    print_trace(result, args)
    return result


def cold_second_turn(turns: list[dict[str, Any]]) -> float | None:
    """The median over the conversations whose first turn found nothing cached of TTFT(turn 1) ÷
    TTFT(turn 2): how much sooner a turn starts when the conversation so far is cached."""
    by = {(t["conversation"], t["turn"]): t for t in turns}
    ratios = sorted(t1["ttft_ms"] / by[(c, 2)]["ttft_ms"] for (c, turn), t1 in by.items()
                    if turn == 1 and not t1["cached_tokens"] and (c, 2) in by)
    return ratios[len(ratios) // 2] if ratios else None


def config_of(args: argparse.Namespace) -> dict[str, Any]:
    return {key: value for key, value in vars(args).items() if key != "json"}


def fmt(value: float | None, spec: str = ".0f") -> str:
    return "–" if value is None else format(value, spec)


def print_trace(result: dict[str, Any], args: argparse.Namespace) -> None:
    on, off = result["runs"]["on"], result["runs"]["off"]
    off = None if "error" in off else off
    print(f"{args.conversations} conversations × {args.turns} turns, system prompt ~{args.system_tokens:,} tokens, "
          f"user messages ~{args.user_tokens}, replies {args.max_tokens} tokens, concurrency {args.concurrency}; "
          "greedy, streamed" + ("" if off else f" (cache off: {result['runs']['off']['error']})"))
    print("\n| turn | TTFT p50 on (ms) | TTFT p95 on (ms) | TTFT p50 off (ms) | TTFT p95 off (ms) | "
          "reusable (% of prompt) | cached, on (% of reusable) |")
    print("|---|---|---|---|---|---|---|")
    for index, row in on["per_turn"].items():
        other = off["per_turn"][index] if off else {}
        print(f"| {index} | {row['ttft_p50_ms']:.0f} | {row['ttft_p95_ms']:.0f} | {fmt(other.get('ttft_p50_ms'))} | "
              f"{fmt(other.get('ttft_p95_ms'))} | {100 * row['reusable_share']:.0f} | "
              f"{100 * row['cached_of_reusable']:.0f} |")
    phased = [(name, run) for name, run in (("on", on), ("off", off))
              if run and all("phases_p50_ms" in row for row in run["per_turn"].values())]
    if phased:
        print("\nwhere the time to first token goes, p50 of each phase (ms): prepare (template, tokens, checks), "
              "queue (to the prefill step's sending), first step (the slowest worker's time in it), wire (the rest "
              "of its round trip), stream (to the response), HTTP (the client's TTFT less the server's)\n")
        print("| cache | turn | " + " | ".join(PHASES) + " | TTFT p50 |")
        print("|---|---|" + "---|" * (len(PHASES) + 1))
        for name, run in phased:
            for index, row in run["per_turn"].items():
                print(f"| {name} | {index} | " + " | ".join(f"{row['phases_p50_ms'][p]:.1f}" for p in PHASES)
                      + f" | {row['ttft_p50_ms']:.1f} |")
    rows = [("prompt tokens", "prompt_tokens", ","), ("cached tokens", "cached_tokens", ","),
            ("reusable tokens", "reusable_tokens", ","), ("hit rate (cached ÷ prompt)", "hit_rate", ".1%"),
            ("hit rate of reusable (cached ÷ reusable)", "reusable_hit_rate", ".1%"),
            ("completion tokens/s", "completion_tokens_per_s", ".1f"), ("wall (s)", "wall_s", ".1f")]
    print("\n| | prefix cache on | prefix cache off |\n|---|---|---|")
    for label, key, spec in rows:
        print(f"| {label} | {format(on[key], spec)} | {format(off[key], spec) if off else '–'} |")
    for key in PREFIX_METRICS:
        print(f"| /metrics prefix-cache {key} | {fmt(on['prefix_cache_metrics'][key], ',.0f')} | "
              f"{fmt(off['prefix_cache_metrics'][key], ',.0f') if off else '–'} |")
    print(f"\nconversations whose first turn found nothing cached: median of TTFT(turn 1) ÷ TTFT(turn 2), "
          f"cache on: {fmt(result['cold_second_turn_ttft_ratio'], '.1f')}")
    print(f"second turn: median TTFT of turn 1 ÷ turn 2, cache on: {fmt(result['second_turn_ttft_ratio'], '.2f')}"
          + ("" if on["cached_tokens_reported"] else "; the server reported no cached_tokens (counted as 0)"))
    for name, run in (("on", on), ("off", off)):
        if run and run["reusable_prompts_mismatched"]:
            print(f"cache {name}: {run['reusable_prompts_mismatched']} prompts tokenized here to another length "
                  "than the server's: reusable is approximate")


# --- the sweep ----------------------------------------------------------------------------------


@dataclass
class Level:
    requests: int
    wall_s: float = 0.0
    completion_tokens: int = 0
    peak_running: int = 0
    peak_waiting: int = 0
    preemptions: float = 0.0


async def sweep_level(url: str, model: str, prompts: list[str], args: argparse.Namespace) -> Level:
    level = Level(len(prompts))
    limits = httpx.Limits(max_connections=len(prompts) + 4, max_keepalive_connections=len(prompts) + 4)
    async with httpx.AsyncClient(timeout=600, limits=limits) as http:
        async def request(prompt: str) -> int:
            body = {"model": model, "prompt": prompt, "max_tokens": args.sweep_max_tokens, "temperature": 0,
                    "ignore_eos": True}
            response = await http.post(f"{url}/completions", json=body)
            if response.status_code != 200:
                raise BenchError(f"/v1/completions answered {response.status_code}: {response.text}")
            return response.json()["usage"]["completion_tokens"]

        async def poll() -> None:
            while True:
                text = (await http.get(url.removesuffix("/v1") + "/metrics")).text
                values = {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples}
                level.peak_running = max(level.peak_running, int(values.get("shardspec_requests_running", 0)))
                level.peak_waiting = max(level.peak_waiting, int(values.get("shardspec_requests_waiting", 0)))
                await asyncio.sleep(0.1)

        poller = asyncio.create_task(poll())
        started = time.perf_counter()
        try:
            level.completion_tokens = sum(await asyncio.gather(*(request(p) for p in prompts)))
        finally:
            poller.cancel()
            await asyncio.gather(poller, return_exceptions=True)
        level.wall_s = time.perf_counter() - started
    return level


def sweep_main(args: argparse.Namespace) -> dict[str, Any]:
    text = Text(model_folder(args.serve_args))
    rng = random.Random(args.seed)
    serve_args = ([] if args.cache_memory == "default" else ["--cache-memory", args.cache_memory]) + args.serve_args
    if not any(a == "--max-seqs" or a.startswith("--max-seqs=") for a in args.serve_args):
        serve_args += ["--max-seqs", str(max(args.sweep_requests))]
    with serving(serve_args) as (url, ready):
        model, context = served_model(url)
        if args.sweep_prompt_tokens + args.sweep_max_tokens + 8 > context:
            raise BenchError(f"--sweep-prompt-tokens + --sweep-max-tokens must fit the served context of "
                             f"{context:,} tokens")
        warm_up(url, model)
        levels = []
        for n in args.sweep_requests:
            before, buckets = metric_values(url).get("shardspec_preemptions_total", 0.0), step_batch_buckets(url)
            level = asyncio.run(sweep_level(url, model, [text.cut(rng, args.sweep_prompt_tokens) for _ in range(n)],
                                            args))
            level.preemptions = metric_values(url).get("shardspec_preemptions_total", 0.0) - before
            # (a request shorter than the poll's period can slip between two polls: the steps' own count
            # of sequences bounds the peak from below)
            level.peak_running = max(level.peak_running, largest_batch_at_least(buckets, step_batch_buckets(url)))
            levels.append(level)
    capacity = CAPACITY.search(ready)
    positions, longest = (int(g.replace(",", "")) for g in capacity.groups()) if capacity else (None, None)
    result = {"config": config_of(args), "ready_line": ready, "kv_positions": positions, "max_seq_len": longest,
              "fixed_reservation_sequences": positions // longest if capacity else None,
              "sequences_of_this_length": positions // (args.sweep_prompt_tokens + args.sweep_max_tokens)
              if capacity else None,
              "levels": [asdict(level) for level in levels]}
    print_sweep(result, args)
    return result


def print_sweep(result: dict[str, Any], args: argparse.Namespace) -> None:
    fixed = result["fixed_reservation_sequences"]
    print(f"--cache-memory {args.cache_memory}: {fmt(result['kv_positions'], ',')} K/V positions a worker; a "
          f"fixed reservation of {fmt(result['max_seq_len'], ',')} positions a sequence would hold "
          f"{fmt(fixed, 'd')} sequence(s) at once; sequences of this sweep's length (prompts ~"
          f"{args.sweep_prompt_tokens:,} tokens, {args.sweep_max_tokens} generated) fit "
          f"{fmt(result['sequences_of_this_length'], 'd')} at once.")
    print("\n| requests | peak running | vs fixed reservation | peak waiting | preemptions | tokens/s | wall (s) |")
    print("|---|---|---|---|---|---|---|")
    for level in result["levels"]:
        ratio = f"{level['peak_running'] / fixed:.1f}×" if fixed else "–"
        print(f"| {level['requests']} | {level['peak_running']} | {ratio} | {level['peak_waiting']} | "
              f"{level['preemptions']:.0f} | {level['completion_tokens'] / level['wall_s']:.1f} | "
              f"{level['wall_s']:.1f} |", flush=True)


# --- the command line ---------------------------------------------------------------------------


def model_folder(serve_args: list[str]) -> Path:
    """The folder `shardspec serve` loads: SERVE-ARGS' --model, or the bundled model."""
    parser = argparse.ArgumentParser(add_help=False)
    parser.add_argument("--model", default=str(BUNDLED_MODEL))
    return Path(parser.parse_known_args(serve_args)[0].model)


def positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a positive whole number")
    return value


def memory_size(text: str) -> str:
    if text == "default":
        return text
    try:
        parse_size(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return text


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    trace = parser.add_argument_group("the trace (default mode)")
    trace.add_argument("--conversations", type=positive, default=16, metavar="C", help="conversations (default 16)")
    trace.add_argument("--turns", type=positive, default=5, metavar="T", help="turns of each (default 5)")
    trace.add_argument("--system-tokens", type=positive, default=1500, metavar="S",
                       help="the shared system prompt's length in tokens, about (default 1500)")
    trace.add_argument("--user-tokens", type=positive, default=40, metavar="U",
                       help="each user message's length in tokens, about (default 40)")
    trace.add_argument("--max-tokens", type=positive, default=48, metavar="N",
                       help="tokens of each reply, exactly: ignore_eos (default 48)")
    trace.add_argument("--concurrency", type=positive, default=4, metavar="N",
                       help="conversations at once; a conversation's turns go one after the other (default 4)")
    sweep = parser.add_argument_group("the concurrency sweep")
    sweep.add_argument("--sweep", action="store_true", help="run the sweep instead of the trace")
    sweep.add_argument("--sweep-requests", type=positive, nargs="+", default=[1, 2, 4, 8, 16, 32], metavar="N",
                       help="concurrent requests of each level (default 1 2 4 8 16 32)")
    sweep.add_argument("--cache-memory", type=memory_size, default="16MiB", metavar="SIZE",
                       help="each worker's cache, passed to serve, or 'default': serve's own (90 %% of a GPU "
                            "less its weights) (default 16MiB)")
    sweep.add_argument("--sweep-prompt-tokens", type=positive, default=1024, metavar="N",
                       help="each request's prompt length in tokens, about (default 1024)")
    sweep.add_argument("--sweep-max-tokens", type=positive, default=128, metavar="N",
                       help="tokens each request generates (default 128)")
    parser.add_argument("--seed", type=int, default=0, help="the seed of the prompts' text (default 0)")
    parser.add_argument("--json", type=Path, metavar="PATH", help="write every figure to PATH as JSON")
    parser.add_argument("--device", help="the server's workers' device, cpu, cuda or cuda:N (default: serve's, the "
                        "GPUs where there are some)")
    parser.add_argument("serve_args", nargs="*", metavar="SERVE-ARGS",
                        help="after --: arguments for `shardspec serve`, given to every server")
    args = parser.parse_args(argv)
    if args.device:
        args.serve_args = ["--device", args.device, *args.serve_args]
    if NO_CACHE_FLAG in args.serve_args:
        parser.error(f"{NO_CACHE_FLAG} is not a SERVE-ARG: the trace runs with the cache on and off by itself")
    if args.sweep and any(a.startswith("--cache-memory") for a in args.serve_args):
        parser.error("give the sweep's --cache-memory before --, not in SERVE-ARGS")
    if args.json is not None and not args.json.parent.is_dir():
        parser.error(f"--json {args.json}: the folder {args.json.parent} does not exist")
    return args


def _interrupt(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt  # SIGTERM too stops the servers on the way out


def main() -> None:
    args = parse_args()
    signal.signal(signal.SIGTERM, _interrupt)
    try:
        result = sweep_main(args) if args.sweep else trace_main(args)
    except BenchError as exc:
        raise SystemExit(f"prefix_cache.py: {exc}") from None
    except KeyboardInterrupt:
        raise SystemExit("prefix_cache.py: interrupted; the servers are stopped") from None
    if args.json is not None:
        args.json.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
