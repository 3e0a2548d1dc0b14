"""A tree of guesses in flight across pipeline stages (lookahead "tree", shard_worker/branches.py):
the stages before the last run a lone sequence's next step for several outcomes of the step in
flight at once, in branch slots, and keep the branch its record proves. The output is one worker's,
bit for bit in deterministic mode, greedy and sampled with a seed, at PP = 2 and PP = 3."""

from __future__ import annotations

import asyncio
import functools
from types import SimpleNamespace

import pytest
import torch
from conftest import pooled

import shardspec
from shardspec.cli import BUNDLED_MODEL
from shardspec.shard_worker import branches
from shardspec.shard_worker.branches import Branch, TreeGuesser

PROMPTS = ("def fibonacci(n):", "class Stack:")
TOKENS = 32


async def generate(engine, temperature: float) -> list[list[int]]:
    outputs = []
    for i, prompt in enumerate(PROMPTS):  # one at a time: each decodes alone
        seeded = {"seed": 11 + i} if temperature else {}
        tokens = [
            t
            async for chunk in engine.generate(
                engine.tokenizer.encode(prompt), max_tokens=TOKENS, temperature=temperature, stop_at_eos=False, **seeded
            )
            for t in chunk.token_ids
        ]
        outputs.append(tokens)
    return outputs


async def run(pp: int, temperature: float, **options) -> tuple[list[list[int]], list]:
    async with shardspec.connect(
        model=str(BUNDLED_MODEL),
        workers=pooled(pp),
        pp=pp,
        deterministic=True,
        layer_split=[3, 3, 2] if pp == 3 else None,
        **options,
    ) as engine:
        outputs = await generate(engine, temperature)
        return outputs, await engine.stats(timeline=True)


@functools.cache
def one_worker(temperature: float) -> list[list[int]]:
    return asyncio.run(run(1, temperature))[0]


# PP = 2 greedy and PP = 3 sampled in the default run; the other two pairs with the slow tests
@pytest.mark.parametrize(("pp", "temperature"), [(2, 0.0), pytest.param(2, 0.8, marks=pytest.mark.slow),
                                                 pytest.param(3, 0.0, marks=pytest.mark.slow), (3, 0.8)],
                         ids=["2-greedy", "2-sampled", "3-greedy", "3-sampled"])
def test_a_tree_of_guesses_gives_one_workers_output_in_deterministic_mode(pp, temperature):
    """Eight branches a step: some hold (their blocks and states become the sequence's), the others
    run the step again; every stage before the last decides alike, and the last runs no tree."""
    outputs, stats = asyncio.run(run(pp, temperature, lookahead="tree", tree_width=8))
    assert outputs == one_worker(temperature)
    counts = [(s.lookaheads, s.lookaheads_right, s.branches) for s in stats]
    (trees, held, rows), last = counts[0], counts[-1]
    assert counts[:-1] == [counts[0]] * (pp - 1) and last == (0, 0, 0)
    assert 0 < held < trees and rows == 8 * trees


def test_the_timeline_shows_branches_started_cancelled_and_taken():
    """Stage 0's timeline: a "branches started" event per tree, then "branch taken" where its record
    proved a branch and "branches cancelled" where it proved none (the step ran again)."""
    _, stats = asyncio.run(run(2, 0.0, lookahead="tree", tree_width=4))
    events = [e.event for e in stats[0].timeline]
    started, taken, cancelled = (
        events.count(name) for name in ("branches started", "branch taken", "branches cancelled")
    )
    assert started == stats[0].lookaheads and taken == stats[0].lookaheads_right > 0
    assert cancelled == started - taken > 0


@pytest.mark.parametrize(
    ("seconds", "best"),
    [({0: 40, 2: 35, 4: 30, 8: 25, 16: 45}, 8), ({0: 20, 2: 22, 4: 25, 8: 30, 16: 40}, 0)],
    ids=["tree", "none"],
)
def test_the_adaptive_width_runs_at_the_width_that_gives_the_most_tokens_a_second(monkeypatch, seconds, best):
    """Widths run for blocks of lone steps, each wider one while the widest so far is the fastest; then
    the fastest, and one next to it every sixth block; where no tree pays (a short link) none."""
    clock = [0.0]
    monkeypatch.setattr(branches.time, "perf_counter", lambda: clock[0])
    decoder = SimpleNamespace(
        steps=0,
        device=torch.device("cpu"),
        model=SimpleNamespace(lm_head=SimpleNamespace(tp=SimpleNamespace(size=1, all_reduce=lambda x: x))),
    )
    tree, widths = TreeGuesser(draft_len=3), []
    for _ in range(8 * 12):
        decoder.steps += 1
        clock[0] += seconds[tree.width()] / 1e3
        tree.observe(decoder, 2)
        widths.append(tree.width())
    if best:  # (from none, each wider width while the widest so far is the fastest; then the fastest)
        assert widths[8:41:8] == [2, 4, 8, 16, 8]
    else:
        assert widths[8:17:8] == [2, 0] and 4 not in widths
    assert widths[-8:] == [best] * 8 and widths.count(best) > len(widths) / 2
    assert TreeGuesser(draft_len=7, fixed=16).width() == 8  # at most 64 tokens a pass


def test_a_record_proves_the_branch_with_its_acceptance_token_and_drafts():
    tree = [Branch(3, 17, (1, 2, 3)), Branch(1, 17, (4, 5, 6)), Branch(1, 9, (4, 5, 6))]
    flat = branches.flatten(tree)
    assert branches.unflatten(flat, 3, 4096) == tree
    assert branches.held(tree, 1, 9, [4, 5, 6]) == 2 and branches.held(tree, 1, 9, [4, 5, 7]) == -1
    guess = torch.tensor([flat])
    assert branches.kept_drafts(guess, torch.tensor([1]), torch.tensor([17]), 3).tolist() == [[4, 5, 6]]
    assert branches.kept_drafts(guess, torch.tensor([2]), torch.tensor([17]), 3) is None
    for bad in (flat[:-1], [4, 17, 1, 2, 3], [3, 4096, 1, 2, 3]):  # not whole branches; 4 of 3 drafts; a bad id
        with pytest.raises(ValueError):
            branches.unflatten(bad, 3, 4096)
