"""Launch ahead: a single stage queues the next step's pass on the device before it reads the current
one's (ahead.LaunchAhead). The replies must be those of running every step after the one before."""

from __future__ import annotations

import asyncio
import json
import random
import time
from collections import deque
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from conftest import pooled

import shardspec
from shardspec.layers.parallel import TPGroup
from shardspec.models.loader import load_model
from shardspec.protocol.messages import PrefillSpec, ReleaseRequest, SamplingParams, StepRequest, WorkerOptions
from shardspec.shard_worker.decoder import Decoder, Peek
from shardspec.testing.grants import Grants

NO_PROMPT = torch.empty(0, dtype=torch.long)


def drive(make: Callable[[Peek], Decoder], arrivals: dict[int, list[tuple[PrefillSpec, list[int]]]],
          max_steps: int = 200, keep_finished: bool = False):
    """(The replies, the passes launched ahead) of the runner `make(peek)` driven as the engine drives
    a worker: two steps on the wire (the next one sent before the current one's reply is read,
    naming the sequences not known finished then),
    a release sent for each sequence once a reply says it finished; `peek` sees the next message
    when it is a step. arrivals: at the n-th step sent, the prompts it prefills. keep_finished: as a
    client may, keep finished sequences in the steps and release none (the worker skips them)."""
    wire: deque = deque()
    live: list[int] = []
    known_done: set[int] = set()
    sent = 0

    def send_step() -> None:
        nonlocal sent
        new = arrivals.get(sent, [])
        decode = [seq for seq in live if keep_finished or seq not in known_done]
        live.extend(spec.seq for spec, _ in new)
        prompts = torch.tensor([t for _, prompt in new for t in prompt], dtype=torch.long)
        wire.append(("step", grants(StepRequest(prefill=[spec for spec, _ in new], decode=decode)), prompts))
        sent += 1

    def peek(_until) -> StepRequest | None:  # (the next step is on the wire before the current one runs)
        return wire[0][1] if wire and wire[0][0] == "step" else None

    runner = make(peek)
    grants = Grants(runner)
    replies = []
    while sent < max_steps and (sent <= max(arrivals) or set(live) - known_done):
        while sum(kind == "step" for kind, *_ in wire) < 2:
            send_step()
        kind, request, *rest = wire.popleft()
        if kind == "release":
            grants.release(request.seqs)
            continue
        reply = runner.step(request, rest[0]).reply()
        replies.append((reply.seqs, reply.tokens, reply.accepted, reply.drafts, reply.finished))
        done = [seq for seq, why in zip(reply.seqs, reply.finished) if why]
        known_done.update(done)
        if done and not keep_finished:
            wire.append(("release", ReleaseRequest(seqs=done), None))
    launched = runner.stats().launched_ahead
    runner.close()
    return replies, launched


def arrivals_of(vocab: int, seed: int) -> dict[int, list[tuple[PrefillSpec, list[int]]]]:
    """Prompts arriving at steps 0, 0, 3 and 9, with budgets that end them at different steps, one
    that runs to the end of its context, and one that stops at a token id."""
    rng = random.Random(seed)

    def spec(seq: int, max_tokens: int, stop_ids: list[int] | None = None) -> tuple[PrefillSpec, list[int]]:
        prompt = rng.choices(range(vocab), k=rng.randint(1, 9))
        return PrefillSpec(seq=seq, length=len(prompt), sampling=SamplingParams(), max_tokens=max_tokens,
                           stop_ids=stop_ids or []), prompt

    return {0: [spec(0, 7), spec(1, 1000)], 3: [spec(2, 13, stop_ids=[3, 5])], 9: [spec(3, 20)]}


@pytest.mark.parametrize(("draft_len", "forced"), [(3, None), (3, 0.6), (0, None)])
def test_replies_with_passes_launched_ahead_equal_replies_without(small_vocab_model, draft_len, forced):
    model = load_model(small_vocab_model, TPGroup(), torch.float32, torch.device("cpu"), with_mtp=True)

    def replies(launch_ahead: str) -> tuple[list, int]:
        # deterministic: a launched pass also runs the rows of sequences the step before finished, so its
        # batch has more rows than the same step run after the step before (CPU matmuls may round by shape)
        return drive(lambda peek: Decoder(model, torch.device("cpu"), 4, 40, 512, draft_len, forced_acceptance=forced,
                                          deterministic=True, launch_ahead=launch_ahead, peek=peek),
                     arrivals_of(16, seed=draft_len))

    ahead, launched = replies("on")
    plain, none = replies("off")
    assert ahead == plain
    assert none == 0 and launched > len(plain) // 2  # most steps came next, as the engine sends them
    assert {why for step in plain for why in step[4]} >= {"length"}
    assert any(why for step in plain for why in step[4][:-1])  # a sequence finished while others ran on


