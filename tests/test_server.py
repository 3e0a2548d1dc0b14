"""`shardspec serve` as a real process on loopback, driven by the official `openai` client and httpx."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

import httpx
import openai
import pytest
import uvicorn
from prometheus_client.parser import text_string_to_metric_families
from tokenizers import Tokenizer as HFTokenizer

from shardspec.cli import BUNDLED_MODEL, main
from shardspec.orchestrator.tokenizer import Tokenizer
from shardspec.server import encoding
from shardspec.server.api import MAX_STOP_CHARS
from shardspec.server.app import Service
from shardspec.server.chat import ChatTemplate
from shardspec.server.encoding import ChatEncoder, encode_within
from shardspec.server.generation import StopText
from shardspec.server.guard import uvicorn_config
from shardspec.server.limits import DEFAULT_MAX_BODY_BYTES, MAX_HEADER_BYTES, HttpLimits
from shardspec.server.run import bind
from shardspec.testing.chat_model import CHAT_TEMPLATE, chat_tokenizer

MODEL = "shardspec-tiny-stdlib"
MAX_SLOTS = 32  # the 64-request test also overflows the cache: half of it must queue
PROMPTS = ["def fibonacci(n):", "import os\n", "class Stack:\n    def", "for i in range(", "def main():\n    ",
           "x = [", "try:\n    import", "# Copyright", "async def fetch(", "with open(", "if __name__ ==",
           "return self.", "raise ValueError(", "from typing import", "while True:\n", "lambda x:"]


@dataclass
class Server:
    proc: subprocess.Popen
    url: str  # http://127.0.0.1:PORT/v1
    log: Path

    @property
    def root(self) -> str:
        return self.url.removesuffix("/v1")

    def client(self) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.url, api_key="unused", max_retries=0, timeout=120)

    def async_client(self) -> openai.AsyncOpenAI:
        return openai.AsyncOpenAI(base_url=self.url, api_key="unused", max_retries=0, timeout=120)

    def worker_pids(self) -> list[int]:
        return [pid for pid in _pids() if _parent(pid) == self.proc.pid]

    def stop(self, sig: int = signal.SIGTERM) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode


def _pids() -> list[int]:
    return [int(name) for name in os.listdir("/proc") if name.isdigit()]


def _parent(pid: int) -> int | None:
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
    except (OSError, IndexError, ValueError):
        return None


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def start_server(folder: Path, *args: str) -> Server:
    log = folder / "server.log"
    cmd = [sys.executable, "-m", "shardspec", "serve", "--port", "0", "--log-level", "WARNING", *args]
    with open(log, "wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    server = Server(proc, "", log)
    deadline = time.monotonic() + 180
    while not (found := re.search(r"serving \S+ at (http://\S+)", log.read_text(errors="replace"))):
        if proc.poll() is not None or time.monotonic() > deadline:
            server.stop(signal.SIGKILL)
            raise RuntimeError(f"the server did not start:\n{log.read_text(errors='replace')}")
        time.sleep(0.1)
    server.url = found.group(1)
    return server


@pytest.fixture(scope="module")
def server(tmp_path_factory) -> Server:
    """The bundled model (it has a tokenizer and a chat template) on one local CPU worker."""
    started = start_server(tmp_path_factory.mktemp("server"), "--local", "1", "--max-seqs", str(MAX_SLOTS),
                           "--max-seq-len", "512")
    yield started
    assert started.stop() == 0, started.log.read_text(errors="replace")


def worker_stats(server: Server) -> list[dict]:
    return httpx.get(f"{server.url}/internal/stats", timeout=30).json()["workers"]


# --- the endpoints ---------------------------------------------------------------------------------


def test_models_lists_the_served_model_and_health_is_ok(server):
    assert [m.id for m in server.client().models.list()] == [MODEL]
    assert httpx.get(f"{server.root}/health").json() == {"status": "ok"}


def test_completions_streamed_and_not_give_the_same_greedy_text_and_fill_usage(server):
    client = server.client()
    kwargs = {"model": MODEL, "prompt": "def fibonacci(n):", "max_tokens": 20, "temperature": 0, "extra_body":
              {"ignore_eos": True}}
    whole = client.completions.create(**kwargs)
    chunks = list(client.completions.create(**kwargs, stream=True, stream_options={"include_usage": True}))
    streamed = "".join(c.choices[0].text for c in chunks if c.choices)
    prompt_tokens = len(Tokenizer.from_folder(BUNDLED_MODEL).encode("def fibonacci(n):"))
    assert whole.choices[0].text == streamed and streamed
    assert whole.choices[0].finish_reason == "length" and chunks[-2].choices[0].finish_reason == "length"
    assert whole.usage.prompt_tokens == prompt_tokens and whole.usage.completion_tokens == 20
    assert chunks[-1].usage.model_dump(include={"prompt_tokens", "completion_tokens", "total_tokens"}) == \
        whole.usage.model_dump(include={"prompt_tokens", "completion_tokens", "total_tokens"})


def test_chat_completions_streamed_and_not_give_the_same_seeded_text_and_fill_usage(server):
    client = server.client()
    messages = [{"role": "system", "content": "Python only."}, {"role": "user", "content": "a sorting function"}]
    kwargs = {"model": MODEL, "messages": messages, "max_tokens": 24, "temperature": 0.8, "top_p": 0.95,
              "seed": 7}
    whole = client.chat.completions.create(**kwargs)
    chunks = list(client.chat.completions.create(**kwargs, stream=True, stream_options={"include_usage": True}))
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    prompt = ChatTemplate.from_folder(BUNDLED_MODEL).render(messages)
    assert whole.choices[0].message.role == "assistant" and chunks[0].choices[0].delta.role == "assistant"
    assert whole.choices[0].message.content == streamed
    assert whole.usage.prompt_tokens == len(Tokenizer.from_folder(BUNDLED_MODEL).encode(prompt))
    assert whole.usage.completion_tokens == chunks[-1].usage.completion_tokens > 0


def test_chat_template_renders_as_transformers_renders_it():
    from transformers import AutoTokenizer

    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"},
                {"role": "assistant", "content": "def f(): pass"}, {"role": "user", "content": "again"}]
    expected = AutoTokenizer.from_pretrained(BUNDLED_MODEL).apply_chat_template(
        messages, tokenize=False, add_generation_prompt=True)
    assert ChatTemplate.from_folder(BUNDLED_MODEL).render(messages) == expected


def test_a_stop_string_ends_the_text_before_it(server):
    client = server.client()
    kwargs = {"model": MODEL, "prompt": "import os\n", "max_tokens": 40, "temperature": 0}
    full = client.completions.create(**kwargs).choices[0].text
    stop = full.splitlines(keepends=True)[1][:4]  # the start of the second line
    stopped = client.completions.create(**kwargs, stop=[stop])
    streamed = "".join(c.choices[0].text for c in client.completions.create(**kwargs, stop=stop, stream=True))
    assert stopped.choices[0].finish_reason == "stop"
    assert stopped.choices[0].text == streamed == full[: full.index(stop)]


def test_metrics_parse_with_the_prometheus_parser_and_count_the_work(server):
    server.client().completions.create(model=MODEL, prompt="x = [", max_tokens=8, temperature=0)
    text = httpx.get(f"{server.root}/metrics").text
    families = {f.name: f for f in text_string_to_metric_families(text)}
    value = {(f.name, s.name, tuple(sorted(s.labels.items()))): s.value for f in families.values() for s in f.samples}
    assert value[("shardspec_requests", "shardspec_requests_total",
                  (("endpoint", "/v1/completions"), ("outcome", "finished")))] >= 1
    assert value[("shardspec_generation_tokens", "shardspec_generation_tokens_total", ())] >= 8
    assert value[("shardspec_spec_decode_drafts", "shardspec_spec_decode_drafts_total", ())] >= 1
    positions = [dict(s.labels)["position"] for s in families["shardspec_spec_decode_accepted_per_position"].samples
                 if s.name.endswith("_total")]
    assert positions == ["1", "2", "3"]
    assert {"shardspec_step_seconds", "shardspec_time_to_first_token_seconds"} <= set(families)
    assert families["shardspec_step_seconds"].type == "histogram"
    assert value[("shardspec_worker_slots_total", "shardspec_worker_slots_total", (("rank", "0"),))] == MAX_SLOTS


def test_the_phases_of_the_time_to_first_token_add_up_to_it_and_none_is_negative(server):
    """Each request's time to first token is split into phases (prepare, queue, first step, wire,
    stream) on /metrics; over every request so far their sums equal the TTFT's sum."""
    server.client().completions.create(model=MODEL, prompt="def f(", max_tokens=3, temperature=0)
    text = httpx.get(f"{server.root}/metrics").text
    samples = [s for f in text_string_to_metric_families(text) for s in f.samples]
    ttft = {s.name: s.value for s in samples if s.name.startswith("shardspec_time_to_first_token_seconds")}
    phases = {(s.labels["phase"], s.name.rsplit("_", 1)[1]): s.value for s in samples
              if s.name.startswith("shardspec_time_to_first_token_phase_seconds") and "le" not in s.labels}
    names = {"prepare", "queue", "first step", "wire", "stream"}
    assert {phase for phase, _ in phases} == names
    assert all(phases[(name, "count")] == ttft["shardspec_time_to_first_token_seconds_count"] > 0 for name in names)
    assert sum(phases[(name, "sum")] for name in names) == pytest.approx(
        ttft["shardspec_time_to_first_token_seconds_sum"], rel=1e-6, abs=1e-6)
    assert phases[("first step", "sum")] > 0


