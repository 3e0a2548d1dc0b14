"""Presence, frequency and repetition penalties: applied to the target's distribution, so that greedy
decoding is the argmax of the penalised logits, with MTP on as with it off."""

from __future__ import annotations

import asyncio
import random

import pytest
from conftest import pooled
from reference import hf_logits, hf_model

import shardspec

PROMPT = [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5]
PENALTIES = {"presence_penalty": 0.7, "frequency_penalty": 0.4, "repetition_penalty": 1.6}
MAX_TOKENS = 16


def _reference_greedy(model, presence_penalty: float, frequency_penalty: float, repetition_penalty: float) -> list[int]:
    """Greedy decoding with vLLM's penalties, spelled out token by token on transformers' logits."""
    presence, frequency, repetition = presence_penalty, frequency_penalty, repetition_penalty
    out: list[int] = []
    for _ in range(MAX_TOKENS):
        logits = hf_logits(model, PROMPT + out)[-1].clone()
        for token in range(logits.shape[0]):
            count = out.count(token)
            if repetition != 1.0 and (count or token in PROMPT):
                logits[token] = logits[token] / repetition if logits[token] > 0 else logits[token] * repetition
            logits[token] -= frequency * count + presence * (count > 0)
        out.append(int(logits.argmax()))
    return out


def _greedy(model, mtp: bool) -> list[int]:
    async def run():
        async with shardspec.connect(model=str(model), workers=pooled(1), mtp=mtp, max_seq_len=64) as engine:
            return [t async for c in engine.generate(PROMPT, max_tokens=MAX_TOKENS, stop_at_eos=False, **PENALTIES)
                    for t in c.token_ids]
    return asyncio.run(run())


@pytest.mark.parametrize("mtp", [True, False])
def test_greedy_with_penalties_is_the_argmax_of_the_penalised_logits(small_vocab_model, mtp):
    expected = _reference_greedy(hf_model(small_vocab_model), **PENALTIES)
    assert expected != _reference_greedy(hf_model(small_vocab_model), 0.0, 0.0, 1.0)  # the penalties matter here
    assert _greedy(small_vocab_model, mtp) == expected


def test_penalties_outside_their_range_are_refused_naming_them(small_vocab_model):
    async def run():
        async with shardspec.connect(model=str(small_vocab_model), workers=pooled(1), max_seq_len=64) as engine:
            for name, value in (("presence_penalty", 2.5), ("frequency_penalty", -3.0), ("repetition_penalty", 0.0)):
                with pytest.raises(ValueError, match=name):
                    async for _ in engine.generate(PROMPT, max_tokens=2, **{name: value}):
                        pass
    asyncio.run(run())


@pytest.mark.parametrize(("tp", "pp", "mtp"), [(1, 1, True), pytest.param(1, 1, False, marks=pytest.mark.slow),
                                               pytest.param(2, 1, True, marks=pytest.mark.slow),
                                               pytest.param(2, 2, True, marks=pytest.mark.slow)])
def test_a_request_whose_numbers_go_bad_fails_alone_while_the_others_stream_their_solo_tokens(tp, pp, mtp):
    """repetition_penalty 1e-39 divides the logits of seen tokens into infinity: at the prefill for a
    prompt whose tokens the model likes, at the first verify for a one-token prompt it does not. The
    request fails with a ValueError naming why; the others in the same steps, on every rank and
    stage, give what they give alone, and the engine serves on."""
    from shardspec.cli import BUNDLED_MODEL

    async def run():
        async with shardspec.connect(model=str(BUNDLED_MODEL), workers=pooled(tp * pp), pp=pp, mtp=mtp,
                                     dtype="float32", max_seqs=8) as engine:
            def one(prompt, **options):
                return _tokens_or_failure(engine, prompt, 16, **options)

            good = [[5, 6, 7], "def f(x):", [100, 200]]
            alone = [await one(p) for p in good]
            bad = [one("def f(x): return x", repetition_penalty=1e-39), one([4000], repetition_penalty=1e-39),
                   one([4000], repetition_penalty=1e-39, temperature=1.0, seed=3)]
            together = await asyncio.gather(*(one(p) for p in good), *bad)
            return alone, together, await one("def f(x):")

    alone, together, after = asyncio.run(run())
    assert together[:3] == alone and after == alone[1]
    failures = together[3:]
    assert all(f[0] == "failed" and "no token can be sampled" in f[2] for f in failures)
    assert [len(f[1]) for f in failures] == [0, 1, 1]  # at the prefill, then at a verify step


