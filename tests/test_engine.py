"""The asyncio engine: sampling, bad input, cancellation, cleanup, reusing running workers."""

from __future__ import annotations

import asyncio
import logging
import os
from pathlib import Path

import pytest
import torch
from conftest import pooled

import shardspec
from shardspec.cli import BUNDLED_MODEL
from shardspec.layers.sampling import filtered_logits
from shardspec.orchestrator import request_values as values
from shardspec.orchestrator.requests import EngineError
from shardspec.orchestrator.workers import WorkerLost
from shardspec.protocol.messages import SamplingParams

PROMPT = [5, 17, 300, 42]


async def collect(engine, prompt=PROMPT, **kwargs) -> list[int]:
    tokens = []
    async for chunk in engine.generate(prompt, **kwargs):
        tokens += chunk.token_ids
    return tokens


def test_top_k_keeps_exactly_the_k_most_likely_tokens():
    logits = torch.randn(100)
    kept = filtered_logits(logits, SamplingParams(temperature=1.0, top_k=7)).isfinite()
    assert kept.sum() == 7 and set(kept.nonzero().flatten().tolist()) == set(logits.topk(7).indices.tolist())


def test_top_p_keeps_the_smallest_prefix_reaching_p():
    logits = torch.log(torch.tensor([0.5, 0.3, 0.15, 0.05]))
    kept = filtered_logits(logits, SamplingParams(temperature=1.0, top_p=0.75)).isfinite()
    assert kept.tolist() == [True, True, False, False]
    kept = filtered_logits(logits, SamplingParams(temperature=1.0, top_p=0.8)).isfinite()
    assert kept.tolist() == [True, True, False, False]  # 0.5 + 0.3 reaches 0.8
    kept = filtered_logits(logits, SamplingParams(temperature=1.0, top_p=0.81)).isfinite()
    assert kept.tolist() == [True, True, True, False]


def test_sampling_is_reproducible_with_a_seed_and_respects_top_k(tiny_model):
    async def run():
        async with shardspec.connect(model=str(tiny_model), workers=pooled(2)) as engine:
            a = await collect(engine, max_tokens=24, temperature=1.0, seed=3)
            b = await collect(engine, max_tokens=24, temperature=1.0, seed=3)
            c = await collect(engine, max_tokens=24, temperature=1.0, seed=4)
            greedy = await collect(engine, max_tokens=24)
            top1 = await collect(engine, max_tokens=24, temperature=0.8, top_k=1, seed=9)
            return a, b, c, greedy, top1

    a, b, c, greedy, top1 = asyncio.run(run())
    assert a == b and a != c
    assert top1 == greedy  # top-k 1 leaves only the argmax


BAD_REQUESTS = [
    ({"prompt": []}, "empty"),
    ({"prompt": [1, 512]}, "[0, 512)"),
    ({"prompt": [1, -1]}, "[0, 512)"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"max_tokens": 10_000}, "exceeds the context"),
    ({"temperature": -1.0}, "temperature"),
    ({"temperature": 1e-30}, "temperature must be 0 (greedy) or at least"),
    ({"top_p": 0.0}, "top_p"),
    ({"prompt": "text"}, "tokenizer"),
    ({"prompt": b"\x01\x02"}, "not bytes"),  # (as ids, one per byte, it would run)
    ({"prompt": None}, "not NoneType"),
]


def test_bad_requests_raise_clear_errors_and_the_engine_keeps_serving(tiny_model):
    async def run():
        async with shardspec.connect(model=str(tiny_model), workers=pooled(1), max_seq_len=256) as engine:
            for kwargs, message in BAD_REQUESTS:
                with pytest.raises(ValueError) as info:
                    await collect(engine, **{"max_tokens": 4, **kwargs})
                assert message in str(info.value), (kwargs, str(info.value))
                assert len(await collect(engine, max_tokens=4)) == 4

    asyncio.run(run())


def test_spawned_workers_slower_than_the_connect_timeout_are_said_to_be_starting_not_missing(tiny_model):
    async def run():
        async with shardspec.connect(model=str(tiny_model), local=1, connect_timeout=0.2):
            pass

    with pytest.raises(WorkerLost, match=r"local worker .* did not start within 0.2s \(--connect-timeout\)"):
        asyncio.run(run())  # (a worker imports torch for longer than that)


