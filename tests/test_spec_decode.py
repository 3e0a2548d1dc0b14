"""MTP speculative decoding: output identical to plain decoding, distributions preserved."""

from __future__ import annotations

import asyncio
import functools
import random
from collections import Counter

import pytest
import torch
from conftest import full_blocks, pooled
from scipy.stats import chisquare

import shardspec
from shardspec.cli import BUNDLED_MODEL
from shardspec.orchestrator.config import FORCED_ACCEPTANCE_ENV
from shardspec.protocol.messages import PrefillSpec, ReleaseRequest, StepRequest, WorkerOptions

PROMPTS = [[3, 1, 4, 1, 5], [9, 2, 6], [5, 3, 5, 8, 9, 7, 9]]
P_VALUE_FLOOR = 1e-3  # a correct sampler fails a comparison for one seed set in a thousand (6 comparisons: < 0.6%)


async def generate_all(engine, prompts, **kwargs) -> list[list[int]]:
    async def one(prompt):
        tokens = []
        async for chunk in engine.generate(prompt, **kwargs):
            tokens += chunk.token_ids
        return tokens

    return await asyncio.gather(*(one(p) for p in prompts))


def greedy_outputs(model, prompts, tp, mtp, max_tokens=64, draft_tokens=3):
    # deterministic: equal outputs are guaranteed whatever shares a step and with MTP on or off
    # (docs/architecture.md, "Deterministic decoding")
    async def run():
        async with shardspec.connect(model=str(model), workers=pooled(tp), mtp=mtp, draft_tokens=draft_tokens,
                                     max_seqs=8, dtype="float32", deterministic=True) as engine:
            return await generate_all(engine, prompts, max_tokens=max_tokens)

    return asyncio.run(run())


@pytest.mark.parametrize(("model_name", "tp"), [
    ("tiny_model", 1), ("small_vocab_model", 1), ("small_vocab_model", 2),
    pytest.param("tiny_model", 2, marks=pytest.mark.slow),  # drafts mostly rejected at TP = 2: the one above
])
def test_greedy_output_with_mtp_equals_output_without(model_name, tp, request):
    model = request.getfixturevalue(model_name)
    vocab = 512 if model_name == "tiny_model" else 16
    rng = random.Random(tp)
    prompts = [rng.choices(range(vocab), k=rng.randint(1, 30)) for _ in range(10)]
    plain = greedy_outputs(model, prompts, tp, mtp=False, max_tokens=48)
    assert all(len(t) == 48 for t in plain)
    assert greedy_outputs(model, prompts, tp, mtp=True, max_tokens=48) == plain


@pytest.mark.parametrize("draft_tokens", [1, pytest.param(2, marks=pytest.mark.slow), 4])  # 3: the tests above
def test_greedy_output_is_the_same_for_every_draft_length(small_vocab_model, draft_tokens):
    prompts = [[1, 2, 3], [7], [4, 4, 4, 4, 9]]
    assert greedy_outputs(small_vocab_model, prompts, 1, mtp=True, draft_tokens=draft_tokens) == \
        greedy_outputs(small_vocab_model, prompts, 1, mtp=False)


def test_sequences_accepting_different_draft_counts_in_one_step_stay_correct(small_vocab_model):
    prompts = [[i, (3 * i) % 16, 5] for i in range(8)]
    solo = greedy_outputs(small_vocab_model, prompts, 2, mtp=False, max_tokens=40)

    async def run():
        async with shardspec.connect(model=str(small_vocab_model), workers=pooled(2), mtp=True, max_seqs=8,
                                     dtype="float32") as engine:
            blocks = [full_blocks(engine) for _ in range(8)]
            step = StepRequest(prefill=[PrefillSpec(seq=i, length=3, max_tokens=40, blocks=blocks[i])
                                        for i in range(8)])
            tensors = {"prompt_ids": torch.tensor([t for p in prompts for t in p])}
            replies = await engine.group.call_all(step, tensors=tensors)
            outputs = {i: list(t) for i, t in zip(replies[0][0].seqs, replies[0][0].tokens)}
            mixed_steps = 0
            while True:
                step = StepRequest(decode=list(range(8)))
                reply = (await engine.group.call_all(step))[0][0]
                if not reply.seqs:
                    break
                mixed_steps += len(set(reply.accepted)) > 1
                for seq, tokens in zip(reply.seqs, reply.tokens):
                    outputs[seq] += tokens
            await engine.group.call_all(ReleaseRequest(list(range(8))))
            return [outputs[i] for i in range(8)], mixed_steps

    batched, mixed_steps = asyncio.run(run())
    assert mixed_steps > 0  # the property under test really happened
    assert batched == solo