def test_a_repeated_chat_reports_its_cached_prompt_tokens_in_usage_and_metrics(server):
    messages = [{"role": "system", "content": "You are a careful Python reviewer. " * 30},
                {"role": "user", "content": "def f(x): return x"}]
    client = server.client()
    first = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=4, temperature=0)
    messages += [{"role": "assistant", "content": first.choices[0].message.content},
                 {"role": "user", "content": "and g?"}]
    stream = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=4, temperature=0, stream=True,
                                            stream_options={"include_usage": True})
    second = [chunk for chunk in stream][-1].usage
    assert second.prompt_tokens_details.cached_tokens >= first.usage.prompt_tokens - 32
    assert second.prompt_tokens_details.cached_tokens < second.prompt_tokens
    text = httpx.get(f"{server.root}/metrics").text
    value = {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples}
    assert value["shardspec_prefix_cache_hits_total"] >= second.prompt_tokens_details.cached_tokens
    assert value["shardspec_prefix_cache_queries_total"] >= first.usage.prompt_tokens + second.prompt_tokens


def test_a_second_conversation_with_the_same_system_prompt_starts_where_it_ends(server):
    """The server tells the prefix cache where the system prompt's turn ends, so the first conversation
    saves a state there: the second, which parts from the first right after it, finds at least 95 % of
    the shared turn cached (all but what follows its last full block)."""
    system = {"role": "system", "content": "You review Python code for a team that ships a parser. " * 17}
    client = server.client()
    shared = client.chat.completions.create(model=MODEL, messages=[system], max_tokens=1).usage.prompt_tokens
    for i, question in enumerate(["def f(x): return x", "class A: pass"]):
        usage = client.chat.completions.create(model=MODEL, messages=[system, {"role": "user", "content": question}],
                                               max_tokens=2, temperature=0).usage
        if i == 1:
            assert usage.prompt_tokens_details.cached_tokens >= 0.95 * (shared - 3)  # (less the generation prompt)


def test_response_format_json_schema_streamed_and_not_gives_json_of_the_schema_and_a_bad_one_a_400(server):
    schema = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 9},
                                               "ok": {"type": "boolean"}},
              "required": ["n", "ok"], "additionalProperties": False}
    client, messages = server.client(), [{"role": "user", "content": "a number?"}]
    response_format = {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema, "strict": True}}
    whole = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=40, temperature=1.0, seed=3,
                                           response_format=response_format)
    streamed = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=40, temperature=1.0, seed=3,
                                              response_format=response_format, stream=True)
    text = "".join(chunk.choices[0].delta.content or "" for chunk in streamed if chunk.choices)
    value = json.loads(whole.choices[0].message.content)
    assert text == whole.choices[0].message.content and set(value) == {"n", "ok"} and 0 <= value["n"] <= 9
    choice = client.completions.create(model=MODEL, prompt="x", max_tokens=10, temperature=0,
                                       extra_body={"structured_outputs": {"choice": ["left", "right"]}})
    assert choice.choices[0].text in ("left", "right")
    with pytest.raises(openai.BadRequestError) as bad:
        client.chat.completions.create(model=MODEL, messages=messages, max_tokens=4, response_format={
            "type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object", "properties": 5}}})
    assert "does not compile" in str(bad.value) and bad.value.body["param"] == "response_format"


def test_vllm_s_stop_token_ids_special_tokens_and_stop_string_options_are_followed(server):
    client = server.client()
    free = client.completions.create(model=MODEL, prompt="def f(x):", max_tokens=12, temperature=0)
    ids = Tokenizer.from_folder(Path(BUNDLED_MODEL)).encode(free.choices[0].text)
    stopped = client.completions.create(model=MODEL, prompt="def f(x):", max_tokens=12, temperature=0,
                                        extra_body={"stop_token_ids": [ids[2]]})
    assert stopped.choices[0].finish_reason == "stop" and len(stopped.choices[0].text) < len(free.choices[0].text)
    choice = {"structured_outputs": {"choice": ["ok"]}}
    plain = client.completions.create(model=MODEL, prompt="x", max_tokens=8, temperature=0, extra_body=choice)
    special = client.completions.create(model=MODEL, prompt="x", max_tokens=8, temperature=0,
                                        extra_body={**choice, "skip_special_tokens": False})
    assert plain.choices[0].text == "ok" and special.choices[0].text == "ok<|endoftext|>"
    stop = free.choices[0].text[4:7]
    kept = client.completions.create(model=MODEL, prompt="def f(x):", max_tokens=12, temperature=0, stop=[stop],
                                     extra_body={"include_stop_str_in_output": True})
    assert kept.choices[0].text.endswith(stop) and kept.choices[0].text in free.choices[0].text
    with pytest.raises(openai.BadRequestError) as bad:
        client.completions.create(model=MODEL, prompt="x", max_tokens=4, stream_options={"include_usage": True})
    assert bad.value.body["param"] == "stream_options"
    with pytest.raises(openai.BadRequestError) as bad:
        client.completions.create(model=MODEL, prompt="x", max_tokens=4, extra_body={"stop_token_ids": [10**6]})
    assert bad.value.body["param"] == "stop_token_ids"


