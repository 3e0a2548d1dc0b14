"""Log-probabilities from the workers: the target model's log-softmax, against transformers (fp32)."""

from __future__ import annotations

import asyncio

import pytest
import torch
from conftest import pooled
from reference import hf_logits, hf_model

import shardspec
from shardspec.orchestrator.requests import EngineError, LogprobTable
from shardspec.protocol.messages import StepReply

PROMPT = [3, 17, 101, 44, 9, 250, 7, 88, 130, 5, 61, 402, 19, 2, 77, 300, 41, 8, 199, 23]
TOP = 5


async def _generate(engine, **kwargs) -> tuple[list[int], list, list]:
    """(tokens, token logprobs, prompt logprobs) of one generation."""
    tokens, logprobs, prompt_logprobs = [], [], []
    async for chunk in engine.generate(PROMPT, logprobs=TOP, prompt_logprobs=TOP, **kwargs):
        tokens += chunk.token_ids
        logprobs += chunk.logprobs
        prompt_logprobs += chunk.prompt_logprobs or []
    return tokens, logprobs, prompt_logprobs


def _runs(model, mtp: bool) -> dict[str, tuple]:
    async def run():
        # TP 2: vocabulary-parallel logits; prefill chunks of 8 tokens: the prompt's rows span passes
        async with shardspec.connect(model=str(model), workers=pooled(2), mtp=mtp, prefill_chunk=8,
                                     max_seq_len=128) as engine:
            greedy = await _generate(engine, max_tokens=12, temperature=0.0)
            sampled = await _generate(engine, max_tokens=12, temperature=1.0, seed=7)
            return {"greedy": greedy, "sampled": sampled}
    return asyncio.run(run())


@pytest.fixture(scope="module")
def runs(tiny_model) -> dict[bool, dict[str, tuple]]:
    return {mtp: _runs(tiny_model, mtp) for mtp in (True, False)}


def _check_against(reference: torch.Tensor, tokens: list[int], entries: list) -> None:
    """entries[i] is tokens[i]'s logprob under log_softmax(reference[i]), with the top TOP of that row."""
    assert [e.token for e in entries] == tokens
    logp = torch.log_softmax(reference, -1)
    chosen = torch.tensor([e.logprob for e in entries])
    torch.testing.assert_close(chosen, logp[torch.arange(len(tokens)), torch.tensor(tokens)], atol=1e-4, rtol=0)
    values, ids = logp.topk(TOP, -1)
    torch.testing.assert_close(torch.tensor([[v for _, v in e.top] for e in entries]), values, atol=1e-4, rtol=0)
    assert all(len(e.top) == TOP for e in entries)
    for entry, row_ids, row in zip(entries, ids.tolist(), logp):  # ids equal up to near-ties
        assert [t for t, _ in entry.top] == row_ids or torch.allclose(row[[t for t, _ in entry.top]],
                                                                       row[row_ids], atol=1e-4)


@pytest.fixture(scope="module")
def reference(tiny_model):
    return hf_model(tiny_model)


@pytest.mark.parametrize("mtp", [True, False])
@pytest.mark.parametrize("kind", ["greedy", "sampled"])
def test_token_and_prompt_logprobs_equal_the_model_s_log_softmax(reference, runs, mtp, kind):
    tokens, logprobs, prompt_logprobs = runs[mtp][kind]
    logits = hf_logits(reference, PROMPT + tokens)
    _check_against(logits[: len(PROMPT) - 1], PROMPT[1:], prompt_logprobs)
    _check_against(logits[len(PROMPT) - 1 : -1], tokens, logprobs)
    if kind == "greedy":
        assert tokens == logits[len(PROMPT) - 1 : -1].argmax(-1).tolist()


def test_greedy_logprobs_with_mtp_equal_logprobs_without(runs):
    """(Sampled runs draw other tokens with MTP on, from the same distributions: the test above checks
    those against the model.)"""
    (tokens_on, on, prompt_on), (tokens_off, off, prompt_off) = runs[True]["greedy"], runs[False]["greedy"]
    assert tokens_on == tokens_off
    for a, b in zip(on + prompt_on, off + prompt_off, strict=True):
        assert a.token == b.token and abs(a.logprob - b.logprob) < 1e-4


def test_logprobs_from_the_last_of_two_pipeline_stages_equal_those_of_one_stage(tiny_model, runs):
    async def run():
        async with shardspec.connect(model=str(tiny_model), workers=pooled(2), pp=2, prefill_chunk=8,
                                     max_seq_len=128) as engine:
            return await _generate(engine, max_tokens=12, temperature=0.0)

    tokens, logprobs, prompt_logprobs = asyncio.run(run())
    tokens_tp, logprobs_tp, prompt_tp = runs[True]["greedy"]
    assert tokens == tokens_tp
    for a, b in zip(logprobs + prompt_logprobs, logprobs_tp + prompt_tp, strict=True):
        assert a.token == b.token and abs(a.logprob - b.logprob) < 1e-4


def test_a_logprobs_value_out_of_range_is_refused_naming_it(tiny_model):
    async def run():
        async with shardspec.connect(model=str(tiny_model), workers=pooled(1), max_seq_len=64) as engine:
            for name, value in (("logprobs", 21), ("prompt_logprobs", -2), ("logprobs", 1.5)):
                with pytest.raises(ValueError, match=name):
                    async for _ in engine.generate(PROMPT, max_tokens=2, **{name: value}):
                        pass
            return [t async for c in engine.generate(PROMPT, max_tokens=2) for t in c.token_ids]
    assert len(asyncio.run(run())) == 2  # the engine still serves


def _reply(rows: list[int]) -> StepReply:
    return StepReply(seqs=[1, 2], tokens=[[5], [6, 7]], accepted=[-1, 1], drafts=[[], []], finished=["", ""],
                     step_s=0.0, logprob_rows=rows)


GOOD = {"logprobs": torch.zeros(3), "top_logprobs": torch.zeros(3, 2), "top_ids": torch.zeros(3, 2, dtype=torch.int64)}


@pytest.mark.parametrize(
    ("rows", "tensors"),
    [
        ([1, 2], {}),
        ([1], GOOD),
        ([1, -1], GOOD),
        ([1, 3], GOOD),
        ([1, 2], GOOD | {"logprobs": torch.zeros(3, dtype=torch.float64)}),
        ([1, 2], GOOD | {"top_ids": torch.zeros(3, 2)}),
        ([1, 2], GOOD | {"top_logprobs": torch.zeros(3, 3)}),
        ([1, 2], GOOD | {"top_logprobs": torch.zeros(3)}),
    ],
)
def test_a_reply_whose_logprob_tensors_do_not_match_its_rows_is_refused(rows, tensors):
    with pytest.raises(EngineError, match="log-probability"):
        LogprobTable(_reply(rows), tensors)


def test_a_reply_with_fewer_rows_or_columns_than_asked_for_is_refused():
    table = LogprobTable(_reply([1, 2]), GOOD)
    table.check(1, 2, 2)
    with pytest.raises(EngineError, match="asked for 3 of 2"):
        table.check(1, 3, 2)
    with pytest.raises(EngineError, match="asked for 2 of 5"):
        table.check(1, 2, 5)