def test_cancelled_generations_free_their_slots(tiny_model):
    async def run():
        async with shardspec.connect(model=str(tiny_model), workers=pooled(2), max_seqs=4) as engine:
            for n in range(6):  # more than max_seqs: leaked slots would block later requests
                stream = engine.generate(PROMPT, max_tokens=50)
                for _ in range(n % 3 + 1):
                    await anext(stream)
                await stream.aclose()
            task = asyncio.create_task(collect(engine, max_tokens=50))
            await asyncio.sleep(0.2)
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            await collect(engine, max_tokens=3)  # a release rides before this step
            return await engine.stats()

    for stats in asyncio.run(run()):
        assert stats.slots_free == stats.slots_total == 4 and stats.live_sequences == []


def test_closing_the_engine_leaves_no_process_or_socket_behind(tiny_model):
    async def run():
        async with shardspec.connect(model=str(tiny_model), local=2) as engine:
            await collect(engine, max_tokens=2)
            return engine.group.local.procs, engine.group.local.dir

    procs, folder = asyncio.run(run())
    assert all(p.poll() is not None for p in procs)
    assert not folder.exists()
    assert all(not os.path.exists(f"/proc/{p.pid}") or Path(f"/proc/{p.pid}/stat").read_text().split()[2] == "Z"
               for p in procs)


def test_hand_started_cpu_workers_divide_their_host_s_cores_among_the_group_s_ranks_and_say_so(tiny_model,
                                                                                              spawn_worker):
    workers = [spawn_worker(threads=None), spawn_worker(threads=None)]  # no --threads: each would take every core

    async def run() -> None:
        async with shardspec.connect(model=str(tiny_model), workers=[w.address for w in workers]) as engine:
            async for _ in engine.generate([1, 2, 3], max_tokens=2):
                pass

    asyncio.run(run())
    cores = len(os.sched_getaffinity(0))
    for worker in workers:
        assert f"{max(1, cores // 2)} CPU threads: {cores} cores shared by the 2 ranks" in worker.log_text()


def test_an_orchestrator_uses_running_workers_and_the_next_one_reuses_them(tiny_model, spawn_worker):
    workers = [spawn_worker(), spawn_worker()]
    addresses = [w.address for w in workers]

    async def one_session():
        async with shardspec.connect(model=str(tiny_model), workers=addresses) as engine:
            return await collect(engine, max_tokens=12)

    first, second = asyncio.run(one_session()), asyncio.run(one_session())
    assert first == second and len(first) == 12
    assert all(w.proc.poll() is None for w in workers)  # daemons outlive their orchestrators


def test_connect_rejects_inconsistent_arguments(tiny_model, tmp_path):
    async def attempt(**kwargs):
        async with shardspec.connect(**kwargs):
            pass

    with pytest.raises(ValueError, match="not both"):
        asyncio.run(attempt(model=str(tiny_model), workers=["ipc:///tmp/x"], local=1))
    with pytest.raises(ValueError, match="tp must equal"):
        asyncio.run(attempt(model=str(tiny_model), workers=["ipc:///tmp/x"], tp=2))
    with pytest.raises(ValueError, match="not a model folder"):
        asyncio.run(attempt(model=str(tmp_path), local=1))
    with pytest.raises(ValueError, match="tcp://HOST:PORT"):
        asyncio.run(attempt(model=str(tiny_model), workers=["localhost:7000"]))


def test_filters_apply_per_row_of_a_batch_of_distributions():
    logits = torch.randn(4, 50)
    params = SamplingParams(temperature=1.0, top_k=3, top_p=0.9)
    batched = filtered_logits(logits, params)
    assert torch.equal(batched, torch.stack([filtered_logits(row, params) for row in logits]))
    assert (batched.isfinite().sum(-1) <= 3).all()


@pytest.mark.parametrize(
    ("prompts", "pass_tokens"), [(1, [256, 44]), (2, [128, 128, 44]), (3, [64] * 4 + [44]), (8, [64] * 4 + [44])]
)
def test_prompts_prefilled_together_share_the_prefill_chunk_down_to_64_tokens_each(tiny_model, prompts, pass_tokens):
    """prefill_chunk bounds the tokens of one prefill pass over all its prompts (its activations),
    in whole multiples of 64 tokens per prompt (the chunk of the prefill kernels; 3 prompts: 64, not
    85), and never fewer than 64 each."""
    from shardspec.layers.parallel import TPGroup
    from shardspec.models.loader import load_model
    from shardspec.protocol.messages import PrefillSpec, StepRequest
    from shardspec.shard_worker.decoder import Decoder
    from shardspec.testing.grants import Grants

    model = load_model(tiny_model, TPGroup(), torch.float32, torch.device("cpu"), with_mtp=False)
    runner = Decoder(model, torch.device("cpu"), 8, 512, 256, 0)
    seen = []
    forward = model.forward
    model.forward = lambda ids, batch: (seen.append(tuple(ids.shape)), forward(ids, batch))[1]
    specs = [PrefillSpec(seq=i, length=300, max_tokens=1) for i in range(prompts)]
    Grants(runner).step(StepRequest(prefill=specs), torch.randint(0, model.config.vocab_size, (300 * prompts,)))
    assert seen == [(prompts, t) for t in pass_tokens]


