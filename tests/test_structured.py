"""Structured output: the workers mask the target's and the drafts' logits with an llguidance
grammar, so every output matches its constraint and MTP stays exact."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import pooled
from llguidance import LLMatcher

import shardspec
from shardspec.cli import BUNDLED_MODEL
from shardspec.constraints import grammar_of, llg_tokenizer

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "kind": {"enum": ["cat", "dog", "owl"]},
        "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 3},
        "home": {"type": "object", "properties": {"floor": {"type": "integer", "minimum": -2, "maximum": 9}},
                 "required": ["floor"], "additionalProperties": False},
    },
    "required": ["name", "age", "kind", "tags", "home"],
    "additionalProperties": False,
}


def conforms(value) -> bool:
    """SCHEMA, checked by hand."""
    return (isinstance(value, dict) and set(value) == set(SCHEMA["properties"])
            and isinstance(value["name"], str) and len(value["name"]) <= 12
            and type(value["age"]) is int and 0 <= value["age"] <= 120 and value["kind"] in ("cat", "dog", "owl")
            and isinstance(value["tags"], list) and len(value["tags"]) <= 3 and set(value["tags"]) <= {"a", "b", "c"}
            and isinstance(value["home"], dict) and set(value["home"]) == {"floor"}
            and type(value["home"]["floor"]) is int and -2 <= value["home"]["floor"] <= 9)


async def generate(engine, prompt, **options) -> tuple[list[int], str, dict]:
    tokens, text, stats = [], "", None
    async for chunk in engine.generate(prompt, **options):
        tokens += chunk.token_ids
        text += chunk.text
        stats = chunk.stats or stats
    return tokens, text, stats


@pytest.mark.slow  # 110 generations
def test_json_schema_outputs_sampled_with_mtp_all_validate_beside_unconstrained_ones():
    """100 generations at temperature 1 with MTP, in batches with unconstrained ones: every
    constrained output is JSON that conforms to the schema, token by token what the grammar allows,
    and MTP still accepts drafts under the grammar."""
    async def run():
        async with shardspec.connect(model=str(BUNDLED_MODEL), workers=pooled(1), max_seqs=16) as engine:
            constrained = [generate(engine, "def f():", max_tokens=160, temperature=1.0, seed=seed,
                                    structured_output={"json": SCHEMA}) for seed in range(100)]
            free = [generate(engine, "import os", max_tokens=40, temperature=1.0, seed=seed) for seed in range(10)]
            return (await asyncio.gather(*constrained, *free))[:100]

    tokenizer = llg_tokenizer(Path(BUNDLED_MODEL) / "tokenizer.json", 4096, [0])
    outputs = asyncio.run(run())
    for tokens, text, _ in outputs:
        matcher = LLMatcher(tokenizer, grammar_of({"json": SCHEMA}))
        assert matcher.validate_tokens(tokens) == len(tokens), text
        assert conforms(json.loads(text)), text
    assert sum(stats["accepted_tokens"] for _, _, stats in outputs) > 0


@pytest.mark.parametrize("constraint", [{"json": SCHEMA}, pytest.param({"regex": r"[0-9]{3}-[a-z]{2,4}"},
                                                                      marks=pytest.mark.slow),
                                        {"choice": ["yes", "no", "maybe so"]}])
def test_greedy_output_under_a_grammar_is_the_same_with_mtp_as_without(constraint):
    async def run(mtp: bool):
        async with shardspec.connect(model=str(BUNDLED_MODEL), workers=pooled(1), mtp=mtp, deterministic=True,
                                     max_seqs=2) as engine:
            return await generate(engine, "def f():", max_tokens=80, temperature=0, structured_output=constraint)

    with_mtp, without = asyncio.run(run(True)), asyncio.run(run(False))
    assert with_mtp[0] == without[0]
    if "choice" in constraint:
        assert with_mtp[1] in constraint["choice"]
    if "regex" in constraint:
        assert len(with_mtp[1]) >= 6 and with_mtp[1][3] == "-"


@pytest.mark.slow  # (three engines, five workers)
def test_greedy_output_under_a_grammar_without_mtp_is_the_same_at_tp_2_and_pp_2_as_on_one_worker():
    """Without MTP the tokens are chosen under the masks on the device (Decoder._masked_greedy): at TP = 2
    from the gathered logits of both ranks, at PP = 2 on the last stage; both give one worker's output."""
    async def run(**layout):
        workers = pooled(layout.get("tp", 1) * layout.get("pp", 1))
        async with shardspec.connect(model=str(BUNDLED_MODEL), workers=workers, mtp=False, deterministic=True,
                                     dtype="float32", max_seqs=2, **layout) as engine:
            return await asyncio.gather(*(generate(engine, prompt, max_tokens=48, temperature=0,
                                                   structured_output={"json": SCHEMA}) for prompt in ("def f():", "{")))

    one = [out[:2] for out in asyncio.run(run())]  # (tokens, text)
    assert [out[:2] for out in asyncio.run(run(tp=2))] == one
    assert [out[:2] for out in asyncio.run(run(pp=2))] == one
    assert all(text.startswith("{") for _, text in one)


