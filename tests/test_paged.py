"""The paged K/V cache: blocks from one pool per worker, granted by the orchestrator, sized by memory;
admission by free blocks and preemption of the newest request when they run out."""

from __future__ import annotations

import asyncio
import random

import pytest
import torch
from conftest import pooled

import shardspec
from shardspec.cli.commands import cache_line
from shardspec.layers.parallel import TPGroup
from shardspec.models.checkpoint import Checkpoint
from shardspec.models.loader import load_model
from shardspec.protocol.errors import RemoteError
from shardspec.protocol.messages import PrefillSpec, StepRequest
from shardspec.shard_worker.decoder import Decoder
from shardspec.shard_worker.runner import fixed_cache_bytes
from shardspec.testing.grants import Grants

MAX_SEQ_LEN = 96
DRAFTS = 3


def runner_outputs(model, prompts: list[list[int]], shuffle: bool, warm: bool = False) -> list[list[int]]:
    """Greedy tokens of the prompts decoded together by one runner, each sequence's blocks taken in
    pool order or scattered over the pool at random; `warm`: with the load's prefill warm-up run
    (a GPU's, ModelRunner._warm_prefill) once they are prefilled."""
    runner = Decoder(model, torch.device("cpu"), len(prompts), MAX_SEQ_LEN, 512, DRAFTS)
    grants = Grants(runner)
    if shuffle:
        random.Random(0).shuffle(grants.free)
    specs = [PrefillSpec(seq=i, length=len(p), max_tokens=MAX_SEQ_LEN - 30) for i, p in enumerate(prompts)]
    result = grants.step(StepRequest(prefill=specs), torch.tensor([t for p in prompts for t in p]))
    outputs = {seq: list(tokens) for seq, tokens in zip(result.seqs, result.tokens)}
    if warm:
        with torch.inference_mode():
            assert runner._warm_prefill(len(prompts)) == 5
    while live := [s for s in range(len(prompts)) if not runner.sequences[s].finished]:
        result = runner.step(StepRequest(decode=live), torch.empty(0, dtype=torch.long))
        for seq, tokens in zip(result.seqs, result.tokens):
            outputs[seq] += tokens
    runner.close()
    return [outputs[i] for i in range(len(prompts))]


def test_blocks_scattered_over_the_pool_give_the_tokens_of_blocks_in_order(small_vocab_model):
    model = load_model(small_vocab_model, TPGroup(), torch.float32, torch.device("cpu"), with_mtp=True)
    rng = random.Random(1)
    prompts = [rng.choices(range(16), k=rng.randint(3, 40)) for _ in range(4)]
    ordered = runner_outputs(model, prompts, shuffle=False)
    assert ordered == runner_outputs(model, prompts, shuffle=True)
    assert [len(t) for t in ordered] == [min(MAX_SEQ_LEN - 30, MAX_SEQ_LEN - len(p)) for p in prompts]


def test_the_prefill_warm_up_leaves_the_sequences_as_they_were(small_vocab_model):
    """Its passes write only the scratch slot's state and the scratch block: sequences decoding
    around them give the tokens they give without."""
    model = load_model(small_vocab_model, TPGroup(), torch.float32, torch.device("cpu"), with_mtp=True)
    rng = random.Random(2)
    prompts = [rng.choices(range(16), k=rng.randint(3, 40)) for _ in range(3)]
    assert runner_outputs(model, prompts, shuffle=False, warm=True) == runner_outputs(model, prompts, shuffle=False)


