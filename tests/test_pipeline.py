"""Pipeline stages: the workers form stages that pass hidden states to each other and commit from
the last stage's acceptance record. Greedy output equals transformers at PP = 2 (TP 1 and 2) and
at PP = 3 with an uneven layer split; MTP on equals MTP off with drafts rejected; each stage holds
only its layers; a killed stage worker fails the request, names itself, and the engine serves the
same output once it is back."""

from __future__ import annotations

import asyncio
import random
import time

import pytest
from conftest import pooled
from reference import hf_greedy, hf_model

import shardspec
from shardspec.orchestrator.requests import EngineError

HEARTBEAT_S = 2.0
SLACK_S = 1.5  # scheduling on a loaded 2-core machine


async def generate_all(engine, prompts: list[list[int]], max_tokens: int) -> tuple[list[list[int]], int]:
    """Greedy outputs of the prompts, generated together; and the drafts accepted in all."""
    async def one(prompt):
        tokens, final = [], None
        async for chunk in engine.generate(prompt, max_tokens=max_tokens, temperature=0):
            tokens += chunk.token_ids
            final = chunk
        return tokens, final.stats.get("accepted_tokens", 0)

    results = await asyncio.gather(*(one(p) for p in prompts))
    return [tokens for tokens, _ in results], sum(accepted for _, accepted in results)


@pytest.mark.parametrize(("pp", "tp", "split"), [(2, 1, None), (2, 2, None), (3, 1, [1, 2, 1])],
                         ids=["pp2", "pp2-tp2", "pp3-split-1-2-1"])