async def _tokens_or_failure(engine, prompt, max_tokens: int, **options):
    """The request's tokens, or ("failed", the tokens before, the SamplingError's text)."""
    from shardspec.orchestrator.requests import SamplingError

    tokens = []
    try:
        async for chunk in engine.generate(prompt, max_tokens=max_tokens, stop_at_eos=False, **options):
            tokens += chunk.token_ids
    except SamplingError as exc:
        return "failed", tokens, str(exc)
    return tokens


def _extreme_options(rng: random.Random, vocab: int) -> dict:
    """Sampling options with several values at the edges of the ranges the engine accepts."""
    from shardspec.protocol.messages import MAX_LOGPROBS, MIN_TEMPERATURE, MIN_TOP_P

    options = {
        "temperature": rng.choice([0.0, MIN_TEMPERATURE, 1e-3, 1.0, 100.0]),
        "top_k": rng.choice([0, 1, 2, vocab, 1 << 30]),
        "top_p": rng.choice([MIN_TOP_P, 1e-3, 0.5, 1.0]),
        "presence_penalty": rng.choice([-2.0, 0.0, 2.0]),
        "frequency_penalty": rng.choice([-2.0, 0.0, 2.0]),
        "repetition_penalty": rng.choice([1e-39, 1e-3, 1.0, 100.0]),
        "logprobs": rng.choice([None, 0, MAX_LOGPROBS]),
        "seed": rng.randrange(1 << 20),
    }
    if rng.random() < 0.5:
        options["logit_bias"] = {rng.randrange(vocab): rng.choice([-100.0, 100.0]) for _ in range(rng.randint(1, 8))}
    return options


@pytest.mark.parametrize(("tp", "pp"), [(1, 1), pytest.param(2, 1, marks=pytest.mark.slow),
                                        pytest.param(1, 2, marks=pytest.mark.slow)])
def test_a_row_with_extreme_accepted_sampling_options_ends_alone_and_the_others_give_their_solo_tokens(tp, pp):
    """Property test: one row of a batch of three draws random extreme values of every sampling
    option the engine accepts (MTP on, deterministic mode, where a row's tokens do not depend on its
    batch). It finishes, or fails alone with a clear error; the two greedy rows beside it give what
    they give alone, every time, and the engine serves on."""
    from shardspec.cli import BUNDLED_MODEL

    rng = random.Random(11 + tp + 2 * pp)

    async def run():
        async with shardspec.connect(model=str(BUNDLED_MODEL), workers=pooled(tp * pp), pp=pp, mtp=True,
                                     deterministic=True, max_seqs=4) as engine:
            vocab = engine.load_info.vocab_size

            def one(prompt, **options):
                return _tokens_or_failure(engine, prompt, 12, **options)

            good = ["def f(x):", [5, 6, 7]]
            alone = [await one(p) for p in good]
            ends = []
            for _ in range(6):
                options = _extreme_options(rng, vocab)
                *together, odd = await asyncio.gather(*(one(p) for p in good), one("class A:", **options))
                assert together == alone, options
                ends.append(odd)
            return ends, await one(good[0]) == alone[0]

    ends, serves_on = asyncio.run(run())
    assert serves_on
    for end in ends:
        finished = isinstance(end, list) and len(end) == 12
        assert finished or (end[0] == "failed" and "no token can be sampled" in end[2]), end