def test_no_pass_is_launched_past_the_caches(small_vocab_model):
    """A sequence running to max_seq_len: the step after each step is launched before the host knows
    how far that step took it, so near the end of the context nothing may be launched ahead."""
    model = load_model(small_vocab_model, TPGroup(), torch.float32, torch.device("cpu"), with_mtp=True)
    spec = PrefillSpec(seq=0, length=2, sampling=SamplingParams(), max_tokens=1000)
    replies, launched = drive(lambda peek: Decoder(model, torch.device("cpu"), 1, 24, 512, 3, forced_acceptance=1.0,
                                                   launch_ahead="on", peek=peek), {0: [(spec, [5, 7])]})
    assert sum(len(tokens[0]) for _, tokens, *_ in replies) == 24 - 2
    # every draft kept: the decode steps start at lengths 2, 6, .. 22; each but the last launches the next
    # ahead where it starts at most 2 (k + 1) positions before max_seq_len
    starts = range(2, 24 - 1, 4)
    assert launched == sum(n <= 24 - 2 * 4 for n in starts[:-1]) > 0


def test_finished_sequences_left_in_the_steps_are_not_run_on(small_vocab_model):
    """A client may keep finished sequences in its steps (the worker skips them). Their rows must not
    be launched ahead step after step: the host no longer advances their lengths, so the rows would
    run past the caches' ends into other slots."""
    model = load_model(small_vocab_model, TPGroup(), torch.float32, torch.device("cpu"), with_mtp=True)

    def replies(launch_ahead: str) -> list:
        # every draft rejected: each step moves each row one position. Sequence 0 ends at its second
        # token, at length 15, short of the 24 - 2 (k + 1) = 16 up to which a row may be launched ahead;
        # sequence 1, from length 2, is launched ahead about 14 steps more: sequence 0's row with it
        # would reach position 29 + k of a 30-position cache
        prompts = {0: [5, 7] * 7, 1: [3, 9]}
        specs = [PrefillSpec(seq=seq, length=len(prompts[seq]), sampling=SamplingParams(), max_tokens=budget)
                 for seq, budget in ((0, 2), (1, 1000))]
        return drive(lambda peek: Decoder(model, torch.device("cpu"), 2, 24, 512, 3, forced_acceptance=0.0,
                                          deterministic=True, launch_ahead=launch_ahead, peek=peek),
                     {0: [(spec, prompts[spec.seq]) for spec in specs]}, keep_finished=True)[0]

    ahead = replies("on")
    assert ahead == replies("off")
    assert [why for _, _, _, _, finished in ahead for why in finished][-1] == "length"  # sequence 1 ran to the end


def test_the_engine_launches_ahead_and_its_output_is_the_same(small_vocab_model):
    prompts = [[1, 2, 3], [7], [4, 4, 4, 4, 9], [11, 2]]

    async def run(**workers):
        async with shardspec.connect(model=str(small_vocab_model), mtp=True, max_seqs=4, dtype="float32",
                                     deterministic=True, **workers) as engine:
            async def one(prompt, max_tokens):
                return [t async for chunk in engine.generate(prompt, max_tokens=max_tokens) for t in chunk.token_ids]
            out = await asyncio.gather(*(one(p, 10 + 9 * i) for i, p in enumerate(prompts)))
            return out, sum(s.launched_ahead for s in await engine.stats())

    plain, none = asyncio.run(run(workers=pooled(1)))  # on a CPU launch ahead is off by default
    ahead, launched = asyncio.run(run(workers=pooled(1), worker_options=WorkerOptions(launch_ahead="on")))
    assert ahead == plain and none == 0 and launched > 0