# One-sample chi-square tests of MTP-on counts against the exact distribution that plain decoding
# samples from: at n samples their noncentrality (power) equals that of a two-sample test of n x 2
# MTP-on and n x 2 MTP-off samples, so 1,250 here detect what 2,500 + 2,500 sampled runs did.
SAMPLES = 1_250  # generations per distribution compared
PROMPT = (3, 1, 4)
LONG_PROMPT = (3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5, 8, 9, 7, 9, 3, 2, 3, 8, 4, 6, 2, 6, 4, 3, 3, 8, 3, 2, 7, 9, 5, 0, 2, 8)
POSITIONS = (1, 3)  # the 2nd and 4th generated tokens


@functools.cache
def sample_counts(model, n: int, pp: int = 1, positions: tuple[int, ...] = POSITIONS, at_once: int = 64,
                  prompt: tuple[int, ...] = PROMPT, lookahead: str = "on",
                  **sampling) -> tuple[list[Counter], int, int]:
    """Counts of the tokens at `positions` over n generations with MTP, seeds 0..n-1 (fixed: the
    outcome is reproducible; the same arguments are computed once), `at_once` at a time; and the
    first stage's lookaheads whose guess held (at pp > 1 the last stage guesses at every lone step);
    and the generations whose prompt the prefix cache held in part."""
    async def run():
        async with shardspec.connect(model=str(model), workers=pooled(pp), pp=pp, mtp=True, max_seqs=64,
                                     dtype="float32", lookahead=lookahead) as engine:
            outs = await generate_all_seeded(engine, n, sampling, max(positions) + 1, at_once, prompt)
            held = (await engine.stats())[0].lookaheads_right
            return [Counter(o[i] for o, _ in outs) for i in positions], held, sum(hit > 0 for _, hit in outs)

    return asyncio.run(run())


async def generate_all_seeded(engine, n, sampling, max_tokens: int, at_once: int,
                              prompt: tuple[int, ...] = PROMPT) -> list[tuple[list[int], int]]:
    """(tokens, prompt tokens cached) of n seeded generations."""
    semaphore = asyncio.Semaphore(at_once)

    async def one(seed):
        async with semaphore:
            tokens, cached = [], 0
            async for chunk in engine.generate(list(prompt), max_tokens=max_tokens, seed=seed, stop_at_eos=False,
                                               **sampling):
                tokens += chunk.token_ids
                cached = chunk.cached_tokens if chunk.cached_tokens is not None else cached
            return tokens, cached

    return await asyncio.gather(*(one(seed) for seed in range(n)))


@functools.cache
def exact_distributions(model, positions: tuple[int, ...] = POSITIONS, prompt: tuple[int, ...] = PROMPT,
                        **sampling) -> list[torch.Tensor]:
    """The marginal distributions [V] of the tokens at `positions` when sampling without MTP: every
    continuation of PROMPT enumerated (V^3 prefixes at most), each weighted by its probability
    under the same temperature / top-k / top-p filter the workers apply (layers.sampling)."""
    from shardspec.layers.batch import Batch
    from shardspec.layers.parallel import TPGroup
    from shardspec.layers.sampling import target_probs
    from shardspec.models.loader import load_model
    from shardspec.protocol.messages import SamplingParams

    cpu = torch.device("cpu")
    lm = load_model(model, TPGroup(), torch.float32, cpu, with_mtp=False)
    params = SamplingParams(**sampling)
    prefixes, mass, marginals = torch.tensor([prompt]), torch.ones(1, dtype=torch.float64), []
    with torch.no_grad():
        for _ in range(max(positions) + 1):
            logits = lm.lm_head.logits(lm(prefixes, Batch.uncached(*prefixes.shape, cpu)))[:, -1].float()
            joint = target_probs(logits, params).double() * mass[:, None]  # [prefix, next token]
            marginals.append(joint.sum(0))
            reachable = joint.reshape(-1) > 0  # continuations the filter allows, the only ones extended
            vocab = joint.shape[1]
            next_tokens = torch.arange(vocab).repeat(len(prefixes))[:, None]
            extended = torch.cat([prefixes.repeat_interleave(vocab, 0), next_tokens], 1)
            prefixes, mass = extended[reachable], joint.reshape(-1)[reachable]
    return [marginals[i] / marginals[i].sum() for i in positions]


