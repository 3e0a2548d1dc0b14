"""The prefix cache: the orchestrator's tree of cached blocks and saved states (no workers), then
whole engines whose greedy tokens with the cache equal those without it."""

from __future__ import annotations

import asyncio
import dataclasses
import random

import pytest
import torch
from conftest import pooled

import shardspec
from shardspec.layers.parallel import TPGroup
from shardspec.models.loader import load_model
from shardspec.orchestrator.blocks import BlockPool, Paging
from shardspec.orchestrator.prefix import PrefixCache
from shardspec.orchestrator.requests import Request
from shardspec.protocol.errors import ProtocolError
from shardspec.protocol.messages import PrefillSpec, SamplingParams, SaveAt, SaveFinished, StepRequest
from shardspec.shard_worker.decoder import Decoder
from shardspec.shard_worker.tails import TailPasses
from shardspec.testing.grants import Grants

BT = 32


def cache(blocks: int = 64, states: int = 4, mtp: bool = False, finish: bool = True, one_pass: int = 0) -> PrefixCache:
    return PrefixCache(BlockPool(Paging(blocks, BT, 4, 1 << 20, states, finish)), states, mtp, finish,
                       one_pass_tokens=one_pass)


def request(tokens: list[int], seq: int = 0) -> Request:
    return Request(seq, list(tokens), 100, SamplingParams(), [], 0)


def run(c: PrefixCache, r: Request, output: list[int], blocks: int) -> None:
    """Admit `r` with `blocks` blocks, reply to its prefill, stream `output` and finish it (as the
    scheduler does): its blocks cached, its end saved."""
    assert c.admit(r, blocks)
    r.record(output[:1], -1, [], 0.0)
    c.prefilled(r)
    for token in output[1:]:
        r.record([token], 0, [], 0.0)
        c.advance(r)
    r.finished = True
    c.finish(r)
    c.release(r)


def test_the_same_prompt_again_starts_after_its_last_full_block_before_its_last_token():
    c, prompt = cache(), list(range(100))
    first = request(prompt)
    assert c.admit(first, 4) and first.cached == 0
    assert [s.position for s in first.cache.saves] == [96]
    first.record([7], -1, [], 0.0)
    c.prefilled(first)
    c.release(first)
    again = request(prompt, 1)
    assert c.admit(again, 4)
    assert (again.cached, again.copy_from) == (96, -1)
    assert again.blocks[:3] == first_blocks(c, 3)  # the cached blocks, shared
    assert again.restore >= 0