def test_greedy_output_with_pipeline_stages_equals_transformers_with_and_without_mtp(tiny_model, pp, tp, split):
    rng = random.Random(pp * 10 + tp)
    prompts = [rng.choices(range(512), k=n) for n in (3, 70)]  # 70: two prefill chunks of 64
    reference = hf_model(tiny_model)
    expected = [hf_greedy(reference, prompt, 24) for prompt in prompts]

    async def run(mtp: bool):
        async with shardspec.connect(model=str(tiny_model), workers=pooled(pp * tp), pp=pp, tp=tp, layer_split=split,
                                     mtp=mtp, prefill_chunk=64) as engine:
            layers = [reply.layers for reply, _ in await engine.group.call_all(engine.group.load_request)]
            return await generate_all(engine, prompts, 24), layers

    (with_mtp, accepted), layers = asyncio.run(run(True))
    assert with_mtp == expected
    if pp == 3:  # MTP off too (on the others, equal to transformers with MTP on is equal to it without)
        (without, _), _ = asyncio.run(run(False))
        assert without == expected
    counts = split or [4 // pp + (i < 4 % pp) for i in range(pp)]
    starts = [sum(counts[:i]) for i in range(pp)]
    assert layers == [[start, start + n] for start, n in zip(starts, counts) for _ in range(tp)]
    assert accepted < 2 * 24  # random MTP weights: drafts were rejected, and the stages rolled back


@pytest.mark.slow  # the sampled PP = 2 test in test_spec_decode.py also accepts most drafts
def test_the_bundled_model_with_mtp_at_pp_2_equals_one_worker(bundled_prompts=("def fibonacci(n):", "class Stack:")):
    from shardspec.cli import BUNDLED_MODEL

    async def run(**options):
        async with shardspec.connect(model=str(BUNDLED_MODEL), dtype="float32", **options) as engine:
            ids = [engine.tokenizer.encode(p) for p in bundled_prompts]
            return await generate_all(engine, ids, 48)

    (staged, accepted), (alone, _) = asyncio.run(run(workers=pooled(2), pp=2)), asyncio.run(run(workers=pooled(1)))
    assert staged == alone
    assert accepted > 48  # high acceptance: several drafts kept per step, every stage advanced by them


def test_a_lone_sequences_lookahead_on_the_last_stages_guess_gives_the_output_of_waiting_and_of_one_worker():
    """PP = 3 (a middle stage too, an uneven split), the bundled model, one sequence at a time: the
    stages before the last run each step's pass on the guess of the record before; some guesses
    hold, the others put the state back and run the pass again. Deterministic mode, where the
    outputs with lookahead on, off and of one worker are equal bit for bit."""
    from shardspec.cli import BUNDLED_MODEL

    prompts = ("def fibonacci(n):", "class Stack:")

    async def run(lookahead: str, pp: int = 3):
        async with shardspec.connect(model=str(BUNDLED_MODEL), workers=pooled(pp), pp=pp,
                                     layer_split=[3, 3, 2] if pp == 3 else None, deterministic=True,
                                     lookahead=lookahead) as engine:
            outputs = [await collect_tokens(engine, engine.tokenizer.encode(p), 48) for p in prompts]
            return outputs, [(stats.lookaheads, stats.lookaheads_right) for stats in await engine.stats()]

    (ahead, counts), (waited, none) = asyncio.run(run("on")), asyncio.run(run("off"))
    alone, _ = asyncio.run(run("off", pp=1))
    assert ahead == waited == alone
    (runs, right), middle, last = counts
    assert middle == (runs, right) and last == (0, 0)  # the stages before the last decide alike
    assert 0 < right < runs  # guesses that held and guesses that did not
    assert none == [(0, 0)] * 3


def test_automatic_lookahead_stops_guessing_when_its_guesses_seldom_hold(tiny_model):
    """Random MTP weights: a step almost never keeps all its drafts, so a guess (which holds only
    then) almost never does. "auto" guesses at the first lone steps, then only to probe (one lone
    step in 16), while "on" guesses at every one; the output is the same as waiting, in
    deterministic mode."""
    prompts = [[5, 17, 300, 42, 9], [101, 7, 7, 250]]

    async def run(lookahead: str):
        async with shardspec.connect(model=str(tiny_model), workers=pooled(2), pp=2, mtp=True, deterministic=True,
                                     lookahead=lookahead) as engine:
            outputs = [await collect_tokens(engine, prompt, 40) for prompt in prompts]
            return outputs, (await engine.stats())[0].lookaheads

    (auto, guessed), (always, every), (waited, none) = (asyncio.run(run(mode)) for mode in ("auto", "on", "off"))
    assert auto == always == waited
    assert none == 0 and every >= 60  # "on": nearly every one of the ~78 lone steps
    assert 0 < guessed <= every / 3, (guessed, every)


@pytest.mark.slow  # (15-25 s of workers and timeouts)
@pytest.mark.parametrize("stage", [0, 1])
def test_a_killed_stage_worker_fails_the_request_in_time_and_the_engine_serves_the_same_output(tiny_model, stage):
    async def run():
        async with shardspec.connect(model=str(tiny_model), local=2, pp=2) as engine:
            before, _ = await generate_all(engine, [[5, 6, 7]], 40)
            stream = engine.generate([5, 6, 7], max_tokens=3000, stop_at_eos=False)
            for _ in range(3):
                await anext(stream)
            engine.group.local.procs[stage].kill()
            started = time.monotonic()
            with pytest.raises(EngineError) as info:
                async for _ in stream:
                    pass
            elapsed = time.monotonic() - started
            deadline = time.monotonic() + 120
            while not engine.healthy:  # the engine starts the worker again and rebuilds the group
                assert time.monotonic() < deadline, engine.failure
                await asyncio.sleep(0.2)
            after, _ = await generate_all(engine, [[5, 6, 7]], 40)
            return before, after, elapsed, str(info.value)

    before, after, elapsed, error = asyncio.run(run())
    assert f"worker{stage}.sock" in error
    assert elapsed < HEARTBEAT_S + SLACK_S
    assert after == before


def test_a_bad_stage_layout_is_refused_before_any_worker_starts(tiny_model):
    with pytest.raises(ValueError, match="multiple of pp"):
        asyncio.run(shardspec.connect(model=str(tiny_model), local=3, pp=2).__aenter__())
    with pytest.raises(ValueError, match="layer split"):
        asyncio.run(shardspec.connect(model=str(tiny_model), local=2, pp=2, layer_split=[1, 2]).__aenter__())


def test_micro_batches_keep_two_steps_in_flight_on_the_first_stage_and_give_one_workers_output(tiny_model):
    rng = random.Random(7)
    prompts = [rng.choices(range(512), k=n) for n in (3, 5, 9, 17)]

    async def run(**options):
        async with shardspec.connect(model=str(tiny_model), max_seqs=4, **options) as engine:
            outputs, _ = await generate_all(engine, prompts, 16)
            return outputs, (await engine.stats())[0].forwarded_max

    (split, in_flight), (whole, alone), (one_worker, _) = (
        asyncio.run(run(workers=pooled(2), pp=2, micro_batches=2)),
        asyncio.run(run(workers=pooled(2), pp=2, micro_batches=1)), asyncio.run(run(workers=pooled(1))))
    assert split == whole == one_worker
    assert in_flight == 2  # stage 0 ran one micro-batch's step before the other's record came
    assert alone == 1  # one micro-batch: each step waits for the record of the one before


@pytest.mark.slow  # (15-25 s of workers and timeouts)
def test_a_stage_link_that_cannot_open_is_relayed_through_the_orchestrator_with_the_same_output(
        tiny_model, spawn_worker, tmp_path):
    from shardspec.protocol.errors import RemoteError

    workers = [spawn_worker().address for _ in range(2)]
    (tmp_path / "w1.link").mkdir()  # where worker 1 would bind its stage link: it cannot
    prompts = [[5, 6, 7], [9, 10, 11, 12]]

    async def run(**options):
        async with shardspec.connect(model=str(tiny_model), pp=2, **options) as engine:
            return (await generate_all(engine, prompts, 12))[0], engine.group.relay

    relayed, fell_back = asyncio.run(run(workers=workers))
    assert fell_back
    assert relayed == asyncio.run(run(workers=pooled(2)))[0]
    with pytest.raises(RemoteError, match=r"w1\.link"):
        asyncio.run(run(workers=workers, relay=False))


def test_a_reload_after_steps_of_finished_sequences_only_serves_the_same_output(tiny_model):
    async def run():
        async with shardspec.connect(model=str(tiny_model), workers=pooled(2), pp=2) as engine:
            # two micro-batches, one sequence each: the short one's group keeps a step on the wire after it
            # finishes (a step of finished sequences only), while the long one goes on
            before = await asyncio.gather(collect_tokens(engine, [5, 6, 7], 2), collect_tokens(engine, [9, 8], 24))
            await engine.group.load(engine.group.load_request)  # new caches on the same stage links
            after = await asyncio.gather(collect_tokens(engine, [5, 6, 7], 2), collect_tokens(engine, [9, 8], 24))
            return before, after

    before, after = asyncio.run(run())
    assert before == after and [len(t) for t in before] == [2, 24]


async def collect_tokens(engine, prompt: list[int], max_tokens: int) -> list[int]:
    return [t async for chunk in engine.generate(prompt, max_tokens=max_tokens, temperature=0,
                                                 stop_at_eos=False) for t in chunk.token_ids]


def test_the_workers_timelines_show_each_step_s_messages_in_causal_order(tiny_model):
    """At PP = 2 (one machine: one clock), step N's hidden states leave stage 0 before stage 1 has
    them, stage 1 sends its record after that, and stage 0 gets the record after it was sent; each
    rank took the step's request before its part of it."""
    async def run():
        async with shardspec.connect(model=str(tiny_model), workers=pooled(2), pp=2, lookahead="off") as engine:
            async for _ in engine.generate([1, 2, 3], max_tokens=24, stop_at_eos=False):
                pass
            return [{(e.step, e.event): e.at for e in stats.timeline} for stats in await engine.stats(timeline=True)]

    first, last = asyncio.run(run())
    steps = sorted(step for step, event in first if event == "got record")
    assert len(steps) >= 5
    for n in steps:
        assert first[n, "request"] <= first[n, "send hidden"] <= last[n, "got hidden"]
        assert last[n, "request"] <= last[n, "got hidden"] <= last[n, "send record"] <= first[n, "got record"]