def goodness_of_fit_pvalue(counts: Counter, probs: torch.Tensor) -> float:
    """Chi-square p-value of counts against probs; a token of probability 0 that was sampled fails
    outright, and tokens expected fewer than 5 times are pooled (where the chi-square bound holds)."""
    n = sum(counts.values())
    impossible = {t: c for t, c in counts.items() if probs[t] == 0}
    assert not impossible, f"sampled tokens the filter excludes: {impossible}"
    expected = [(float(p) * n, counts[t]) for t, p in enumerate(probs) if p > 0]
    cells = sorted(expected)
    while len(cells) > 2 and cells[0][0] < 5:  # merge the rarest cell into the next rarest
        (e0, o0), (e1, o1) = cells[0], cells[1]
        cells = sorted([(e0 + e1, o0 + o1), *cells[2:]])
    if len(cells) < 2:
        return 1.0  # one possible token: nothing to test beyond the check above
    return chisquare([o for _, o in cells], [e for e, _ in cells]).pvalue


def assert_mtp_samples_the_exact_distribution(model, pp: int = 1, positions: tuple[int, ...] = POSITIONS,
                                              at_once: int = 64, samples: int = SAMPLES,
                                              prompt: tuple[int, ...] = PROMPT, lookahead: str = "on",
                                              **sampling) -> tuple[int, int]:
    """...and the first stage's lookaheads whose guess held, and the generations that hit the prefix cache."""
    counts_at, held, hits = sample_counts(model, samples, pp, positions, at_once, prompt, lookahead, **sampling)
    for counts, probs in zip(counts_at, exact_distributions(model, positions, prompt, **sampling)):
        assert sum(counts.values()) == samples
        assert goodness_of_fit_pvalue(counts, probs) > P_VALUE_FLOOR, (sorted(counts.items()), probs.tolist())
    return held, hits


@pytest.mark.timeout(900)  # 1,250 generations: a few seconds on an idle 2-core machine, far more when shared
@pytest.mark.parametrize(
    "sampling", [{"temperature": 1.0}, {"temperature": 0.7, "top_k": 6, "top_p": 0.9}], ids=["t1", "t0.7-k6-p0.9"]
)
def test_sampled_distribution_with_mtp_matches_without(small_vocab_model, sampling):
    assert_mtp_samples_the_exact_distribution(small_vocab_model, **sampling)


@pytest.mark.slow  # 1,250 generations more
@pytest.mark.timeout(900)
def test_sampled_distribution_with_mtp_from_prefix_cache_hits_matches_without(small_vocab_model):
    """A 35-token prompt: all but the first batch of generations start from the prefix cache's state
    after its first block."""
    _, hits = assert_mtp_samples_the_exact_distribution(small_vocab_model, prompt=LONG_PROMPT, temperature=1.0)
    assert hits >= SAMPLES - 64


@pytest.mark.timeout(900)
def test_sampled_distribution_with_mtp_at_pp_2_matches_one_worker_without(small_vocab_model):
    """The last stage samples and accepts; the earlier stage commits from its record."""
    assert_mtp_samples_the_exact_distribution(small_vocab_model, pp=2, temperature=1.0)


