"""Presence, frequency and repetition penalties: applied to the target's distribution, so that greedy
decoding is the argmax of the penalised logits, with MTP on as with it off."""

from __future__ import annotations

import asyncio

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