def cache_memory_for(model_dir, blocks: int, max_seqs: int, tp: int = 1, pp: int = 1) -> int:
    """The --cache-memory that gives every worker of `pp` stages of `tp` ranks at least `blocks` K/V
    blocks beside max_seqs recurrent states at MAX_SEQ_LEN, the worker with the largest blocks
    exactly that many."""
    checkpoint = Checkpoint.open(model_dir)
    sizes = [load_model(checkpoint, TPGroup(0, tp), torch.float32, torch.device("cpu"), with_mtp=True,
                        stage=checkpoint.stage(s, pp)).cache_bytes_per(torch.float32) for s in range(pp)]
    slot_bytes, block_bytes = max(sizes, key=lambda size: size[1])
    max_blocks = -(-(MAX_SEQ_LEN + 2 * DRAFTS) // 32)
    return fixed_cache_bytes(slot_bytes, block_bytes, max_seqs, max_blocks) + blocks * block_bytes


async def generate_all(engine, prompts: list[list[int]], max_tokens: int, **penalties) -> list[list[int]]:
    async def one(prompt):
        return [t async for chunk in engine.generate(prompt, max_tokens=max_tokens, temperature=0, **penalties)
                for t in chunk.token_ids]
    return list(await asyncio.gather(*(one(p) for p in prompts)))


PENALTIES = {"frequency_penalty": 0.7, "presence_penalty": 0.3}


@pytest.mark.parametrize(("tp", "pp", "penalties"), [(1, 1, {}), pytest.param(2, 1, {}, marks=pytest.mark.slow),
                                                    (1, 2, {}), pytest.param(1, 1, PENALTIES, marks=pytest.mark.slow)])
def test_a_full_pool_preempts_the_newest_request_which_ends_with_its_tokens_alone(small_vocab_model, tp, pp,
                                                                                   penalties):
    """Deterministic mode: four requests whose blocks the pool holds only half of at their full
    length run together; the newest are preempted (their blocks taken back, their prompt and output
    prefilled again later, the output counted as output by the penalties) and every request ends
    with the greedy tokens it gets alone."""
    rng = random.Random(tp * 10 + pp)
    prompts = [rng.choices(range(16), k=rng.randint(3, 20)) for _ in range(4)]
    options = dict(model=str(small_vocab_model), workers=pooled(tp * pp), tp=tp, pp=pp, mtp=True,
                   draft_tokens=DRAFTS, dtype="float32", deterministic=True, max_seq_len=MAX_SEQ_LEN,
                   prefix_cache=False)  # (its saved states would take blocks: the pool is sized exactly)
    blocks_each = -(-(20 + 60 + 2 * DRAFTS + 1) // 32)

    async def alone():
        async with shardspec.connect(max_seqs=1, **options) as engine:
            return [(await generate_all(engine, [p], 60, **penalties))[0] for p in prompts]

    async def crowded():
        memory = cache_memory_for(small_vocab_model, 2 * blocks_each, 4, tp, pp)
        async with shardspec.connect(max_seqs=4, cache_memory=memory, **options) as engine:
            assert engine.group.paging.blocks == 2 * blocks_each  # (the fewest of any worker)
            outputs = await generate_all(engine, prompts, 60, **penalties)
            return outputs, engine.scheduler.preemptions, engine.scheduler.pool.usage

    expected = asyncio.run(alone())
    outputs, preemptions, usage = asyncio.run(crowded())
    assert preemptions > 0
    assert outputs == expected
    assert usage == 0.0  # every block back in the pool


def test_a_cache_too_small_for_one_sequence_fails_at_start_naming_the_flag(small_vocab_model):
    """Every worker's cache holds a sequence of max_seq_len (so no request the context admits can
    outgrow the cache); a smaller one is refused at load, naming what to change."""
    async def run():
        async with shardspec.connect(model=str(small_vocab_model), workers=pooled(1), dtype="float32",
                                     cache_memory="64KiB", max_seq_len=MAX_SEQ_LEN):
            pass

    with pytest.raises(RemoteError, match="raise --cache-memory"):
        asyncio.run(run())


@pytest.mark.slow
def test_a_long_request_runs_beside_many_short_ones_in_a_cache_smaller_than_slots_times_context():
    """The bundled model on two workers with 16 MiB of cache each and 32 sequences at once: a
    3,700-token request and 24 short ones all complete, where 32 slots of its 4,096 positions would
    need several times the memory."""
    rng = random.Random(2)

    async def run():
        async with shardspec.connect(workers=pooled(2), dtype="float32", max_seqs=32, cache_memory="16MiB") as engine:
            paging = engine.group.paging
            assert paging.positions < 32 * engine.load_info.max_seq_len // 4
            prompts = [rng.choices(range(1000), k=3700)] + [rng.choices(range(1000), k=50) for _ in range(24)]
            budgets = [16] + [32] * 24

            async def one(prompt, budget):
                chunks = [c async for c in engine.generate(prompt, max_tokens=budget, stop_at_eos=False)]
                return sum(len(c.token_ids) for c in chunks)

            return await asyncio.gather(*(one(p, b) for p, b in zip(prompts, budgets))), budgets

    lengths, budgets = asyncio.run(run())
    assert lengths == budgets


def test_the_cache_the_ready_line_reports_is_what_the_worker_holds(small_vocab_model):
    """One worker loaded with a small cache, then a large one: its resident memory grows by the
    difference of the cache sizes the ready line reports, within 10 %."""
    async def load(memory: str) -> tuple[int, int, str]:
        async with shardspec.connect(model=str(small_vocab_model), workers=pooled(1), dtype="float32",
                                     max_seqs=64, max_seq_len=4096, cache_memory=memory) as engine:
            stats = (await engine.stats())[0]
            return engine.load_info.cache_bytes, stats.rss_bytes, cache_line(engine)

    small, big = asyncio.run(load("16MiB")), asyncio.run(load("256MiB"))
    assert f"{big[0] / 2**20:,.1f} MiB a worker" in big[2]
    reported, held = big[0] - small[0], big[1] - small[1]
    assert reported > 200 * 2**20
    assert abs(held - reported) <= 0.1 * reported, (held / 2**20, reported / 2**20)
