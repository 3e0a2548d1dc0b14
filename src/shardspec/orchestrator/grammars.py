"""Structured output, the orchestrator's part: a request's constraint (a JSON schema, any JSON object,
a regular expression, a choice of strings, a Lark or GBNF grammar) as one llguidance grammar,
checked against the model's tokenizer before the request is queued, so that a bad one is the
caller's error (ValueError, a 400) and never a worker's. The workers mask with it
(shard_worker.grammar)."""

from __future__ import annotations

import functools
import json
import re
from collections.abc import Collection
from pathlib import Path
from typing import Any

from llguidance import LLMatcher, LLTokenizer
from llguidance.gbnf_to_lark import gbnf_to_lark

from shardspec.layers.grammar import llg_tokenizer
from shardspec.protocol.messages import MAX_GRAMMAR_CHARS

# the constraints a request may give (vLLM's structured_outputs names), one at a time
KINDS = ("json", "json_object", "regex", "choice", "grammar")
MAX_MARKER_CHARS = 64


def grammar_of(constraint: dict[str, Any], tokens: Collection[str] = ()) -> str:
    """The llguidance grammar of a constraint {kind: value}, optionally with "after": a marker text
    (such as "</think>") before which the output is free and after which the constraint holds;
    ValueError naming what is wrong. `tokens`: the texts of the tokenizer's added tokens, which
    llguidance sees as tokens, not text (a grammar names them as <text>)."""
    if isinstance(constraint, dict) and "after" in constraint:
        constraint = dict(constraint)
        marker = constraint.pop("after")
        return _after(marker, grammar_of(constraint), marker in tokens)
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
        grammar = gbnf_to_lark(value) if "::=" in value and not value.startswith("%llguidance") else value
    if len(grammar) > MAX_GRAMMAR_CHARS:
        raise ValueError(f"the constraint makes a grammar of {len(grammar):,} characters; at most "
                         f"{MAX_GRAMMAR_CHARS:,}")
    return grammar


def _after(marker: Any, grammar: str, is_token: bool) -> str:
    """`grammar` after the first `marker` (and up to two newlines), any text before it; a marker
    that is a token of its own ends the free text only as that token."""
    if not isinstance(marker, str) or not 0 < len(marker) <= MAX_MARKER_CHARS or "\n" in marker:
        raise ValueError(f"a constraint's \"after\" is a line of 1 to {MAX_MARKER_CHARS} characters")
    body = json.loads(grammar)["grammars"][0] if grammar.lstrip().startswith("{") else {"lark_grammar": grammar}
    pattern = re.escape(marker).replace("/", "\\/")
    if is_token:  # the free text cannot spell the marker out either: it would not end there
        free = f"start: FREE {marker} SEP @body\nFREE: /(?s:.*)/ & ~/(?s:.*){pattern}(?s:.*)/\n"
    else:
        free = f"start: free SEP @body\nfree[lazy]: /(?s:.*){pattern}/\n"
    free += "SEP: /\\n{0,2}/\n"
    return json.dumps({"grammars": [{"lark_grammar": free}, {**body, "name": "body"}]})


class GrammarCheck:
    """Grammars checked against one model's tokenizer (built on first use), the last few remembered."""

    def __init__(self, tokenizer_file: Path, vocab_size: int, eos_ids: list[int]):
        self.tokenizer_file, self.vocab_size, self.eos_ids = tokenizer_file, vocab_size, eos_ids

    @functools.cached_property
    def tokenizer(self) -> LLTokenizer:
        return llg_tokenizer(self.tokenizer_file, self.vocab_size, self.eos_ids)

    @functools.cached_property
    def added_tokens(self) -> frozenset[str]:
        """The texts of the tokenizer's added tokens (llguidance makes them all special)."""
        added = json.loads(self.tokenizer_file.read_text()).get("added_tokens") or []
        return frozenset(t["content"] for t in added if isinstance(t, dict) and isinstance(t.get("content"), str))

    @functools.lru_cache(maxsize=64)  # noqa: B019 (one per engine, as long-lived as it)
    def grammar(self, constraint_json: str) -> str:
        """The checked grammar of a constraint given as canonical JSON; ValueError naming the problem."""
        grammar = grammar_of(json.loads(constraint_json), self.added_tokens)
        matcher = LLMatcher(self.tokenizer, grammar, log_level=0)
        if matcher.is_error():
            raise ValueError(f"the structured output constraint does not compile: {matcher.get_error()}")
        return grammar