# --- batching, cancellation ------------------------------------------------------------------------


@pytest.mark.slow  # 64 requests one at a time, then together
def test_64_concurrent_requests_return_what_each_returns_alone_and_overflow_queues(server):
    """Greedy and seeded sampled requests mixed; 64 > --max-seqs, so half of them wait for a slot."""
    requests = [{"prompt": PROMPTS[i % 16] + " " * (i // 16), "max_tokens": 12 + i % 5,
                 **({"temperature": 0} if i % 4 else {"temperature": 0.9, "seed": i}), "stream": i % 2 == 1,
                 "extra_body": {"ignore_eos": True}} for i in range(64)]

    async def one(client: openai.AsyncOpenAI, request: dict) -> str:
        result = await client.completions.create(model=MODEL, **request)
        if not request["stream"]:
            return result.choices[0].text
        return "".join([c.choices[0].text async for c in result])

    async def run() -> tuple[list[str], list[str]]:
        async with server.async_client() as client:
            alone = [await one(client, r) for r in requests]
            together = await asyncio.gather(*(one(client, r) for r in requests))
            return alone, together

    alone, together = asyncio.run(run())
    assert together == alone
    steps = step_sequences(server)
    assert steps["+Inf"] - steps["16.0"] > 0  # some steps advanced more than 16 sequences at once ...
    assert steps["32.0"] == steps["+Inf"]  # ... and none more than the slots: the rest waited


def step_sequences(server: Server) -> dict[str, float]:
    """Cumulative bucket counts of the sequences-per-step histogram, by upper bound."""
    family = next(f for f in text_string_to_metric_families(httpx.get(f"{server.root}/metrics").text)
                  if f.name == "shardspec_step_sequences")
    return {s.labels["le"]: s.value for s in family.samples if s.name.endswith("_bucket")}


def test_a_client_that_disconnects_mid_stream_frees_its_slot(server):
    body = {"model": MODEL, "prompt": "def parse(", "max_tokens": 400, "stream": True, "ignore_eos": True}
    with httpx.Client(timeout=60) as http, http.stream("POST", f"{server.url}/completions", json=body) as response:
        lines = response.iter_lines()
        while next(lines) == "" or len(worker_stats(server)[0]["live_sequences"]) == 0:
            pass  # until the sequence is live and streaming
        # the connection is closed here, mid-stream
    deadline = time.monotonic() + 60
    while (stats := worker_stats(server)[0])["live_sequences"] and time.monotonic() < deadline:
        time.sleep(0.05)
    assert stats["live_sequences"] == [] and stats["slots_free"] == stats["slots_total"] == MAX_SLOTS


# --- bad input -------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("path", "body", "status", "param"),
    [
        ("/completions", b"{not json", 400, None),
        ("/completions", b"[1, 2]", 400, None),
        ("/completions", b'{"model": "gpt-4", "prompt": "x"}', 404, "model"),
        ("/completions", b'{"prompt": "x", "max_tokens": 100000}', 400, "max_tokens"),
        ("/completions", b'{"prompt": "x", "max_tokens": 0}', 400, "max_tokens"),
        ("/completions", b'{"prompt": "x", "temperature": -0.5}', 400, "temperature"),
        ("/completions", b'{"prompt": "x", "temperature": "hot"}', 400, "temperature"),
        ("/completions", b'{"prompt": "x", "top_p": 0}', 400, "top_p"),
        ("/completions", b'{"prompt": "x", "top_k": -1}', 400, "top_k"),
        ("/completions", b'{"prompt": "x", "seed": -3}', 400, "seed"),
        ("/completions", b'{"prompt": "x", "n": 0}', 400, "n"),
        ("/completions", b'{"prompt": "x", "n": 129}', 400, "n"),
        ("/completions", b'{"prompt": ["x", "y", "z"], "n": 43}', 400, "n"),
        ("/completions", b'{"prompt": [[1], []]}', 400, "prompt"),
        ("/completions", b'{"prompt": "x", "presence_penalty": 2.5}', 400, "presence_penalty"),
        ("/completions", b'{"prompt": "x", "frequency_penalty": -2.1}', 400, "frequency_penalty"),
        ("/chat/completions", b'{"messages": [{"role": "user", "content": "x"}], "repetition_penalty": 0}', 400,
         "repetition_penalty"),
        ("/completions", b'{"prompt": "x", "repetition_penalty": 1e-39}', 400, "repetition_penalty"),
        ("/completions", b'{"prompt": "x", "logprobs": 21}', 400, "logprobs"),
        ("/completions", b'{"prompt": "x", "logprobs": -1}', 400, "logprobs"),
        ("/completions", b'{"prompt": "x", "max_tokens": 0}', 400, "max_tokens"),
        ("/chat/completions", b'{"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}', 400,
         "top_logprobs"),
        ("/chat/completions", b'{"messages": [{"role": "user", "content": "x"}], "logprobs": true, '
                              b'"top_logprobs": 21}', 400, "top_logprobs"),
        ("/completions", b'{"prompt": ""}', 400, "prompt"),
        ("/completions", b'{"prompt": [1, 99999]}', 400, "prompt"),
        ("/completions", b'{"prompt": {"text": "x"}}', 400, "prompt"),
        ("/completions", b'{"max_tokens": 4}', 400, "prompt"),
        ("/completions", b'{"prompt": "x", "stop": ["a", "b", "c", "d", "e"]}', 400, "stop"),
        ("/completions", b'{"prompt": "x", "stop": "' + b"s" * 1025 + b'"}', 400, "stop"),
        ("/chat/completions", b'{"messages": []}', 400, "messages"),
        ("/chat/completions", b'{"messages": [' + b", ".join([b'{"role": "user", "content": "x"}'] * 2049) + b"]}",
         400, "messages"),
        ("/chat/completions", b'{"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}', 400,
         "messages[0].content"),
        ("/chat/completions", b'{"messages": [{"role": "user", "content": "x"}], "max_tokens": 100000}', 400,
         "max_tokens"),
        ("/chat/completions", b'{"messages": [{"role": "user", "content": "x"}], "stream": true, '
                              b'"temperature": 9}', 400, "temperature"),
        ("/nowhere", b"{}", 404, None),
    ],
)
def test_bad_requests_get_an_openai_error_object_with_a_4xx(server, path, body, status, param):
    response = httpx.post(f"{server.url}{path}", content=body, headers={"Content-Type": "application/json"})
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    assert error["param"] == param
    assert "Traceback" not in response.text


EXTREME_VALUES = [
    {"repetition_penalty": 1e-39}, {"repetition_penalty": 100}, {"temperature": 1e-4}, {"temperature": 2},
    {"temperature": 1.0, "top_p": 1e-6}, {"temperature": 1.0, "top_k": 1}, {"presence_penalty": 2},
    {"frequency_penalty": -2}, {"logit_bias": {"17": 100, "42": -100}}, {"logprobs": 5},
    {"temperature": 1.0, "seed": 2**63 - 1}, {"max_tokens": 1}, {"temperature": 9},  # (the last: a 400)
]