@pytest.mark.parametrize(("constraint", "message"), [
    ({"json": {"type": "object", "properties": 5}}, "does not compile"),
    ({"json": "{not json"}, "not JSON"),
    ({"regex": "[a-"}, "does not compile"),
    ({"choice": []}, "non-empty list"),
    ({"xml": "<a/>"}, "one of json"),
    ({"grammar": "start: foo"}, "does not compile"),
])
def test_a_constraint_that_does_not_compile_is_a_value_error_naming_it(constraint, message):
    async def run():
        async with shardspec.connect(model=str(BUNDLED_MODEL), workers=pooled(1)) as engine:
            with pytest.raises(ValueError, match=message):
                await generate(engine, "def f():", max_tokens=4, structured_output=constraint)
            return await generate(engine, "def f():", max_tokens=4, temperature=0)  # the engine serves on

    assert len(asyncio.run(run())[0]) == 4


def test_the_text_of_an_end_of_text_token_is_not_in_the_output():
    async def run():
        async with shardspec.connect(model=str(BUNDLED_MODEL), workers=pooled(1)) as engine:
            return await generate(engine, "def f():", max_tokens=40, temperature=0,
                                  structured_output={"choice": ["ok"]})

    tokens, text, _ = asyncio.run(run())
    assert tokens[-1] == 0 and text == "ok"  # the grammar's end, then end of text


def test_logit_bias_changes_greedy_tokens_exactly_as_on_the_logits_and_keeps_mtp_exact():
    """A bias of -100 on the tokens of the unbiased greedy output removes them; +100 on one token
    makes it every token; with MTP the biased greedy output equals the one without (--deterministic)."""
    async def run(mtp: bool, bias: dict[int, float] | None):
        async with shardspec.connect(model=str(BUNDLED_MODEL), workers=pooled(1), mtp=mtp, deterministic=True,
                                     max_seqs=2) as engine:
            return await generate(engine, "def f():", max_tokens=24, temperature=0, logit_bias=bias,
                                  stop_token_ids=None)

    free = asyncio.run(run(True, None))[0]
    banned = {token: -100.0 for token in set(free)}
    with_mtp, without = asyncio.run(run(True, banned)), asyncio.run(run(False, banned))
    assert with_mtp[0] == without[0]
    assert not set(with_mtp[0]) & set(banned)
    forced = asyncio.run(run(True, {1234: 100.0}))[0]
    assert forced == [1234] * 24