@pytest.mark.slow  # 640 generations one at a time
@pytest.mark.timeout(900)
def test_sampled_distribution_of_a_lone_sequence_at_pp_2_with_lookahead_matches_one_worker_without():
    """One sequence at a time, so the first stage runs each step on the last stage's guess; the
    tokens at positions 9 and 11 come from steps after guesses that held and that did not. The
    bundled model, whose MTP head agrees with it often enough for guesses to hold; top-k 2 keeps
    the exact distribution cheap to enumerate so far out. Half the samples of the tests above: each
    generation takes a quarter of a second through two stages on the CPU."""

    held, _ = assert_mtp_samples_the_exact_distribution(BUNDLED_MODEL, pp=2, positions=(9, 11), at_once=1,
                                                        samples=640, temperature=1.0, top_k=2)
    assert held > 0


@pytest.mark.slow  # 640 generations one at a time
@pytest.mark.timeout(900)
def test_sampled_distribution_of_a_lone_sequence_at_pp_2_with_a_tree_of_guesses_matches_one_worker_without():
    """As above with the tree of guesses (lookahead "tree"): the first stage runs each step for several
    outcomes of the step in flight, and where a branch holds the last stage verifies its drafts."""
    held, _ = assert_mtp_samples_the_exact_distribution(BUNDLED_MODEL, pp=2, positions=(9, 11), at_once=1,
                                                        samples=640, lookahead="tree", temperature=1.0, top_k=2)
    assert held > 0


def test_sampling_with_mtp_is_reproducible_with_a_seed(small_vocab_model):
    async def run():
        async with shardspec.connect(model=str(small_vocab_model), workers=pooled(2), mtp=True) as engine:
            kwargs = {"max_tokens": 32, "temperature": 0.9, "top_p": 0.95}
            return [await generate_all(engine, [[1, 2]], seed=s, **kwargs) for s in (11, 11, 12)]

    a, b, c = asyncio.run(run())
    assert a == b and a != c


def test_slots_and_states_are_all_free_after_100_generations_with_cancellations(small_vocab_model):
    rng = random.Random(0)

    async def run():
        async with shardspec.connect(model=str(small_vocab_model), workers=pooled(2), mtp=True, max_seqs=6) as engine:
            async def one(i):
                stream = engine.generate(rng.choices(range(16), k=rng.randint(1, 12)),
                                         max_tokens=rng.randint(1, 40), temperature=rng.choice([0.0, 1.0]), seed=i)
                cancel_after = rng.choice([None, 0, 1, 3])
                chunks = 0
                async for _ in stream:
                    chunks += 1
                    if cancel_after is not None and chunks > cancel_after:
                        break
                await stream.aclose()

            tasks = [asyncio.create_task(one(i)) for i in range(100)]
            for task in tasks[::7]:  # and some cancelled from outside, at random moments
                await asyncio.sleep(rng.random() * 0.01)
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            await generate_all(engine, [[1]], max_tokens=2)  # pending releases ride before this
            return await engine.stats()

    for stats in asyncio.run(run()):
        assert stats.slots_free == stats.slots_total == 6
        assert stats.live_sequences == []


def test_pipelined_and_unpipelined_loops_give_the_same_output(small_vocab_model):
    prompts = [[1, 2, 3], [9, 9], [15]]

    async def run(pipeline):
        async with shardspec.connect(model=str(small_vocab_model), workers=pooled(2), pipeline=pipeline) as engine:
            return await generate_all(engine, prompts, max_tokens=30)

    assert asyncio.run(run(True)) == asyncio.run(run(False))


def test_asking_for_mtp_on_a_checkpoint_without_it_is_a_clear_error(tmp_path):
    from shardspec.testing.random_checkpoint import tiny_config, write_random_checkpoint

    write_random_checkpoint(tmp_path, tiny_config(), seed=2, mtp=False)

    async def attempt():
        async with shardspec.connect(model=str(tmp_path), local=1, mtp=True):
            pass

    with pytest.raises(ValueError, match="no MTP weights"):
        asyncio.run(attempt())

    async def default_is_plain():
        async with shardspec.connect(model=str(tmp_path), local=1) as engine:
            return engine.draft_tokens, await generate_all(engine, [[1]], max_tokens=3)

    assert asyncio.run(default_is_plain())[0] == 0