@pytest.mark.slow
def test_twenty_streams_all_finish_while_200_requests_each_bring_one_extreme_value(server):
    """Issue 45's acceptance: 0 streams lost, 0 responses of 500 or more."""

    async def stream(http: httpx.AsyncClient) -> str | None:
        finish = None
        async with http.stream("POST", f"{server.url}/completions", json={
                "model": MODEL, "prompt": "def fibonacci(n):", "max_tokens": 48, "temperature": 0,
                "stream": True}) as reply:
            async for line in reply.aiter_lines():
                if line.startswith("data: {"):
                    finish = json.loads(line[6:])["choices"][0]["finish_reason"] or finish
        return finish

    async def extremes(http: httpx.AsyncClient) -> list[int]:
        statuses = []
        for i in range(200):
            body = {"model": MODEL, "prompt": "class A:", "max_tokens": 8, **EXTREME_VALUES[i % len(EXTREME_VALUES)]}
            statuses.append((await http.post(f"{server.url}/completions", json=body)).status_code)
        return statuses

    async def run():
        async with httpx.AsyncClient(timeout=300) as http:
            return await asyncio.gather(extremes(http), *(stream(http) for _ in range(20)))

    statuses, *finishes = asyncio.run(run())
    assert finishes == ["length"] * 20
    assert max(statuses) < 500 and statuses.count(400) >= 200 // len(EXTREME_VALUES), sorted(set(statuses))


def test_the_openai_client_raises_its_own_errors_for_bad_requests(server):
    client = server.client()
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        client.completions.create(model="gpt-4", prompt="x")
    with pytest.raises(openai.BadRequestError, match="exceeds the context"):
        client.completions.create(model=MODEL, prompt="x", max_tokens=600)


# --- lifecycle: signals and dead workers -----------------------------------------------------------


def test_sigint_stops_the_server_and_its_workers(tiny_model, tmp_path):
    server = start_server(tmp_path, "--model", str(tiny_model), "--local", "2", "--max-seq-len", "128")
    workers = server.worker_pids()
    reply = server.client().completions.create(model=tiny_model.name, prompt=[1, 2, 3], max_tokens=4)
    assert reply.usage.completion_tokens == 4 and len(workers) == 2
    assert server.stop(signal.SIGINT) == 0
    assert not [pid for pid in workers if _alive(pid)]
    with pytest.raises(httpx.ConnectError):
        httpx.get(f"{server.root}/health")


def test_a_signal_ends_the_requests_in_flight_with_an_error_they_can_read_and_no_traceback(tiny_model, tmp_path):
    server = start_server(tmp_path, "--model", str(tiny_model), "--local", "1", "--max-seq-len", "1024",
                          "--max-seqs", "1", "--shutdown-timeout", "0")
    # (1,000 tokens: seconds of decoding, so that the stream is still running when the signal comes)
    body = {"model": tiny_model.name, "prompt": [1, 2, 3], "max_tokens": 1000, "ignore_eos": True}
    queued: dict[str, httpx.Response] = {}
    with httpx.Client(timeout=60) as http, http.stream("POST", f"{server.url}/completions",
                                                       json={**body, "stream": True}) as stream:
        lines = stream.iter_lines()
        assert next(line for line in lines if line.startswith("data: "))  # running: one token out
        waiting = threading.Thread(target=lambda: queued.update(reply=httpx.post(
            f"{server.url}/completions", json=body, timeout=60)))  # (one slot: it waits behind the stream)
        waiting.start()
        deadline = time.monotonic() + 30
        while not _waiting(server) and time.monotonic() < deadline:
            time.sleep(0.02)
        server.proc.send_signal(signal.SIGINT)
        rest = [line.removeprefix("data: ") for line in lines if line.startswith("data: ")]
        waiting.join(60)
    assert rest[-1] == "[DONE]" and json.loads(rest[-2])["error"]["code"] == "shutting_down", rest[-3:]
    reply = queued["reply"]
    assert reply.status_code == 503 and reply.json()["error"]["code"] == "shutting_down"
    assert server.stop() == 0
    assert "Traceback" not in server.log.read_text(errors="replace")


def _waiting(server: Server) -> int:
    """Requests queued for a slot, from the server's /metrics."""
    families = text_string_to_metric_families(httpx.get(f"{server.root}/metrics").text)
    return int(next(f for f in families if f.name == "shardspec_requests_waiting").samples[0].value)


def test_dead_workers_give_503_with_a_one_line_reason_and_the_server_still_stops(tiny_model, tmp_path):
    server = start_server(tmp_path, "--model", str(tiny_model), "--local", "1", "--max-seq-len", "128")
    try:
        for pid in server.worker_pids():
            os.kill(pid, signal.SIGKILL)
        deadline = time.monotonic() + 30
        while (health := httpx.get(f"{server.root}/health")).status_code == 200 and time.monotonic() < deadline:
            time.sleep(0.05)
        reply = httpx.post(f"{server.url}/completions", json={"prompt": [1, 2], "max_tokens": 2})
        assert health.status_code == reply.status_code == 503
        for message in (health.json()["error"]["message"], reply.json()["error"]["message"]):
            assert message.startswith("the model's workers are unavailable: ") and "exited" in message
            assert "\n" not in message and "Traceback" not in message and len(message) < 300
        assert "the model's workers are unavailable" in server.log.read_text()
    finally:
        assert server.stop() == 0


# --- hardening: what one bad or hostile client can cost the others ------------------------------------


def test_out_of_range_sampling_values_get_400_naming_them_and_a_running_stream_is_unharmed(server):
    """Each value is beyond what the workers accept; sent on, a worker would fail the whole step."""
    body = {"prompt": "def parse(", "max_tokens": 64, "stream": True, "ignore_eos": True,
            "stream_options": {"include_usage": True}}
    bad = {"top_k": 2**31, "seed": 2**63, "temperature": 1e-5, "top_p": 1e-9, "max_tokens": 2**40}
    with httpx.Client(timeout=60) as http, http.stream("POST", f"{server.url}/completions", json=body) as stream:
        lines = stream.iter_lines()
        assert next(lines).startswith("data: ")  # the stream runs
        for param, value in bad.items():
            reply = http.post(f"{server.url}/completions", json={"prompt": "x", param: value})
            assert reply.status_code == 400 and reply.json()["error"]["param"] == param, reply.text
        events = [json.loads(line[6:]) for line in lines if line.startswith("data: {")]
    assert not [e for e in events if "error" in e]
    assert events[-2]["choices"][0]["finish_reason"] == "length" and events[-1]["usage"]["completion_tokens"] == 64