def test_a_request_the_workers_refuse_fails_alone_and_every_other_stream_gives_its_solo_output(tiny_model):
    from shardspec.orchestrator.requests import EngineError

    prompts = [[5, 17, 300], [9, 8, 7, 6], [40, 41]]

    async def run():
        async with shardspec.connect(model=str(tiny_model), workers=pooled(2), pp=2, max_seqs=4) as engine:
            alone = [await collect(engine, p, max_tokens=12) for p in prompts]
            running = asyncio.ensure_future(collect(engine, prompts[0], max_tokens=12))
            await asyncio.sleep(0)
            # past the engine's own checks, as a bug or a bad value would be: the wire refuses top_k > 2**30
            bad = values.new_request(next(engine.seq_ids), engine.load_info, None, None, [1, 2, 3], 12,
                                     SamplingParams(0.0, 2**31, 1.0, 0), True, penalties=(0.0, 0.0, 1.0),
                                     stop_token_ids=None, logit_bias=None, min_tokens=0, logprobs=None,
                                     prompt_logprobs=None, cache_salt=None, prefix_points=None)
            joined = [asyncio.ensure_future(collect(engine, p, max_tokens=12)) for p in prompts[1:]]
            engine.scheduler.add(bad)  # admitted with the two requests that arrive with it
            engine.wakeup.set()
            error = await bad.queue.get()
            together = [await running, *[await j for j in joined]]
            return alone, together, error

    alone, together, error = asyncio.run(run())
    assert isinstance(error, EngineError) and "top_k" in str(error)
    assert together == alone


def test_a_max_seq_len_above_the_model_s_maximum_is_warned_about(tiny_model, caplog):
    async def run() -> int:
        async with shardspec.connect(model=str(tiny_model), workers=pooled(1), max_seq_len=8192) as engine:
            return engine.load_info.max_seq_len

    with caplog.at_level(logging.WARNING, logger="shardspec.orchestrator"):
        context = asyncio.run(run())
    assert context == 4096  # the tiny model's max_position_embeddings
    assert "max_seq_len 8192 is above the model's maximum of 4096" in caplog.text


def test_a_reload_with_smaller_caches_grants_from_the_new_pools_and_an_engine_in_use_refuses_it(tiny_model):
    """Reloading with max_seqs 1 shrinks each worker's block pool; a long generation afterwards
    needs more blocks than the old pool's first ones and must come from the new one."""
    import dataclasses

    from shardspec.orchestrator.requests import EngineError

    async def run():
        async with shardspec.connect(model=str(tiny_model), workers=pooled(1), max_seqs=8, max_seq_len=512) as engine:
            before = engine.group.paging.blocks
            stream = engine.generate([1, 2, 3], max_tokens=200, stop_at_eos=False)
            await anext(stream)
            with pytest.raises(EngineError, match="idle"):
                await engine.reload(engine.group.load_request)
            await stream.aclose()
            while engine.scheduler.running or engine.scheduler.waiting:
                await asyncio.sleep(0.05)
            await engine.reload(dataclasses.replace(engine.group.load_request, max_seqs=1))
            after = engine.group.paging.blocks
            assert engine.scheduler.pool.paging is engine.group.paging  # the engine grants from the new pools
            tokens = [t async for chunk in engine.generate([1, 2, 3], max_tokens=400, stop_at_eos=False)
                      for t in chunk.token_ids]
            return before, after, len(tokens)

    before, after, generated = asyncio.run(run())
    assert after < before and generated == 400


def test_a_step_loop_that_fails_fails_every_request_and_the_next_at_once():
    """A bug in the step loop (here: building a step raises) must not leave callers waiting for ever:
    the running request fails with what it was, and so does the next one, at once."""
    async def run():
        async with shardspec.connect(model=str(BUNDLED_MODEL), workers=pooled(1)) as engine:
            def broken(*_args):
                raise RuntimeError("a bug in the scheduler")

            engine.scheduler.schedule = broken
            with pytest.raises(EngineError, match="a bug in the scheduler"):
                await asyncio.wait_for(collect(engine.generate("def f():", max_tokens=4)), 30)
            with pytest.raises(EngineError, match="step loop failed"):
                await asyncio.wait_for(collect(engine.generate("def f():", max_tokens=4)), 5)

    async def collect(stream):
        return [chunk async for chunk in stream]

    asyncio.run(run())