def test_min_tokens_keeps_the_end_of_text_away_until_then_and_bad_biases_are_value_errors():
    async def run():
        async with shardspec.connect(model=str(BUNDLED_MODEL), workers=pooled(1), max_seqs=4) as engine:
            held = await generate(engine, "def f():", max_tokens=40, temperature=0, min_tokens=12,
                                  logit_bias={0: 60.0})
            for bias, message in [({4096: 1.0}, r"\[0, 4096\)"), ({5: 101.0}, r"\[-100, 100\]"),
                                  ({5: float("nan")}, r"\[-100, 100\]")]:
                with pytest.raises(ValueError, match=message):
                    await generate(engine, "def f():", max_tokens=4, logit_bias=bias)
            with pytest.raises(ValueError, match="min_tokens"):
                await generate(engine, "def f():", max_tokens=4, min_tokens=5)
            return held

    held = asyncio.run(run())
    assert 0 not in held[0][:12] and held[0][12:] == [0]  # end of text (biased up) as soon as it may come


def test_forced_drafts_are_the_grammars_only_tokens_and_their_masks_are_the_fresh_ones():
    """Constraint.forced gives the tokens the grammar alone allows next (each the single token of its
    mask); the next masks over drafts that start with them reuse the masks computed on the way, and
    equal masks computed afresh (also over drafts that part from them)."""
    from shardspec.layers.grammar import Constraint, single

    tokenizer = llg_tokenizer(Path(BUNDLED_MODEL) / "tokenizer.json", 4096, [0])
    grammar = grammar_of({"json": SCHEMA})
    text = tokenizer.tokenize_str('{"name":"ab","age":7,')  # the next key is the schema's: forced
    constraint = Constraint(LLMatcher(tokenizer, grammar), np.zeros(0, dtype=np.uint8))
    assert constraint.accept(text)
    forced = constraint.forced(6)
    assert tokenizer.decode_str(forced) == '"kind":"'
    fresh = Constraint(LLMatcher(tokenizer, grammar), np.zeros(0, dtype=np.uint8))
    assert fresh.accept(text)
    for token in forced:
        assert single(bytearray(fresh.masks([], 1).numpy().tobytes())) == token
        assert fresh.accept([token])
    for drafts in ([*forced, 5, 6], [*forced[:1], 9, 9, 9]):
        again = Constraint(LLMatcher(tokenizer, grammar), np.zeros(0, dtype=np.uint8))
        assert again.accept(text)
        constraint.forced(6)
        assert torch.equal(constraint.masks(drafts, len(drafts) + 1), again.masks(drafts, len(drafts) + 1))


def test_a_batch_of_draft_rows_is_masked_as_each_row_alone():
    """masked_each (the MTP chain's drafts under grammars, all rows at once) gives each row what
    `masked` gives it alone: its grammar's next tokens, and all -inf where the grammar has failed."""
    from shardspec.layers.grammar import Constraint, masked, masked_each

    tokenizer = llg_tokenizer(Path(BUNDLED_MODEL) / "tokenizer.json", 4096, [0])
    grammar = grammar_of({"json": SCHEMA})
    prefixes = ['{"name":"ab","age":7,', '{"na', "", "{"]
    constraints = []
    for prefix in prefixes:
        constraint = Constraint(LLMatcher(tokenizer, grammar), np.zeros(0, dtype=np.uint8))
        assert constraint.accept(tokenizer.tokenize_str(prefix))
        constraints.append(constraint)
    assert not constraints[3].accept(tokenizer.tokenize_str("]]"))  # refused: the grammar fails
    logits = torch.randn(len(prefixes), 4096, generator=torch.Generator().manual_seed(0))
    alone = torch.cat([masked(logits[b : b + 1].clone(), c, []) for b, c in enumerate(constraints)])
    together = masked_each(logits.clone(), constraints)
    assert torch.equal(together, alone)
    assert torch.isinf(together[3]).all() and torch.isfinite(together[:3]).any(-1).all()
    assert len({tuple(torch.isfinite(row).nonzero().flatten().tolist()) for row in together[:3]}) == 3