def test_a_prompt_is_counted_against_the_context_as_it_is_tokenized(monkeypatch):
    """encode_within gives the whole text's ids when they fit and None when they do not, around the
    limit; a 4 MiB prompt is refused after tokenizing a few contexts' worth of it, not all of it."""
    tokenizer = Tokenizer.from_folder(BUNDLED_MODEL)
    rng = __import__("random").Random(3)
    words = ["def", "return", "x", "+", "1", "(", ")", ":", "\n", "    ", "🙂", "naïve", "0x1F", "self.value"]
    for n in (10, 200, 1500, 4000):
        text = " ".join(rng.choice(words) for _ in range(n))
        ids = tokenizer.inner.encode(text, add_special_tokens=False).ids
        for limit in (len(ids) - 1, len(ids), len(ids) + 1, len(ids) // 3, 2 * len(ids)):
            assert encode_within(tokenizer, text, limit) == (ids if len(ids) <= limit else None), (n, limit)
    tokenized = []
    encode = encoding.encode_without_the_gil
    monkeypatch.setattr(encoding, "encode_without_the_gil", lambda t, x: tokenized.append(len(x)) or encode(t, x))
    huge = "def f(x):\n    return x + 1\n" * 150_000  # 4.2 MB
    assert encode_within(tokenizer, huge, 2048) is None
    assert sum(tokenized) < 64 * 2048, tokenized


def qwen_chat() -> tuple[Tokenizer, ChatTemplate, set[str]]:
    """The chat model's tokenizer (Qwen3.5's added tokens), template and added tokens' texts."""
    tokenizer = Tokenizer(HFTokenizer.from_str(json.dumps(chat_tokenizer())))
    return tokenizer, ChatTemplate(CHAT_TEMPLATE, {"eos_token": "<|im_end|>"}), {
        t.content for t in tokenizer.inner.get_added_tokens_decoder().values()}


@pytest.fixture()
def tokenized(monkeypatch) -> list[str]:
    """The texts the chat encoder tokenizes, in order."""
    texts: list[str] = []
    encode = encoding.encode_without_the_gil
    monkeypatch.setattr(encoding, "encode_without_the_gil", lambda t, x: texts.append(x) or encode(t, x))
    return texts


def test_a_conversation_s_next_turn_does_not_tokenize_its_long_messages_again(tokenized):
    """ChatEncoder keeps the ids of the pieces between the template's added tokens: the second turn of
    a conversation with a long system prompt does not tokenize it again, and gives its whole text's ids."""
    tokenizer, chat, added = qwen_chat()
    system = "You answer in one line, citing the manual. " * 400
    turn_1 = [{"role": "system", "content": system}, {"role": "user", "content": "How do I list files?"}]
    turn_2 = [*turn_1, {"role": "assistant", "content": "Use ls."}, {"role": "user", "content": "And hidden ones?"}]
    encoder = ChatEncoder(tokenizer)
    assert encoder.piecewise
    for messages in (turn_1, turn_2):
        tokenized.clear()
        prompt = chat.render_request(messages, None, None, added)
        assert encoder.encode(prompt, 100_000) == tokenizer.encode(prompt.marked)
    assert "And hidden ones?" in "".join(tokenized) and not any("citing the manual" in text for text in tokenized)
    assert sum(map(len, tokenized)) < 200
    assert encoder.encode(prompt, len(tokenizer.encode(prompt.marked)) - 1) is None  # kept pieces count too


def test_kept_chat_pieces_serve_only_their_own_cache_salt(tokenized):
    """A tenant cannot time whether another sent a text: pieces are kept per cache salt, and not at all
    for /tokenize's kind of call (keep=False)."""
    tokenizer, chat, added = qwen_chat()
    prompt = chat.render_request([{"role": "system", "content": "Secret plan: " + "x y " * 200},
                                  {"role": "user", "content": "hi"}], None, None, added)
    encoder = ChatEncoder(tokenizer)
    for salt, keep, tokenizes_it in (("a", True, True), ("a", True, False), ("b", True, True), (None, False, True),
                                     ("a", False, True)):
        tokenized.clear()
        assert encoder.encode(prompt, 10_000, salt, keep) == tokenizer.encode(prompt.marked)
        assert any("Secret plan" in text for text in tokenized) == tokenizes_it, (salt, keep)
    assert {salt for salt, _ in encoder.kept} == {"a", "b"}


def test_a_tokenizer_whose_added_tokens_strip_spaces_tokenizes_chat_prompts_whole(tokenized):
    """Where the pieces' ids would not be the whole text's (here <|im_start|> takes the newline after
    it: rstrip), a prompt is tokenized whole and nothing is kept."""
    config = chat_tokenizer()
    for token in config["added_tokens"]:
        token["rstrip"] = token["content"] == "<|im_start|>"
    tokenizer = Tokenizer(HFTokenizer.from_str(json.dumps(config)))
    _, chat, added = qwen_chat()
    encoder = ChatEncoder(tokenizer)
    assert not encoder.piecewise
    prompt = chat.render_request([{"role": "system", "content": "Be brief. " * 60}, {"role": "user", "content": "hi"}],
                                 None, None, added)
    for _ in range(2):
        assert encoder.encode(prompt, 10_000) == tokenizer.encode(prompt.marked)
    assert not encoder.kept and tokenized[-1] == prompt.marked


def test_the_kept_chat_pieces_stay_within_their_bound():
    """The least recently used pieces go first; a piece of more than an eighth of the bound is not kept;
    the bound counts the Python objects an entry holds."""
    tokenizer, chat, added = qwen_chat()
    encoder = ChatEncoder(tokenizer, kept_bytes=40_000)

    def encode(content: str) -> None:
        prompt = chat.render_request([{"role": "user", "content": content}], None, None, added)
        assert encoder.encode(prompt, 10_000) == tokenizer.encode(prompt.marked)
        held = sum(sys.getsizeof(text) + 4 * len(ids) + encoding.ENTRY_BYTES for (_, text), ids in encoder.kept.items())
        assert encoder.holds == held <= 40_000

    for i in range(60):
        encode(f"question {i}: " + "why? " * (60 + i % 5))
        if i >= 30:
            encode("question 0: " + "why? " * 60)  # used again and again: stays
    kept = "".join(text for _, text in encoder.kept)
    assert "question 59:" in kept and "question 0:" in kept and "question 1:" not in kept
    encode("why? " * 1200)  # 6,000 characters: over 40,000 / 8
    assert "why? " * 1200 not in "".join(text for _, text in encoder.kept)


def test_twelve_4_mib_prompts_at_once_are_refused_and_leave_the_servers_memory_as_it_was(server):
    """Each prompt is 1.2M tokens: counted against the context as it is tokenized, each is refused
    after a few contexts' worth, so the server neither holds gigabytes at its peak nor keeps them."""
    prompt = "def f(x):\n    return x + 1\n" * 140_000  # 3.9 MiB, within the body limit of 4 MiB

    def rss() -> int:
        status = Path(f"/proc/{server.proc.pid}/status").read_text()
        return int(re.search(r"VmRSS:\s+(\d+) kB", status).group(1)) << 10

    async def run() -> list[httpx.Response]:
        async with httpx.AsyncClient(timeout=120) as http:
            return await asyncio.gather(*(http.post(f"{server.url}/completions", json={"prompt": prompt})
                                          for _ in range(12)))

    before = rss()
    replies = asyncio.run(run())
    assert all(r.status_code == 400 and "does not fit the context" in r.json()["error"]["message"] for r in replies)
    assert rss() - before < 400 << 20, (before, rss())
    assert httpx.get(f"{server.root}/health").json() == {"status": "ok"}


def _raw(server: Server, data: bytes) -> bytes:
    """Send `data` on a fresh connection and return everything the server answers until it closes."""
    host, port = server.root.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=60) as conn:
        conn.sendall(data)
        return b"".join(iter(lambda: conn.recv(65536), b""))