@pytest.mark.slow  # (two engines a parameter; the driven test below checks the same in the default suite)
@pytest.mark.parametrize("mtp", [False, True])
def test_greedy_steps_under_grammars_launch_ahead_and_their_outputs_are_the_same(mtp):
    """Without MTP, greedy rows under a grammar choose their tokens under its masks on the device, so
    their steps launch ahead too (the masks of a step computed while its pass runs); with MTP the host
    decides each step and launches the next step's verify before it replies. Through the engine: the
    outputs, each of which its grammar allows, are those without launch ahead (how many steps launch
    depends on when the engine's next request comes: the driven test below counts them)."""
    from shardspec.cli import BUNDLED_MODEL

    choice = {"choice": ["yes", "no", "maybe so", "not at all"]}
    schema = {"json": {"type": "object", "properties": {"n": {"type": "integer"}, "s": {"type": "string"}},
                       "required": ["n", "s"], "additionalProperties": False}}

    async def run(**workers):
        async with shardspec.connect(model=str(BUNDLED_MODEL), mtp=mtp, max_seqs=4, deterministic=True,
                                     **workers) as engine:
            async def one(prompt, constraint):
                text = ""
                async for chunk in engine.generate(prompt, max_tokens=40, temperature=0,
                                                   **({"structured_output": constraint} if constraint else {})):
                    text += chunk.text
                return text
            out = await asyncio.gather(one("def f():", schema), one("Is it?", choice), one("import os", None),
                                       one("x = ", schema))
            return out, sum(s.launched_ahead for s in await engine.stats())

    plain, none = asyncio.run(run(workers=pooled(1)))
    ahead, launched = asyncio.run(run(workers=pooled(1), worker_options=WorkerOptions(launch_ahead="on")))
    assert ahead == plain and none == 0 and launched > 0
    assert plain[1] in choice["choice"] and set(json.loads(plain[0])) == set(json.loads(plain[3])) == {"n", "s"}


@pytest.mark.parametrize("draft_len", [3, 0])
def test_steps_the_host_decides_launch_the_next_verify_ahead_and_their_replies_are_the_same(small_vocab_model,
                                                                                            draft_len):
    """Sampled sequences (seeded) and one with a repetition penalty: the host decides each step, then
    queues the next step's verify pass on the rows it has built before it replies (verify_next). The
    replies are those without launch ahead."""
    model = load_model(small_vocab_model, TPGroup(), torch.float32, torch.device("cpu"), with_mtp=True)
    rng = random.Random(5)

    def spec(seq: int, max_tokens: int, **sampling) -> tuple[PrefillSpec, list[int]]:
        prompt = rng.choices(range(16), k=rng.randint(1, 9))
        return PrefillSpec(seq=seq, length=len(prompt), sampling=SamplingParams(seed=seq + 1, **sampling),
                           max_tokens=max_tokens), prompt

    arrivals = {0: [spec(0, 9, temperature=0.9), spec(1, 40, temperature=0.7, top_k=5)],
                3: [spec(2, 17, temperature=1.0, repetition_penalty=1.3)]}

    def replies(launch_ahead: str) -> tuple[list, int]:
        return drive(lambda peek: Decoder(model, torch.device("cpu"), 4, 60, 512, draft_len, deterministic=True,
                                          launch_ahead=launch_ahead, peek=peek), arrivals)

    ahead, launched = replies("on")
    plain, none = replies("off")
    assert ahead == plain
    assert none == 0 and launched > len(plain) // 2


def grammar_decoder(model, draft_len: int, launch_ahead: str, grammar: str):
    """A decoder of the bundled model that has built `grammar` as "g" (for drive)."""
    from shardspec.cli import BUNDLED_MODEL

    def make(peek) -> Decoder:
        runner = Decoder(model, torch.device("cpu"), 4, 200, 512, draft_len, deterministic=True,
                         launch_ahead=launch_ahead, peek=peek, tokenizer_file=Path(BUNDLED_MODEL) / "tokenizer.json")
        runner.grammars.build(0, "g", grammar, [])
        while not runner.grammars.done():
            time.sleep(0.01)
        return runner
    return make


def text_spec(seq: int, text: str, max_tokens: int = 48, grammar: str = "") -> tuple[PrefillSpec, list[int]]:
    prompt = list(text.encode())  # (the bundled tokenizer's first 256 ids are its bytes)
    return PrefillSpec(seq=seq, length=len(prompt), sampling=SamplingParams(), max_tokens=max_tokens,
                       grammar=grammar), prompt


