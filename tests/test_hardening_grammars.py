"""Structured output against a hostile client: a grammar is compiled once, in a compile process whose
crash, time-out or memory blow-up refuses that request alone (orchestrator.grammars); workers build
it off their steps (shard_worker.grammars); a constraint that cannot produce a valid output is an
error, never a 200 whose text breaks it; masks never allow a special token the matcher refuses."""

from __future__ import annotations

import asyncio
import json
import types
from pathlib import Path

import httpx
import pytest
import torch
from conftest import pooled
from llguidance import LLMatcher
from test_agents import ADDED, TOOLS, tokenizers
from test_agents import chat_server as chat_server  # (a fixture)

import shardspec
from shardspec.cli import BUNDLED_MODEL
from shardspec.constraints import (
    MAX_GRAMMAR_CHARS,
    MAX_GRAMMAR_RULES,
    MAX_SCHEMA_REFS,
    ConstraintError,
    grammar_of,
    parser_limits,
    special_ids,
)
from shardspec.layers.grammar import Constraint
from shardspec.orchestrator.grammars import GrammarCompiler
from shardspec.orchestrator.requests import GrammarError, Request, deliver
from shardspec.protocol import messages
from shardspec.protocol.messages import FAILED, SamplingParams, SequenceError, StepReply
from shardspec.shard_worker import constrained
from shardspec.shard_worker.results import SpecCounters, StepResult

TOKENIZER = Path(BUNDLED_MODEL) / "tokenizer.json"
ALL_OF_20 = {"json": {"allOf": [{"type": "string", "pattern": f".*{chr(97 + i)}.*"} for i in range(20)]}}


def ref_chain(links: int) -> dict:
    defs = {f"d{i}": {"$ref": f"#/$defs/d{i + 1}"} for i in range(links)} | {f"d{links}": {"type": "string"}}
    return {"json": {"$ref": "#/$defs/d0", "$defs": defs}}


def compiler(**overrides) -> GrammarCompiler:
    options = dict(processes=1, timeout_s=10.0, memory_bytes=2 << 30, mask_budget_s=0.05) | overrides
    return GrammarCompiler(TOKENIZER, 4096, [0], [], **options)


async def refused(compile_with: GrammarCompiler, constraint: dict) -> str:
    with pytest.raises(ConstraintError) as caught:
        await compile_with.compile(constraint)
    return str(caught.value)


def refusal(constraint: dict, **overrides) -> str:
    """Why a compiler with `overrides` refuses `constraint` (it must)."""
    async def run() -> str:
        grammars = compiler(**overrides)
        try:
            return await refused(grammars, constraint)
        finally:
            await grammars.close()

    return asyncio.run(run())


# --- before llguidance ---------------------------------------------------------------------------


def test_constraints_past_the_structural_limits_are_refused_before_llguidance_sees_them():
    """The cases that segfaulted the server: a $ref chain of 3,000 links (106 KB) and a Lark grammar
    of 3,000 chained rules; and nesting past the depth limit."""
    with pytest.raises(ConstraintError, match=r"\$ref"):
        grammar_of(ref_chain(3000))
    chained = "start: r0\n" + "".join(f"r{i}: r{i + 1}\n" for i in range(3000)) + 'r3000: "x"\n'
    with pytest.raises(ConstraintError, match="rules"):
        grammar_of({"grammar": chained})
    nested: dict = {"type": "string"}
    for _ in range(100):
        nested = {"type": "array", "items": nested}
    with pytest.raises(ConstraintError, match="nests deeper"):
        grammar_of({"json": nested})
    assert grammar_of(ref_chain(MAX_SCHEMA_REFS - 1))  # within the limits: compiles
    assert MAX_GRAMMAR_RULES < 3000 and MAX_GRAMMAR_CHARS == messages.MAX_GRAMMAR_CHARS


def test_the_boolean_schemas_are_any_json_value_and_none():
    assert grammar_of({"json": True}) == grammar_of({"json": {}})
    with pytest.raises(ConstraintError, match="allows no value"):
        grammar_of({"json": False})


# --- the compile processes -----------------------------------------------------------------------


def test_a_constraint_that_runs_the_compiler_out_of_memory_is_refused_and_the_next_compiles():
    """allOf of 20 patterns grows llguidance to gigabytes (31 s and 13.6 GB, six at once): under a
    300 MiB limit its compile process dies, the request is refused, and a new process compiles the next."""
    async def run():
        grammars = compiler(memory_bytes=300 << 20)
        try:
            why = await refused(grammars, ALL_OF_20)
            assert "crashed the grammar compiler or ran it out of memory" in why
            assert (await grammars.compile({"regex": "[a-z]+"})).grammar
            assert await refused(grammars, ALL_OF_20) == why  # remembered: no second crash
            assert grammars.crashes == 1
        finally:
            await grammars.close()

    asyncio.run(run())