def test_a_body_over_the_limit_gets_413_by_its_length_or_as_it_streams(server):
    head = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
    too_big = DEFAULT_MAX_BODY_BYTES + 1
    by_length = _raw(server, head + b"Content-Length: %d\r\n\r\n" % too_big)  # refused before the body is sent
    chunked = _raw(server, head + b"Transfer-Encoding: chunked\r\n\r\n%x\r\n" % too_big + b"x" * too_big)
    for reply in (by_length, chunked):
        assert reply.startswith(b"HTTP/1.1 413 "), reply[:200]
        assert json.loads(reply.split(b"\r\n\r\n", 1)[1])["error"]["message"].startswith("the request body exceeds")
    assert httpx.get(f"{server.root}/health").status_code == 200


@pytest.mark.parametrize("content_type", ["text/plain", "application/x-www-form-urlencoded", None])
def test_a_body_not_sent_as_json_gets_415(server, content_type):
    headers = {"Content-Type": content_type} if content_type else {}
    reply = httpx.post(f"{server.url}/completions", content=b'{"prompt": "x"}', headers=headers)
    assert reply.status_code == 415 and "application/json" in reply.json()["error"]["message"]


@pytest.mark.parametrize(("pieces", "stops", "emitted", "stopped"), [
    (["x ab", "c", "e y"], ["abcd"], ["x ", "", "abce y"], False),  # held back while it may become a stop
    (["x ab", "cd y"], ["bcd", "zz"], ["x a", ""], True),
    (["qaba", "ab"], ["aabx"], ["qab", ""], False),  # "aba" cannot start the stop, "a" can
])
def test_stop_text_holds_back_only_what_may_start_a_stop(pieces, stops, emitted, stopped):
    text = StopText(stops)
    results = [text.feed(piece) for piece in pieces]
    assert [out for out, _ in results] == emitted and results[-1][1] == stopped


def test_stop_matching_time_is_linear_in_the_text():
    """Four stops of the longest length allowed, over 20,000 pieces that each could still begin one."""
    stops = ["a" * (MAX_STOP_CHARS - 1) + end for end in "bcde"]
    text, start = StopText(stops), time.perf_counter()
    out = "".join(text.feed("a")[0] for _ in range(20_000))
    emitted, stopped = text.feed("c")
    assert stopped and len(out + emitted) == 20_000 - (MAX_STOP_CHARS - 1)
    assert time.perf_counter() - start < 5  # matching the whole tail again each piece: minutes


async def echo_body_size(scope, receive, send):
    body = (await receive())["body"]
    await send({"type": "http.response.start", "status": 200, "headers": []})
    await send({"type": "http.response.body", "body": b"%d" % len(body)})


@contextlib.contextmanager
def guarded(app) -> Iterator[tuple[uvicorn.Server, str]]:
    """uvicorn on a socket of run.bind, configured as `serve` configures it (read timeout 0.5 s): the
    server and its host:port."""
    sock = bind("127.0.0.1", 0)
    server = uvicorn.Server(uvicorn_config(app, HttpLimits(read_timeout_s=0.5), log_level="warning"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]})
    thread.start()
    try:
        while not server.started and thread.is_alive():
            time.sleep(0.01)
        yield server, f"127.0.0.1:{sock.getsockname()[1]}"
    finally:
        server.should_exit = True
        thread.join()
        sock.close()


@pytest.fixture()
def guarded_server() -> Iterator[str]:
    """A guarded uvicorn over an app that echoes the body size."""
    with guarded(echo_body_size) as (_, address):
        yield address


def test_the_server_s_connections_send_each_write_at_once():
    # Nagle's algorithm holds a small write while an earlier one is unacknowledged: a stream's first
    # event, written right after its headers, waited for the client's delayed ACK (~40 ms) on a
    # kept-alive connection. asyncio turns it off only on sockets made with IPPROTO_TCP (run.bind's).
    with guarded(echo_body_size) as (server, address), httpx.Client() as client:
        for _ in range(2):  # (the second on the kept-alive connection)
            assert client.post(f"http://{address}/", json={}).text == "2"
        sockets = [c.transport.get_extra_info("socket") for c in server.server_state.connections]
        assert len(sockets) == 1 and sockets[0].getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY)


def test_a_half_sent_request_is_closed_after_the_read_timeout(guarded_server):
    host, port = guarded_server.split(":")
    with socket.create_connection((host, int(port)), timeout=30) as conn:
        conn.sendall(b"POST / HTTP/1.1\r\nHost: x\r\n")
        with pytest.raises(OSError):  # slowloris: a byte at a time never completes the headers
            for _ in range(600):  # 30 s
                conn.sendall(b"X")
                time.sleep(0.05)
    body, headers = b'{"a": 1}', {"Content-Type": "application/json"}
    assert httpx.post(f"http://{guarded_server}/", content=body, headers=headers).text == "8"  # the next is served


def _raw_reply(address: str, *pieces: bytes) -> tuple[int, dict]:
    """The status and JSON body the server answers to `pieces` sent on one connection, 0.3 s apart."""
    host, port = address.split(":")
    with socket.create_connection((host, int(port)), timeout=30) as conn:
        for i, piece in enumerate(pieces):
            time.sleep(0.3 * (i > 0))
            conn.sendall(piece)
        reply = b"".join(iter(lambda: conn.recv(65536), b""))  # ends: the server closed the connection
    head, _, body = reply.partition(b"\r\n\r\n")
    assert b"content-type: application/json" in head.lower()
    return int(head.split()[1]), json.loads(body)


@pytest.mark.parametrize("method", ["POST", "GET"])
def test_headers_over_the_limit_are_refused_with_431_whether_they_come_whole_or_in_pieces(guarded_server, method):
    headers = {"Content-Type": "application/json", "X-Big": "x" * (MAX_HEADER_BYTES + 1)}
    reply = httpx.request(method, f"http://{guarded_server}/", content=b"{}", headers=headers)
    assert reply.status_code == 431 and "headers" in reply.json()["error"]["message"]
    # (past h11's bound before they end: h11 stops reading them)
    start = method.encode() + b" / HTTP/1.1\r\nHost: x\r\nX-Big: " + b"x" * (MAX_HEADER_BYTES + 64)
    status, body = _raw_reply(guarded_server, start, b"\r\n\r\n")
    assert status == 431 and "headers" in body["error"]["message"]
    assert httpx.post(f"http://{guarded_server}/", json={}).text == "2"  # (within it: served)


def test_a_request_that_is_not_http_gets_a_400_error_object(guarded_server):
    status, body = _raw_reply(guarded_server, b"POST / HTTP/1.1\r\nHost x\r\n\r\n")  # (a header without its colon)
    assert status == 400 and "HTTP" in body["error"]["message"]
    assert httpx.post(f"http://{guarded_server}/", json={}).text == "2"


