"""A tree of guesses in flight across pipeline stages (lookahead "tree", shard_worker/branches.py):
the stages before the last run a lone sequence's next step for several outcomes of the step in
flight at once, in branch slots, and keep the branch its record proves. The output is one worker's,
bit for bit in deterministic mode, greedy and sampled with a seed, at PP = 2 and PP = 3."""

from __future__ import annotations

import asyncio
import functools

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


@pytest.mark.parametrize("temperature", [0.0, 0.8], ids=["greedy", "sampled"])
@pytest.mark.parametrize("pp", [2, pytest.param(3, marks=pytest.mark.slow)])  # (PP = 3: three workers, ~15 s)
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


def test_the_adaptive_width_keeps_the_ranks_that_hold_within_the_links_idle_time():
    tree = TreeGuesser(draft_len=3)
    assert tree.max_width == 16 and tree.width() == 16  # warming up: every rank
    for i in range(65):
        tree.observe(3, 0 if i % 2 else (2 if i % 8 == 0 else -1))  # rank 0 holds half the time, rank 2 1/8
    assert tree.width() == 3  # (a probe tree at full width comes every 16)
    tree.trees += 1
    tree.wait_s, tree.branch_s = 0.010, 0.003  # the branches may take 60 % of a 10 ms wait: two
    assert tree.width() == 2
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