@pytest.mark.slow  # (a chat server of its own, or seconds of CPU time)
def test_a_constraint_past_its_cpu_time_limit_is_refused():
    assert "took over" in refusal(ALL_OF_20, timeout_s=1.0)


def test_a_constraint_whose_first_mask_is_over_the_step_budget_is_refused():
    """A 33-byte regex whose every mask takes 0.1-0.8 s: refused before it reaches a worker."""
    assert "first mask took" in refusal({"regex": "( {1000}){300}"}, mask_budget_s=0.01)


def test_the_same_constraint_asked_64_times_at_once_compiles_once():
    async def run():
        grammars = compiler(processes=2)
        schema = {"json": {"type": "object", "properties": {f"p{i}": {"type": "integer"} for i in range(2000)},
                           "required": [f"p{i}" for i in range(2000)]}}
        try:
            results = await asyncio.gather(*(grammars.compile(schema) for _ in range(64)))
            assert len({r.key for r in results}) == 1 and grammars.compiles == 1
        finally:
            await grammars.close()

    asyncio.run(run())


# --- masks ------------------------------------------------------------------------------------------


def test_masks_never_allow_a_special_token_the_matcher_refuses():
    """The chat model's </think> is a token of its own: llguidance's mask for the regex "hello </think>
    world" allows it after "hello ", and its matcher then refuses it."""
    hf, llg = tokenizers()
    think = hf.token_to_id("</think>")
    matcher = LLMatcher(llg, grammar_of({"regex": "hello </think> world"}, ADDED), log_level=0,
                        limits=parser_limits())
    raw = LLMatcher(llg, grammar_of({"regex": "hello </think> world"}, ADDED), log_level=0)
    vocab = llg.vocab_size
    constraint = Constraint(matcher, special_ids(llg, vocab, [0]))
    hello = hf.encode("hello ", add_special_tokens=False).ids
    assert constraint.accept(hello) and raw.consume_tokens(hello)
    bit = lambda mask, t: bool(mask[t >> 3] >> (t & 7) & 1)  # noqa: E731
    assert bit(raw.compute_bitmask(), think) and raw.validate_tokens([think]) == 0  # llguidance's own mask
    words = constraint.masks([], 1)
    assert not bit(words.numpy().tobytes(), think)


def test_a_sequence_over_the_grammar_budget_in_a_step_fails_alone_with_its_reason():
    """constrained.fail_over_budget on a step of two constrained sequences and one free one: the one
    whose masks took longer than the budget fails (no tokens, FAILED, its reason), the others are
    untouched and every clock starts again."""
    def seq(n: int, spent: float | None) -> types.SimpleNamespace:
        grammar = None if spent is None else types.SimpleNamespace(spent=spent, failure="")
        return types.SimpleNamespace(seq=n, finished="", drafts=[1, 2], grammar=grammar)

    seqs = {1: seq(1, 0.3), 2: seq(2, 0.01), 3: seq(3, None)}
    result = StepResult()
    for s in seqs.values():
        result.add(s, [7, 8], 1)
    tp = types.SimpleNamespace(size=1, all_reduce=lambda x: x)  # (one rank)
    decoder = types.SimpleNamespace(counters=SpecCounters())
    constrained.fail_over_budget(seqs, result, 0.2, tp, decoder.counters, torch.device("cpu"))
    assert result.finished == [FAILED, "", ""] and result.tokens == [[], [7, 8], [7, 8]]
    assert [e.seq for e in result.errors] == [1] and "over the budget of 200 ms" in result.errors[0].message
    assert seqs[1].grammar.spent == seqs[2].grammar.spent == 0.0
    assert decoder.counters.grammar_s == pytest.approx(0.31) and decoder.counters.grammar_steps == 1


def test_a_grammar_failure_on_the_workers_reaches_its_request_as_a_grammar_error_with_its_reason():
    request, other = (Request(seq, [1, 2], 8, SamplingParams(), [0], 0) for seq in (5, 6))
    reply = StepReply(seqs=[5, 6], tokens=[[], [3]], accepted=[-1, -1], drafts=[[], []], finished=[FAILED, ""],
                      step_s=0.0, errors=[SequenceError(5, "the grammar failed: too many items")])
    finished = deliver(reply, {5: request, 6: other})
    assert finished == [request] and not other.finished
    error = request.queue.get_nowait()
    assert isinstance(error, GrammarError) and "too many items" in str(error)
    assert other.queue.get_nowait().token_ids == [3]


# --- end to end -------------------------------------------------------------------------------------

