"""Structured output, the orchestrator's part: a request's constraint (a JSON schema, any JSON object,
a regular expression, a choice of strings, a Lark or GBNF grammar) as one llguidance grammar,
checked against the model's tokenizer before the request is queued, so that a bad one is the
caller's error (ValueError, a 400) and never a worker's. The workers mask with it
(shard_worker.grammar)."""

from __future__ import annotations

import functools
import json
from pathlib import Path
from typing import Any

from llguidance import LLMatcher, LLTokenizer
from llguidance.gbnf_to_lark import gbnf_to_lark

from shardspec.layers.grammar import llg_tokenizer
from shardspec.protocol.messages import MAX_GRAMMAR_CHARS

# the constraints a request may give (vLLM's structured_outputs names), one at a time
KINDS = ("json", "json_object", "regex", "choice", "grammar")


def grammar_of(constraint: dict[str, Any]) -> str:
    """The llguidance grammar of a constraint {kind: value}; ValueError naming what is wrong."""
    if not isinstance(constraint, dict) or len(constraint) != 1 or next(iter(constraint)) not in KINDS:
        raise ValueError(f"a structured output constraint is one of {', '.join(KINDS)}, got {constraint!r:.200}")
    ((kind, value),) = constraint.items()
    if kind == "json":
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as exc:
                raise ValueError(f"the JSON schema is not JSON: {exc}") from None
        if not isinstance(value, (dict, bool)):
            raise ValueError("a JSON schema is an object")
        grammar = LLMatcher.grammar_from_json_schema(json.dumps(value), defaults={"whitespace_flexible": False})
    elif kind == "json_object":
        grammar = LLMatcher.grammar_from_json_schema('{"type": "object"}', defaults={"whitespace_flexible": False})
    elif kind == "regex":
        if not isinstance(value, str) or not value:
            raise ValueError("a regex constraint is a non-empty string")
        grammar = LLMatcher.grammar_from_regex(value)
    elif kind == "choice":
        if not isinstance(value, list) or not value or not all(isinstance(c, str) and c for c in value):
            raise ValueError("a choice constraint is a non-empty list of non-empty strings")
        grammar = "start: " + " | ".join(json.dumps(c) for c in value)
    else:
        if not isinstance(value, str) or not value.strip():
            raise ValueError("a grammar constraint is a non-empty Lark or GBNF text")
        grammar = gbnf_to_lark(value) if "::=" in value else value
    if len(grammar) > MAX_GRAMMAR_CHARS:
        raise ValueError(f"the constraint makes a grammar of {len(grammar):,} characters; at most "
                         f"{MAX_GRAMMAR_CHARS:,}")
    return grammar


class GrammarCheck:
    """Grammars checked against one model's tokenizer (built on first use), the last few remembered."""

    def __init__(self, tokenizer_file: Path, vocab_size: int, eos_ids: list[int]):
        self.tokenizer_file, self.vocab_size, self.eos_ids = tokenizer_file, vocab_size, eos_ids

    @functools.cached_property
    def tokenizer(self) -> LLTokenizer:
        return llg_tokenizer(self.tokenizer_file, self.vocab_size, self.eos_ids)

    @functools.lru_cache(maxsize=64)  # noqa: B019 (one per engine, as long-lived as it)
    def grammar(self, constraint_json: str) -> str:
        """The checked grammar of a constraint given as canonical JSON; ValueError naming the problem."""
        grammar = grammar_of(json.loads(constraint_json))
        matcher = LLMatcher(self.tokenizer, grammar, log_level=0)
        if matcher.is_error():
            raise ValueError(f"the structured output constraint does not compile: {matcher.get_error()}")
        return grammar