@pytest.mark.parametrize("draft_len", [3, 0])
def test_driven_steps_under_grammars_launch_ahead_and_their_replies_are_the_same(draft_len):
    """The bundled model's greedy rows under JSON schemas beside a free one, driven with the next step
    always on the wire: nearly every step launches the next one ahead (k = 0: the tokens chosen under
    the masks on the device; k = 3: the verify after the host decided), and the replies are those
    without launch ahead."""
    from shardspec.cli import BUNDLED_MODEL
    from shardspec.constraints import grammar_of

    model = load_model(Path(BUNDLED_MODEL), TPGroup(), torch.float32, torch.device("cpu"), with_mtp=True)
    schema = grammar_of({"json": {"type": "object", "properties": {"n": {"type": "integer"}, "s": {"type": "string"}},
                                  "required": ["n", "s"], "additionalProperties": False}})
    arrivals = {0: [text_spec(0, "def f():", 24, grammar="g"), text_spec(1, "import os", 24)],
                2: [text_spec(2, "x = ", 24, grammar="g")]}
    ahead, launched = drive(grammar_decoder(model, draft_len, "on", schema), arrivals)
    plain, none = drive(grammar_decoder(model, draft_len, "off", schema), arrivals)
    assert ahead == plain
    assert none == 0 and launched > len(plain) // 2


def test_a_masked_pass_launched_ahead_is_the_step_even_where_its_rows_would_now_take_another_path(monkeypatch):
    """A pass launched ahead has run: its step must take it. Here the rows whose logits a graph keeps
    are scaled down (2 and more: a batch shrinking from 2 to 1 then crosses the bound, as one of 257
    shrinking to 256 does under graphs); a sequence finishing must not send the next step down another
    path that runs the pass again (the recurrent states would take its token twice)."""
    from shardspec.cli import BUNDLED_MODEL
    from shardspec.constraints import grammar_of
    from shardspec.shard_worker import graphs

    monkeypatch.setattr(graphs.StepPasses, "keeps_logits", lambda self, n: n >= 2)
    model = load_model(Path(BUNDLED_MODEL), TPGroup(), torch.float32, torch.device("cpu"), with_mtp=False)
    grammar = grammar_of({"regex": "[a-z ]{0,80}"})
    arrivals = {0: [text_spec(0, "abc", 4, "g"), text_spec(1, "xyz", 30, "g")]}
    ahead, launched = drive(grammar_decoder(model, 0, "on", grammar), arrivals)
    assert ahead == drive(grammar_decoder(model, 0, "off", grammar), arrivals)[0] and launched > 0


def test_a_step_that_fails_takes_the_pass_launched_for_it_with_it(small_vocab_model, monkeypatch):
    """A step refused as it begins (too few blocks, say) after a pass was launched for it: the pass goes
    with it, and the next step, of a new request once the orchestrator has released the old, runs."""
    from shardspec.protocol.errors import ErrorCode, ProtocolError

    model = load_model(small_vocab_model, TPGroup(), torch.float32, torch.device("cpu"), with_mtp=True)
    wire: list[StepRequest] = []
    runner = Decoder(model, torch.device("cpu"), 4, 40, 512, 0, launch_ahead="on",
                     peek=lambda until: wire[0] if wire else None)
    grants = Grants(runner)
    sampled = PrefillSpec(seq=0, length=2, sampling=SamplingParams(temperature=0.8, seed=1), max_tokens=30)
    grants.step(StepRequest(prefill=[sampled]), torch.tensor([3, 4]))
    wire.append(StepRequest(decode=[0]))
    grants.step(StepRequest(decode=[0]), NO_PROMPT)
    assert runner.ahead.launched is not None  # (the next step's verify, on the rows the host built)
    wire.clear()
    monkeypatch.setattr(runner.table, "check", lambda *a: (_ for _ in ()).throw(
        ProtocolError(ErrorCode.CAPACITY, "too few blocks")))
    with pytest.raises(ProtocolError):
        runner.step(StepRequest(decode=[0]), NO_PROMPT)
    monkeypatch.undo()
    grants.release([0])
    fresh = PrefillSpec(seq=1, length=2, sampling=SamplingParams(), max_tokens=5)
    assert len(grants.step(StepRequest(prefill=[fresh]), torch.tensor([5, 6])).reply().tokens[0]) == 1
    runner.close()