def test_forced_acceptance_is_refused_unless_enabled_and_marked_when_used(small_vocab_model, monkeypatch):
    async def run():
        async with shardspec.connect(model=str(small_vocab_model), local=1, forced_acceptance=1.0) as engine:
            async for chunk in engine.generate([1, 2], max_tokens=12):
                final = chunk
            return final.stats

    monkeypatch.delenv(FORCED_ACCEPTANCE_ENV, raising=False)
    with pytest.raises(ValueError, match=FORCED_ACCEPTANCE_ENV):
        asyncio.run(run())
    monkeypatch.setenv(FORCED_ACCEPTANCE_ENV, "1")
    stats = asyncio.run(run())
    assert stats["forced_acceptance"] == 1.0
    assert stats["acceptance_per_position"] == [1.0, 1.0, 1.0]  # every draft kept, as forced


@pytest.mark.parametrize("draft_tokens", [3, 4])
def test_a_sequence_that_fills_its_context_accepting_every_draft_finishes_cleanly(small_vocab_model, draft_tokens):
    """The last step of a sequence that reaches max_seq_len still chains k drafts past it: the
    caches must have room for them (and nothing may spill into another slot)."""
    from shardspec.layers.parallel import TPGroup
    from shardspec.models.loader import load_model
    from shardspec.protocol.messages import SamplingParams
    from shardspec.shard_worker.decoder import Decoder
    from shardspec.testing.grants import Grants

    model = load_model(small_vocab_model, TPGroup(), torch.float32, torch.device("cpu"), with_mtp=True)
    runner = Decoder(model, torch.device("cpu"), 2, 16, 512, draft_tokens, forced_acceptance=1.0)
    spec = PrefillSpec(seq=0, length=2, sampling=SamplingParams(), max_tokens=1000)
    tokens = Grants(runner).step(StepRequest(prefill=[spec]), torch.tensor([5, 7])).tokens[0]
    while not runner.sequences[0].finished:
        tokens += runner.step(StepRequest(decode=[0]), torch.empty(0, dtype=torch.long)).tokens[0]
    assert runner.sequences[0].finished == "length" and len(tokens) == 16 - 2


@pytest.mark.slow  # (the other TP tests run through shared memory, the default)
@pytest.mark.parametrize(("allreduce", "path"), [("auto", "shm"), ("gloo", "gloo")])
def test_tp_2_on_one_host_gives_one_worker_s_greedy_tokens_through_shared_memory_and_through_gloo(
        small_vocab_model, allreduce, path):
    """fp32 greedy, MTP on and off: the collectives' path changes no token (both sum in rank order)."""
    async def run(tp: int, mtp: bool) -> tuple[str, list[list[int]]]:
        async with shardspec.connect(model=str(small_vocab_model), workers=pooled(tp), mtp=mtp, max_seqs=4,
                                     dtype="float32", worker_options=WorkerOptions(allreduce=allreduce)) as engine:
            return engine.group.collectives, await generate_all(engine, PROMPTS, max_tokens=32)

    for mtp in (True, False):
        taken, split = asyncio.run(run(2, mtp))
        assert taken == path
        assert split == asyncio.run(run(1, mtp))[1]


@pytest.mark.slow
def test_bf16_deterministic_tp_2_gives_the_same_tokens_through_shared_memory_as_through_gloo():
    """Both sum two ranks' parts as a + b: the path changes no bit. (TP = 2 and TP = 1 differ in bf16:
    a row-parallel matmul sums its halves apart, and deterministic mode is batch-, not TP-invariant.)"""
    async def run(allreduce: str) -> list[list[int]]:
        async with shardspec.connect(model=str(BUNDLED_MODEL), workers=pooled(2), dtype="bfloat16",
                                     deterministic=True, max_seqs=4,
                                     worker_options=WorkerOptions(allreduce=allreduce)) as engine:
            return await generate_all(engine, ["def fibonacci(n):", "class Stack:\n    def"], max_tokens=48)

    assert asyncio.run(run("shm")) == asyncio.run(run("gloo"))