@pytest.mark.parametrize("method", [b"POST", b"GET"])
def test_a_half_sent_body_gets_408_and_its_connection_closed(guarded_server, method):
    host, port = guarded_server.split(":")
    with socket.create_connection((host, int(port)), timeout=30) as conn:
        conn.sendall(method + b" / HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: 9\r\n\r\n{")
        reply = b"".join(iter(lambda: conn.recv(65536), b""))  # ends: the server closed the connection
    assert reply.startswith(b"HTTP/1.1 408 ")


@pytest.mark.parametrize("option", ["--max-body-bytes=0", "--read-timeout=-1", "--max-connections=0"])
def test_serve_refuses_a_limit_below_one_naming_the_option(option, capsys):
    assert main(["serve", option]) == 2
    assert option.split("=")[0] in capsys.readouterr().err


def test_a_503_body_has_the_failure_s_first_line_and_the_log_has_the_worker_s_log_tail(caplog):
    failure = ("local worker 0 exited with code 1 after 3 restarts:\nTraceback (most recent call last):\n"
               '  File "daemon.py", line 9, in load\nOSError: /secret/model/config.json')
    service = Service(SimpleNamespace(draft_tokens=0, observer=None, tokenizer=None, stopping=None), MODEL, None)
    with caplog.at_level(logging.ERROR, logger="shardspec.server"):
        error = service.unavailable(failure)
    assert error.status == 503 and error.body()["error"]["code"] == "workers_unavailable"
    assert error.message == "the model's workers are unavailable: local worker 0 exited with code 1 after 3 restarts"
    assert "OSError: /secret/model/config.json" in caplog.text


# --- what the server refuses: every OpenAI parameter it does not implement -------------------------

CHAT = {"messages": [{"role": "user", "content": "hi"}]}