FAILING_AT_THE_FIRST_TOKEN = [
    pytest.param({"grammar": 'root ::= "a"{100000}'}, id="gbnf-100000-repeats"),
    pytest.param({"grammar": "start: " + " | ".join(f'"w{i}"' for i in range(20000))}, id="lark-20000-alternatives"),
    pytest.param({"regex": "(x{2000}){300}"}, id="regex-600000-repeats"),
]


@pytest.mark.parametrize("constraint", FAILING_AT_THE_FIRST_TOKEN)
def test_a_constraint_that_cannot_produce_a_valid_output_is_an_error_and_the_engine_serves_on(constraint):
    """Each of these returned HTTP 200, finish "stop", text that broke it. Now: refused before the
    request is queued, or failed at its first step with the grammar's error; a plain request after it
    gets the tokens it gets alone."""
    async def run():
        async with shardspec.connect(model=str(BUNDLED_MODEL), workers=pooled(1), max_seqs=4) as engine:
            alone = [t async for c in engine.generate("def f():", max_tokens=8) for t in c.token_ids]
            with pytest.raises(ValueError, match="constraint"):
                async for chunk in engine.generate("def f():", max_tokens=16, structured_output=constraint):
                    assert not chunk.token_ids, f"a token of a failing constraint was streamed: {chunk}"
            after = [t async for c in engine.generate("def f():", max_tokens=8) for t in c.token_ids]
            assert after == alone

    asyncio.run(run())


def test_64_requests_of_one_large_schema_build_it_once_on_the_workers_and_all_validate():
    """n: 64 of a schema of many required properties held the step 49 s (a matcher built per
    sequence inside the step): now one compile, one build on the workers, 64 copies."""
    schema = {"type": "object", "properties": {f"p{i}": {"type": "integer"} for i in range(300)},
              "required": [f"p{i}" for i in range(300)], "additionalProperties": False}

    async def one(engine) -> str:
        return "".join([c.text async for c in engine.generate("x", max_tokens=24, structured_output={"json": schema})])

    async def run():
        async with shardspec.connect(model=str(BUNDLED_MODEL), workers=pooled(1), max_seqs=64) as engine:
            texts = await asyncio.gather(*(one(engine) for _ in range(64)))
            assert engine.grammars.compiler.compiles == 1 and engine.grammars.builds == 1
            assert all(t.startswith('{"p0":') for t in texts)

    asyncio.run(run())


@pytest.mark.slow  # (a chat server of its own, or seconds of CPU time)
def test_a_forced_tool_call_whose_schema_cannot_be_met_is_a_400_never_empty_arguments(chat_server):
    """With tool_choice "required" and a parameter whose pattern fails at its first mask, the server
    returned a call with arguments {} (its required field missing) as a success. Greedy: where the
    lexer gives up depends on the tokens drawn (sampled, a draw may run out of max_tokens first, and the
    test then asks a length cut-off for a 400), and greedily it gives up within them (after 16)."""
    failing = {"type": "array", "items": {"type": "string", "pattern": "^(x{2000}){300}$"}, "minItems": 1}
    tools = [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"x": failing}, "required": ["x"]}}}]
    body = {"messages": [{"role": "user", "content": "hi"}], "tools": tools, "tool_choice": "required",
            "max_tokens": 40, "temperature": 0, "chat_template_kwargs": {"enable_thinking": False}}
    reply = httpx.post(f"{chat_server.url}/chat/completions", json=body, timeout=120)
    assert reply.status_code == 400, reply.text
    assert "constraint" in reply.json()["error"]["message"]
    ok = httpx.post(f"{chat_server.url}/chat/completions", timeout=120, json={
        "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "tools": TOOLS, "tool_choice": "required",
        "chat_template_kwargs": {"enable_thinking": False}})
    assert ok.status_code == 200


@pytest.mark.slow  # (a chat server of its own, or seconds of CPU time)
def test_a_regex_naming_the_model_s_own_tag_never_streams_the_tag_again_and_again(chat_server):
    """regex "hello </think> world" on the chat model emitted "hello </think></think>..." to
    max_tokens: now the request fails (no token the grammar can take) instead of a 200."""
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 40, "temperature": 0,
            "structured_outputs": {"regex": "hello </think> world"}, "chat_template_kwargs": {"enable_thinking": False}}
    reply = httpx.post(f"{chat_server.url}/chat/completions", json=body, timeout=120)
    if reply.status_code == 200:  # (what the grammar allows: the text, never the repeated tag)
        content = reply.json()["choices"][0]["message"]["content"]
        assert content.count("</think>") <= 1 and json.dumps(content)
    else:
        assert reply.status_code == 400, reply.text