def test_a_prefill_that_starts_near_its_end_saves_no_state_between_so_it_runs_as_one_pass():
    """A cached turn (its conversation hit up to its last block or so) prefills a short tail: no
    state is saved inside it, so the workers run it as one chunk; a tail of SHORT_TAIL or more, or a
    cold prompt, still saves after its last full block."""
    c = cache(blocks=256)
    turn = request(list(range(300)))
    run(c, turn, [900, 901], 12)  # the state at 301
    follow = request([*range(300), 900, 901, 902, 903, 904, *range(40)], 1)
    assert c.admit(follow, 12)
    assert follow.cached == 301 and follow.cache.saves == []
    c.release(follow)
    longer = request([*range(300), 900, 901, *range(1000, 1300)], 2)
    assert c.admit(longer, 20)
    assert longer.cached == 301 and [s.position for s in longer.cache.saves] == [(len(longer.prompt) - 1) // BT * BT]


def test_where_workers_save_within_one_pass_a_short_cached_turn_saves_after_its_last_full_block():
    """Workers whose tail graphs run a prefill of up to 128 new tokens as one pass with a save inside it
    (Paging.one_pass_tokens): a cached turn that short saves after its last full block, so the next
    turn starts there; a longer one, or one that saves elsewhere already, keeps the rule above."""
    c = cache(blocks=256, one_pass=128)
    turn = request(list(range(300)))
    run(c, turn, [900, 901], 12)  # the state at 301
    follow = request([*range(300), 900, 901, 902, 903, 904, *range(40)], 1)
    assert c.admit(follow, 12)
    assert follow.cached == 301 and [s.position for s in follow.cache.saves] == [(len(follow.prompt) - 1) // BT * BT]
    c.release(follow)
    longer = request([*range(300), 900, 901, *range(1000, 1200)], 2)  # (199 new tokens, past SHORT_TAIL's block)
    assert c.admit(longer, 20)
    assert longer.cached == 301 and longer.cache.saves == []
    c.release(longer)
    parting = request([*range(300), 900, 901, 902, 903, 904, *range(80)], 3)  # (its last full block: at 384)
    parting.prefix_points = [320]  # (a save of its own within it, at 320: no second one)
    assert c.admit(parting, 14)
    assert parting.cached == 301 and [s.position for s in parting.cache.saves] == [320]


def first_blocks(c: PrefixCache, depth: int) -> list[int]:
    node, blocks = c.root, []
    for _ in range(depth):
        node = next(iter(node.children.values()))
        blocks.append(node.block)
    return blocks


def test_a_finished_sequence_is_hit_partway_through_its_last_block_which_the_hit_copies():
    c = cache()
    turn = request(list(range(50)))
    run(c, turn, [60, 61, 62, 63], 3)  # caches 50 + 3 tokens: the state at 53
    tail_block = next(iter(c.root.children.values())).points[(*range(32, 50), 60, 61, 62)].tail_block
    follow = request([*range(50), 60, 61, 62, 63, 70, 71], 1)
    assert c.admit(follow, 3)
    assert follow.cached == 53 and follow.copy_from == tail_block
    assert follow.blocks[1] != tail_block  # the partial block is a copy, never shared


def test_with_mtp_a_hit_on_a_block_boundary_copies_the_block_before_it():
    c = cache(mtp=True)
    prompt = list(range(70))
    first = request(prompt)
    assert c.admit(first, 3)
    first.record([1], -1, [], 0.0)
    c.prefilled(first)
    c.release(first)
    again = request(prompt, 1)
    assert c.admit(again, 3)
    blocks = first_blocks(c, 2)
    assert (again.cached, again.copy_from) == (64, blocks[1])
    assert again.blocks[0] == blocks[0] and again.blocks[1] not in blocks


def test_a_shared_prefix_is_saved_where_the_second_prompt_leaves_it_and_hit_by_the_third():
    c, system = cache(), list(range(80))
    for seq, user in enumerate([[500, 501], [600, 601], [700, 701]]):
        r = request(system + user * 20, seq)
        assert c.admit(r, 6)
        assert r.cached == (0, 0, 64)[seq]
        r.record([1], -1, [], 0.0)
        c.prefilled(r)
        c.release(r)


def test_eviction_takes_least_recently_used_blocks_no_sequence_holds():
    c = cache(blocks=8, states=8)
    old, new = request(list(range(64))), request(list(range(1000, 1064)), 1)
    for r in (old, new):
        assert c.admit(r, 3)
        r.record([1], -1, [], 0.0)
        c.prefilled(r)
    c.release(old)
    held = set(new.blocks)
    assert c.unused == 2 and len(c.pool.free) == 3  # old's two full blocks cached, its third free
    taken = c.pool.take(5)  # frees old's cached blocks, never new's
    assert taken is not None and not held & set(taken)
    assert c.unused == 0 and old.block_hashes[0] not in c.root.children and new.block_hashes[0] in c.root.children
    assert c.pool.take(1) is None  # all that is left is held


def test_saved_states_are_reused_least_recently_used_first_and_never_one_a_prefill_starts_from():
    c = cache(states=1)
    a = request(list(range(40)))
    run(c, a, [1], 2)  # its state at 40 (the one state; its prompt's save at 32 found none free)
    b = request([*range(40), 1, 9], 1)
    assert c.admit(b, 2) and b.cached == 40
    assert c._take_state() is None  # the only state is in use until b's first reply
    b.record([5], -1, [], 0.0)
    c.prefilled(b)
    assert c._take_state() is not None  # now it may go


def test_a_prompt_whose_cached_blocks_the_pool_needs_is_admitted_cold_rather_than_never():
    """bench/decode.py at batch 1: a pool of one sequence's blocks and one saved state. A finished
    sequence's end takes the one state from the state its prompt saved, so the same prompt again
    reaches its cached blocks but no state; holding them, it could not get its blocks, and with
    nothing running nothing would ever free any. It starts cold, taking them back."""
    c, prompt = cache(blocks=7, states=1), list(range(128))
    run(c, request(prompt), [1, 2, 3, 4], 5)
    again = request(prompt, 1)
    assert c.admit(again, 5)
    assert again.cached == 0 and len(again.blocks) == 5 and c.pool.free == []


def test_a_prefix_point_makes_the_next_prompt_that_parts_there_start_at_its_block():
    """Two conversations share a system prompt of 300 tokens: with the point at 300 the first saves a
    state at 288 (its block boundary) and the second starts there; without it the second finds no state
    (the first's saves lie past where they part)."""
    system = list(range(1000, 1300))
    for point, hit in (([300], 288), ([], 0)):
        c = cache()
        first = request(system + list(range(40)))
        first.prefix_points = point
        run(c, first, [1, 2], 12)
        second = request(system + list(range(50, 90)), 1)
        assert c.admit(second, 12) and second.cached == hit


def test_off_it_neither_hits_nor_saves():
    c = PrefixCache(BlockPool(Paging(64, BT, 4, 1 << 20, 4, True)), 4, False, True, enabled=False)
    for seq in range(2):
        r = request(list(range(100)), seq)
        assert c.admit(r, 4) and r.cached == 0 and not r.cache.saves
        r.record([1], -1, [], 0.0)
        c.prefilled(r)
        c.release(r)
    assert not c.root.children and len(c.pool.free) == 64


def test_a_request_that_asks_for_prompt_logprobs_prefills_its_whole_prompt():
    c, prompt = cache(), list(range(100))
    run(c, request(prompt), [1], 4)
    r = request(prompt, 1)
    r.prompt_logprobs = 0
    assert c.admit(r, 4) and r.cached == 0


# --- a worker's checks of what the prefix cache asks of it ----------------------------------------


@pytest.mark.parametrize(("fields", "message"), [
    ({"cached": 40}, "at least its last token must prefill"),
    ({"cached": 8}, "need a saved state"),
    ({"state": 0}, "need a saved state"),
    ({"cached": 8, "state": 99}, "need a saved state"),
    ({"cached": 8, "state": 0, "prompt_logprobs": 0}, "whole prompt"),
    ({"copy_from": 0}, "copy_from needs cached positions"),
    ({"saves": [SaveAt(32, 0), SaveAt(16, 1)]}, "increasing positions"),
    ({"cached": 8, "state": 0, "saves": [SaveAt(8, 1)]}, "increasing positions"),
    ({"saves": [SaveAt(41, 0)]}, "increasing positions"),
    ({"output": 40}, "its prompt must have one at least"),
])
def test_a_worker_refuses_a_prefill_that_misuses_the_prefix_cache_and_serves_on(small_vocab_model, fields, message):
    model = load_model(small_vocab_model, TPGroup(), torch.float32, torch.device("cpu"), with_mtp=True)
    runner = Decoder(model, torch.device("cpu"), 2, 96, 512, 3, prefix_cache=True)
    grants, prompt = Grants(runner), torch.arange(40) % 16
    with pytest.raises(ProtocolError, match=message):
        grants.step(StepRequest(prefill=[PrefillSpec(seq=1, length=40, **fields)]), prompt)
    with pytest.raises(ProtocolError, match="must be live and released"):
        runner.release([], [SaveFinished(1, 0)])
    result = grants.step(StepRequest(prefill=[PrefillSpec(seq=2, length=40, max_tokens=4)]), prompt)
    assert result.seqs == [2] and runner.table.live() == 1
    runner.close()


# --- engines: the same greedy tokens with the cache as without -----------------------------------


async def conversation(engine, rng: random.Random, system: list[int], turns: int, max_tokens: int):
    """A chat: each turn sends the conversation so far and a new message; the tokens and cached
    tokens of every turn, then of two more conversations that share its system prompt."""
    history, out = list(system), []
    for _ in range(turns):
        history += rng.choices(range(16), k=rng.randint(5, 40))
        tokens, stats = await generate(engine, history, max_tokens)
        out.append((tokens, stats["cached_tokens"]))
        history += tokens
    for _ in range(2):
        tokens, stats = await generate(engine, system + rng.choices(range(16), k=9), max_tokens)
        out.append((tokens, stats["cached_tokens"]))
    return out


async def generate(engine, prompt, max_tokens):
    tokens, stats = [], None
    async for chunk in engine.generate(prompt, max_tokens=max_tokens, stop_at_eos=False):
        tokens += chunk.token_ids
        stats = chunk.stats or stats
    return tokens, stats


SLOW = pytest.mark.slow


@pytest.mark.parametrize(("tp", "pp", "mtp"), [(1, 1, True), pytest.param(1, 1, False, marks=SLOW),
                                               pytest.param(2, 1, True, marks=SLOW), (2, 1, False), (1, 2, True),
                                               pytest.param(1, 2, False, marks=SLOW)])
def test_greedy_tokens_with_the_prefix_cache_equal_those_without(small_vocab_model, tp, pp, mtp):
    """Deterministic mode: a five-turn chat and two more chats that share its system prompt, with the
    cache on and off; the cache hits partway through a block (a turn after the last), on a block
    boundary (a shared system prompt), and after its blocks were evicted."""
    seed = tp * 10 + pp + mtp
    system = random.Random(seed).choices(range(16), k=75)

    async def both():
        results = []
        for prefix_cache in (True, False):
            async with shardspec.connect(model=str(small_vocab_model), workers=pooled(tp * pp), tp=tp, pp=pp,
                                         mtp=mtp, deterministic=True, max_seq_len=512, max_seqs=2,
                                         prefix_cache=prefix_cache) as engine:
                results.append(await conversation(engine, random.Random(seed), system, 5, 12))
        return results

    cached, plain = asyncio.run(both())
    assert [tokens for tokens, _ in cached] == [tokens for tokens, _ in plain]
    hits = [hit for _, hit in cached]
    assert all(hit == 0 for _, hit in plain)
    assert hits[0] == 0 and all(h % BT for h in hits[1:5]), hits  # each turn after the first: mid-block
    assert hits[5] == 0 and hits[6] == 64, hits  # the shared system prompt: saved by the second, hit by the third


@pytest.mark.parametrize(("tp", "pp"), [(1, 1), pytest.param(1, 2, marks=SLOW)])
def test_after_eviction_a_chat_hits_less_and_keeps_its_greedy_tokens(small_vocab_model, tp, pp):
    """Deterministic mode, a cache of fewer blocks than three 200-token prompts take: a chat's second
    turn hits its first; three other prompts then take the blocks and saved states, and its third
    turn, which finds less of itself cached, still gets the tokens it gets with no cache."""
    rng = random.Random(7)
    chat = rng.choices(range(16), k=90)
    others = [rng.choices(range(16), k=200) for _ in range(3)]

    async def run(prefix_cache: bool):
        async with shardspec.connect(model=str(small_vocab_model), workers=pooled(tp * pp), tp=tp, pp=pp,
                                     deterministic=True, max_seq_len=256, max_seqs=2, cache_memory="1MiB",
                                     prefix_cache=prefix_cache) as engine:
            paging = engine.group.paging  # (fewer blocks than the other prompts take together)
            assert paging.blocks < 21 and (paging.states > 0) == prefix_cache
            history, turns = list(chat), []
            for other in [None, None, *others, None]:
                if other is not None:
                    await generate(engine, other, 4)
                    continue
                tokens, stats = await generate(engine, history, 8)
                turns.append((tokens, stats["cached_tokens"]))
                history += tokens + rng_tail(len(history))
            return turns

    cached, plain = asyncio.run(run(True)), asyncio.run(run(False))
    assert [t for t, _ in cached] == [t for t, _ in plain]
    hits = [h for _, h in cached]
    assert hits[1] == 90 + 7  # the first turn's end (its eighth token pending)
    assert hits[2] < 90 + 8 + 5 + 7, hits  # evicted: less than the second turn's end


def rng_tail(seed: int) -> list[int]:
    """A user's next message: 5 tokens that depend only on `seed`."""
    return random.Random(seed).choices(range(16), k=5)


def cached_turn(model, context: int, tail: int, saves: list[int], tails: str, steps: int = 8,
                device: str = "cpu"):
    """A turn whose first `context` tokens are cached (their state saved by a sequence before, its
    boundary block copied) prefills its `tail` new tokens, saving states at `saves`, then decodes
    greedily; its short pieces through the padded tail passes (tails.TailPasses) run eagerly (`tails`
    "eager"), from the runner's CUDA graphs ("graphs") or not at all ("off"). The tokens, the drafts
    after the prefill, the slot's recurrent states after it, the saved states (with the hidden states
    saved beside them) and the pieces the tail passes took."""
    runner = Decoder(model, torch.device(device), 3, 320, 512, 3, prefix_cache=True)  # (3 saved states)
    if tails == "eager":
        runner.tails = TailPasses(runner._tail_prefill, runner._first_drafts, torch.device(device),
                                  model.config.hidden_size, torch.float32, 3, runner.context, 3, graphs=False)
    elif tails == "off":
        runner.tails = None
    else:
        assert runner.tails is not None and runner.tails.graphs
    prompt = torch.tensor(random.Random(context + tail).choices(range(16), k=context + tail))
    grants = Grants(runner)
    grants.step(StepRequest(prefill=[PrefillSpec(seq=0, length=context, max_tokens=1, saves=[SaveAt(context, 0)])]),
                prompt[:context])
    grants.release([0])
    spec = grants(StepRequest(prefill=[PrefillSpec(seq=1, length=context + tail, max_tokens=steps * 4,
                                                   saves=[SaveAt(p, 1 + i) for i, p in enumerate(saves)])])).prefill[0]
    spec = dataclasses.replace(spec, cached=context, state=0,
                               copy_from=spec.blocks[(context - 1) // BT] if context % BT else -1)
    tokens = runner.step(StepRequest(prefill=[spec]), prompt).tokens[0]
    drafts, slot = list(runner.sequences[1].drafts), runner.sequences[1].slot
    layers = [layer for layer in runner.model.modules() if hasattr(layer, "recurrent_state")]
    states = [(layer.conv_state[slot].clone(), layer.recurrent_state[slot].clone()) for layer in layers]
    saved = [(layer.conv_state[runner.saved_rows + 1 :].clone(), layer.recurrent_state[runner.saved_rows + 1 :].clone())
             for layer in layers] + [(runner.saved_hidden[1 : 1 + len(saves)].clone(),)]  # (+ the hidden states)
    for _ in range(steps):
        tokens += runner.step(StepRequest(decode=[1]), torch.empty(0, dtype=torch.long)).tokens[0]
    replays = runner.tails.replays if runner.tails is not None else 0
    runner.close()
    return tokens, drafts, states, saved, replays


@pytest.mark.parametrize(("tail", "saves", "pieces"),
                         [(9, [], 1), (20, [64], 1), (60, [64, 96], 3), (100, [], 1), (200, [64], 1)],
                         ids=["one-piece", "a-save-within-it", "two-saves-split-it", "a-piece-of-the-largest-bucket",
                              "a-long-piece-eagerly"])
def test_a_cached_turn_prefilled_in_padded_pieces_equals_it_prefilled_as_it_is(small_vocab_model, tail, saves,
                                                                               pieces):
    """The padded tail passes a GPU replays from graphs, run eagerly: the tokens, the first drafts
    (the MTP layer's entries), the states after the prefill and those saved within it equal the
    unpadded prefill's. A turn that fits a bucket is one piece, a save within it written by that pass;
    two saves split it; pieces longer than the largest bucket (128) prefill unpadded."""
    model = load_model(small_vocab_model, TPGroup(), torch.float32, torch.device("cpu"), with_mtp=True)
    tokens, drafts, states, saved, _ = cached_turn(model, 45, tail, saves, "off")
    tokens_p, drafts_p, states_p, saved_p, replays = cached_turn(model, 45, tail, saves, "eager")
    assert replays == pieces
    assert (tokens_p, drafts_p) == (tokens, drafts)
    for got, expected in zip(states_p + saved_p, states + saved):
        for a, b in zip(got, expected):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_a_padded_piece_writes_no_block_but_its_sequences_own_and_scratch(small_vocab_model):
    """A turn of 5 new tokens after 50 cached, padded to 16 (tails.TailPasses, eagerly), holding only the
    blocks its step needs: its padding runs past them (positions 64 and 65), into the scratch block its
    table names there; no other block of the pool, the cached ones it shares included, changes."""
    model = load_model(small_vocab_model, TPGroup(), torch.float32, torch.device("cpu"), with_mtp=True)
    runner = Decoder(model, torch.device("cpu"), 2, 160, 512, 3, prefix_cache=True)
    runner.tails = TailPasses(runner._tail_prefill, runner._first_drafts, torch.device("cpu"),
                              model.config.hidden_size, torch.float32, 3, runner.context, 2, graphs=False)
    grants, prompt = Grants(runner), torch.tensor(random.Random(3).choices(range(16), k=55))
    first = grants(StepRequest(prefill=[PrefillSpec(seq=0, length=50, max_tokens=1, saves=[SaveAt(50, 0)])]))
    runner.step(first, prompt[:50])
    runner.release([0])  # (its blocks stay as they are: the second sequence shares the first)
    needed = runner.paging.needed(55)
    blocks = first.prefill[0].blocks[:1] + grants.free[-(needed - 1):]  # the cached block, a copy of the second
    spec = PrefillSpec(seq=1, length=55, max_tokens=4, blocks=blocks, cached=50, state=0,
                       copy_from=first.prefill[0].blocks[1])
    layers = [layer for layer in runner.model.modules() if hasattr(layer, "k_cache")]
    before = [(layer.k_cache.clone(), layer.v_cache.clone()) for layer in layers]
    runner.step(StepRequest(prefill=[spec]), prompt)
    assert runner.tails.replays == 1 and needed * BT < 50 + 16
    touched = set(blocks[1:]) | {runner.paging.scratch}
    for layer, (k, v) in zip(layers, before):
        changed = {int(b) for b in torch.nonzero((layer.k_cache != k).flatten(1).any(1) | (layer.v_cache != v)
                                                 .flatten(1).any(1)).flatten()}
        assert changed <= touched and runner.paging.scratch in changed, (changed, touched)
    runner.close()