@pytest.mark.parametrize(
    ("endpoint", "kwargs", "param"),
    [
        ("completions", {"best_of": 2}, "best_of"),
        ("completions", {"suffix": "x"}, "suffix"),
        ("completions", {"logit_bias": {"1": "high"}}, "logit_bias"),
        ("completions", {"extra_body": {"response_format": {"type": "xml"}}}, "response_format"),
        ("completions", {"extra_body": {"guided_json": {}}}, "guided_json"),
        ("chat", {"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format"),
        ("chat", {"tools": [{"type": "function", "function": {"name": "f"}}]}, "tools"),
        ("chat", {"tool_choice": "required"}, "tool_choice"),
        ("chat", {"functions": [{"name": "f"}]}, "functions"),
        ("chat", {"function_call": {"name": "f"}}, "function_call"),
        ("chat", {"logit_bias": {"99999": 5}}, "logit_bias"),
        ("chat", {"modalities": ["text", "audio"]}, "modalities"),
        ("chat", {"audio": {"voice": "alloy", "format": "wav"}}, "audio"),
        ("chat", {"prediction": {"type": "content", "content": "x"}}, "prediction"),
        ("chat", {"reasoning_effort": "low"}, "reasoning_effort"),
        ("chat", {"store": True}, "store"),
        ("chat", {"metadata": {"a": "b"}}, "metadata"),
        ("chat", {"service_tier": "flex"}, "service_tier"),
        ("chat", {"web_search_options": {}}, "web_search_options"),
        ("chat", {"stream": True, "stream_options": {"include_usage": True, "continuous_usage_stats": True}},
         "stream_options.continuous_usage_stats"),
        ("chat", {"extra_body": {"min_p": 0.1}}, "min_p"),
    ],
)
def test_a_parameter_the_server_does_not_implement_gets_400_naming_it(server, endpoint, kwargs, param):
    client = server.client()
    with pytest.raises(openai.BadRequestError) as caught:
        if endpoint == "completions":
            client.completions.create(model=MODEL, prompt="x", max_tokens=2, **kwargs)
        else:
            client.chat.completions.create(model=MODEL, max_tokens=2, **CHAT, **kwargs)
    assert caught.value.status_code == 400
    assert caught.value.body["param"] == param, caught.value.body


@pytest.mark.parametrize(
    "kwargs",
    [{"response_format": {"type": "text"}}, {"tool_choice": "none"}, {"user": "me"}, {"store": False},
     {"parallel_tool_calls": False}, {"modalities": ["text"]}, {"service_tier": "auto"}],
)
def test_a_parameter_at_its_harmless_value_is_accepted(server, kwargs):
    reply = server.client().chat.completions.create(model=MODEL, max_tokens=2, temperature=0, **CHAT, **kwargs)
    assert reply.choices[0].finish_reason in ("length", "stop")


# --- several prompts, several choices --------------------------------------------------------------


def _streamed_choices(stream) -> tuple[dict[int, str], dict[int, str], dict | None]:
    """(text by index, finish reason by index, usage) of a streamed response."""
    texts: dict[int, str] = {}
    finishes: dict[int, str] = {}
    use = None
    for chunk in stream:
        use = chunk.usage or use
        for choice in chunk.choices:
            delta = getattr(choice, "delta", None)
            piece = getattr(choice, "text", None) or (delta.content if delta is not None else None) or ""
            texts[choice.index] = texts.get(choice.index, "") + piece
            if choice.finish_reason:
                finishes[choice.index] = choice.finish_reason
    return texts, finishes, use


def test_a_list_of_prompts_gives_one_choice_per_prompt_each_as_it_is_alone(server):
    client = server.client()
    ids = Tokenizer.from_folder(BUNDLED_MODEL).encode("class Stack:")
    prompts = ["def fibonacci(n):", "import os\n"]
    kwargs = {"model": MODEL, "max_tokens": 12, "temperature": 0}
    alone = [client.completions.create(prompt=p, **kwargs) for p in [*prompts, ids]]
    together = client.completions.create(prompt=prompts, **kwargs)
    assert [c.index for c in together.choices] == [0, 1]
    assert [c.text for c in together.choices] == [r.choices[0].text for r in alone[:2]]
    assert together.usage.prompt_tokens == sum(r.usage.prompt_tokens for r in alone[:2])
    assert together.usage.completion_tokens == sum(r.usage.completion_tokens for r in alone[:2])
    as_ids = client.completions.create(prompt=[ids, ids], **kwargs)
    assert [c.text for c in as_ids.choices] == [alone[2].choices[0].text] * 2


def test_n_sampled_choices_differ_and_choice_0_is_the_request_alone(server):
    client = server.client()
    kwargs = {"model": MODEL, "prompt": "def parse(", "max_tokens": 16, "temperature": 1.0, "seed": 11}
    alone = client.completions.create(**kwargs)
    three = client.completions.create(n=3, **kwargs)
    texts = [c.text for c in three.choices]
    assert [c.index for c in three.choices] == [0, 1, 2]
    assert texts[0] == alone.choices[0].text
    assert len(set(texts)) == 3, texts
    assert three.usage.prompt_tokens == alone.usage.prompt_tokens  # the prompt counts once
    assert three.usage.completion_tokens == 3 * 16
    again = client.completions.create(n=3, **kwargs)
    assert [c.text for c in again.choices] == texts  # seeded: the same choices again


def test_prompts_times_n_streamed_give_the_texts_not_streamed_by_index_with_usage_summed(server):
    client = server.client()
    kwargs = {"model": MODEL, "prompt": ["def parse(", "x = ["], "n": 2, "max_tokens": 10, "temperature": 0.8,
              "seed": 3}
    whole = client.completions.create(**kwargs)
    texts, finishes, use = _streamed_choices(client.completions.create(
        stream=True, stream_options={"include_usage": True}, **kwargs))
    assert texts == {c.index: c.text for c in whole.choices} and len(texts) == 4
    assert finishes == {c.index: c.finish_reason for c in whole.choices}
    assert use.completion_tokens == whole.usage.completion_tokens
    assert use.prompt_tokens == whole.usage.prompt_tokens


def test_chat_with_n_streamed_and_not_gives_n_seeded_choices(server):
    client = server.client()
    kwargs = {"model": MODEL, **CHAT, "n": 2, "max_tokens": 8, "temperature": 1.0, "seed": 5}
    whole = client.chat.completions.create(**kwargs)
    assert [c.index for c in whole.choices] == [0, 1]
    texts, _, _ = _streamed_choices(client.chat.completions.create(stream=True, **kwargs))
    assert texts == {c.index: c.message.content for c in whole.choices}


# --- log-probabilities -----------------------------------------------------------------------------


def test_completion_logprobs_streamed_and_not_are_the_same_in_openai_s_shape(server):
    client = server.client()
    kwargs = {"model": MODEL, "prompt": "def fibonacci(n):", "max_tokens": 12, "temperature": 0, "logprobs": 5}
    whole = client.completions.create(**kwargs)
    logprobs = whole.choices[0].logprobs
    assert len(logprobs.tokens) == whole.usage.completion_tokens == len(logprobs.token_logprobs)
    assert "".join(logprobs.tokens) == whole.choices[0].text
    assert logprobs.text_offset == [sum(map(len, logprobs.tokens[:i])) for i in range(len(logprobs.tokens))]
    for token, value, top in zip(logprobs.tokens, logprobs.token_logprobs, logprobs.top_logprobs):
        assert value <= 0 and 5 <= len(top) <= 6 and top[token] == value
        assert value == max(top.values())  # greedy: each token is the most likely one
    pieces = list(client.completions.create(stream=True, **kwargs))
    streamed = [c.choices[0].logprobs for c in pieces if c.choices and c.choices[0].logprobs]
    for field in ("tokens", "token_logprobs", "text_offset"):
        assert [x for p in streamed for x in getattr(p, field)] == getattr(logprobs, field)
    plain = client.completions.create(**(kwargs | {"logprobs": None}))
    assert plain.choices[0].logprobs is None and plain.choices[0].text == whole.choices[0].text


def test_chat_logprobs_and_top_logprobs_streamed_and_not_are_the_same_in_openai_s_shape(server):
    client = server.client()
    kwargs = {"model": MODEL, **CHAT, "max_tokens": 10, "temperature": 0, "logprobs": True, "top_logprobs": 5}
    whole = client.chat.completions.create(**kwargs)
    content = whole.choices[0].logprobs.content
    assert len(content) == whole.usage.completion_tokens
    for entry in content:
        assert len(entry.top_logprobs) == 5 and entry.top_logprobs[0].logprob == entry.logprob  # greedy
        assert bytes(entry.bytes).decode(errors="replace") == entry.token
        assert [t.logprob for t in entry.top_logprobs] == sorted((t.logprob for t in entry.top_logprobs), reverse=True)
    streamed = [e for c in client.chat.completions.create(stream=True, **kwargs)
                if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content]
    assert [(e.token, e.logprob) for e in streamed] == [(e.token, e.logprob) for e in content]
    no_top = client.chat.completions.create(**(kwargs | {"top_logprobs": None}))
    assert all(e.top_logprobs == [] for e in no_top.choices[0].logprobs.content)


def test_a_token_s_bytes_are_its_own_even_where_it_holds_a_piece_of_a_character():
    tokenizer = Tokenizer.from_folder(BUNDLED_MODEL)
    for text in ("日本語😀 ok", "def f(x):\n\treturn x", "<|endoftext|>"):
        ids = tokenizer.encode(text)
        pieces = [tokenizer.token_bytes(t) for t in ids]
        assert b"".join(pieces) == text.encode(), text
    assert any(b"\xef\xbf\xbd" not in p and p.decode(errors="replace") == "\ufffd"
               for p in map(tokenizer.token_bytes, tokenizer.encode("日本語")))  # (a piece of a character)


def test_echo_gives_the_prompt_s_logprobs_as_lm_eval_s_loglikelihood_asks_for_them(server):
    """lm-eval's local-completions: token-id prompts in a batch, echo, logprobs=1, max_tokens 1 (or 0)."""
    client = server.client()
    tokenizer = Tokenizer.from_folder(BUNDLED_MODEL)
    prompts = [tokenizer.encode("def add(a, b):\n    return a + b"), tokenizer.encode("import os\nimport sys")]
    common = {"model": MODEL, "prompt": prompts, "echo": True, "logprobs": 1, "temperature": 0, "seed": 1234}
    one = client.completions.create(max_tokens=1, **common)
    zero = client.completions.create(max_tokens=0, **common)
    assert zero.usage.completion_tokens == 0
    for ids, with_token, alone in zip(prompts, sorted(one.choices, key=lambda c: c.index), zero.choices):
        assert alone.text == tokenizer.decode(ids) and with_token.text.startswith(alone.text)
        assert len(alone.logprobs.token_logprobs) == len(ids)
        assert len(with_token.logprobs.token_logprobs) == len(ids) + 1
        assert alone.logprobs.token_logprobs[0] is None and alone.logprobs.top_logprobs[0] is None
        assert with_token.logprobs.token_logprobs[:-1] == alone.logprobs.token_logprobs
        assert all(value <= 0 for value in alone.logprobs.token_logprobs[1:])
    # the prompt's row i is the distribution after its first i tokens: its best token's log-probability
    # is what a greedy request for the first i tokens gets for the token it samples
    ids, i = prompts[0], 5
    best = max(zero.choices[0].logprobs.top_logprobs[i].values())
    after = client.completions.create(model=MODEL, prompt=ids[:i], max_tokens=1, temperature=0, logprobs=0)
    assert abs(after.choices[0].logprobs.token_logprobs[0] - best) < 1e-4


def test_penalties_are_followed_a_frequency_penalty_makes_fewer_repeats(server):
    client = server.client()
    kwargs = {"model": MODEL, "prompt": "def main():\n    ", "max_tokens": 48, "temperature": 0, "logprobs": 0,
              "extra_body": {"ignore_eos": True}}
    plain = client.completions.create(**kwargs).choices[0].logprobs.tokens
    penalised = client.completions.create(frequency_penalty=2.0, **kwargs).choices[0].logprobs.tokens
    chat = client.chat.completions.create(model=MODEL, **CHAT, max_tokens=4, presence_penalty=1.0,
                                          extra_body={"repetition_penalty": 1.2})
    assert chat.choices[0].finish_reason in ("stop", "length")

    def most_repeated(tokens: list[str]) -> int:
        return max(tokens.count(t) for t in tokens)

    assert most_repeated(penalised) < most_repeated(plain), (plain, penalised)
