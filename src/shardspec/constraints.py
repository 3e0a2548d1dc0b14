"""Structured-output constraints as llguidance grammars, and the checks a grammar passes before any
worker sees it. Free of torch: the orchestrator's compile processes run this module alone
(`python -m shardspec.constraints`, one request per line of JSON on stdin, one answer per line on
stdout), so a grammar that crashes llguidance, or runs it out of time or memory, takes down only
that process (orchestrator.grammars).

A constraint is {kind: value} (vLLM's structured_outputs names), optionally with "after": a marker
text before which the output is free (a reasoning model's "</think>").
"""

from __future__ import annotations

import ctypes
import json
import math
import os
import re
import resource
import signal
import sys
import threading
import time
from collections.abc import Collection, Iterator
from pathlib import Path
from typing import Any

import numpy as np
from llguidance import LLMatcher, LLParserLimits, LLTokenizer
from llguidance.gbnf_to_lark import gbnf_to_lark

KINDS = ("json", "json_object", "regex", "choice", "grammar")
MAX_MARKER_CHARS = 64
MAX_GRAMMAR_CHARS = 1 << 20  # a grammar's text (protocol.messages.GrammarRequest.grammar)
# what a JSON schema may hold, checked in Python before llguidance parses it (llguidance 1.x recurses
# along $ref chains and nesting: a chain of 3,000 references overflows its stack)
MAX_SCHEMA_DEPTH = 64
MAX_SCHEMA_NODES = 100_000
MAX_SCHEMA_REFS = 1_000
MAX_GRAMMAR_RULES = 2_000  # rules of a Lark (or GBNF) grammar, for the same reason
# per mask: the lexer and parser work llguidance may do before it gives up (an error, the same on
# every rank). Tighter than its defaults (200k fuel, 50k items), which let a 33-byte regex take 0.4 s
PARSER_LIMITS = dict(step_lexer_fuel=50_000, step_max_items=20_000)
# compile stacks: a grammar that builds on the compile process's stack builds on the workers' larger one
COMPILE_STACK_BYTES = 8 << 20
WORKER_STACK_BYTES = 64 << 20


class ConstraintError(ValueError):
    """A constraint the server refuses: what is wrong with it, for the caller."""


def parser_limits() -> LLParserLimits:
    return LLParserLimits(**PARSER_LIMITS)


def grammar_of(constraint: Any, tokens: Collection[str] = ()) -> str:
    """The llguidance grammar of a constraint; ConstraintError naming what is wrong. `tokens`: the
    texts of the tokenizer's added tokens, which llguidance sees as tokens, not text (a grammar names
    them as <text>)."""
    if isinstance(constraint, dict) and "after" in constraint:
        constraint = dict(constraint)
        marker = constraint.pop("after")
        return _after(marker, grammar_of(constraint), marker in tokens)
    if not isinstance(constraint, dict) or len(constraint) != 1 or next(iter(constraint)) not in KINDS:
        raise ConstraintError(f"a structured output constraint is one of {', '.join(KINDS)}, got {constraint!r:.200}")
    ((kind, value),) = constraint.items()
    if kind == "json":
        grammar = LLMatcher.grammar_from_json_schema(json.dumps(_schema(value)),
                                                     defaults={"whitespace_flexible": False})
    elif kind == "json_object":
        grammar = LLMatcher.grammar_from_json_schema('{"type": "object"}', defaults={"whitespace_flexible": False})
    elif kind == "regex":
        if not isinstance(value, str) or not value:
            raise ConstraintError("a regex constraint is a non-empty string")
        grammar = LLMatcher.grammar_from_regex(value)
    elif kind == "choice":
        if not isinstance(value, list) or not value or not all(isinstance(c, str) and c for c in value):
            raise ConstraintError("a choice constraint is a non-empty list of non-empty strings")
        grammar = "start: " + " | ".join(json.dumps(c) for c in value)
    else:
        grammar = _lark(value)
    if len(grammar) > MAX_GRAMMAR_CHARS:
        raise ConstraintError(f"the constraint makes a grammar of {len(grammar):,} characters; at most "
                              f"{MAX_GRAMMAR_CHARS:,}")
    return grammar


def _schema(value: Any) -> Any:
    """A JSON schema (an object, true/false, or its JSON text) within the structural limits."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as exc:
            raise ConstraintError(f"the JSON schema is not JSON: {exc}") from None
    if not isinstance(value, dict | bool):
        raise ConstraintError("a JSON schema is an object")
    if value is False:
        raise ConstraintError("the JSON schema false allows no value")
    if value is True:
        value = {}  # (any JSON value: llguidance takes only an object)
    nodes = refs = 0
    for depth, node in _walk(value):
        nodes += 1
        if depth > MAX_SCHEMA_DEPTH:
            raise ConstraintError(f"the JSON schema nests deeper than {MAX_SCHEMA_DEPTH} levels")
        if isinstance(node, dict) and "$ref" in node:
            refs += 1
    if nodes > MAX_SCHEMA_NODES:
        raise ConstraintError(f"the JSON schema has {nodes:,} values; at most {MAX_SCHEMA_NODES:,}")
    if refs > MAX_SCHEMA_REFS:
        raise ConstraintError(f"the JSON schema has {refs:,} $ref; at most {MAX_SCHEMA_REFS:,}")
    return value


def _walk(value: Any) -> Iterator[tuple[int, Any]]:
    """(depth, value) of every value inside a JSON value, without recursion."""
    stack = [(0, value)]
    while stack:
        depth, node = stack.pop()
        yield depth, node
        children = node.values() if isinstance(node, dict) else node if isinstance(node, list) else ()
        stack.extend((depth + 1, child) for child in children)


_LARK_RULE = re.compile(r"^\s*[?!]?[A-Za-z_][\w]*(\[[^\]\n]*\])?(\.\d+)?\s*:", re.M)
_GBNF_RULE = re.compile(r"^\s*[A-Za-z][\w-]*\s*::=", re.M)


def _lark(value: Any) -> str:
    """A Lark (or GBNF) grammar's text, within the rule limit."""
    if not isinstance(value, str) or not value.strip():
        raise ConstraintError("a grammar constraint is a non-empty Lark or GBNF text")
    if len(value) > MAX_GRAMMAR_CHARS:
        raise ConstraintError(f"the grammar has {len(value):,} characters; at most {MAX_GRAMMAR_CHARS:,}")
    gbnf = "::=" in value and not value.startswith("%llguidance")
    rules = len((_GBNF_RULE if gbnf else _LARK_RULE).findall(value))
    if rules > MAX_GRAMMAR_RULES:
        raise ConstraintError(f"the grammar has {rules:,} rules; at most {MAX_GRAMMAR_RULES:,}")
    if not gbnf:
        return value
    try:
        return gbnf_to_lark(value)
    except Exception as exc:  # (a Python converter: any error is the text's)
        raise ConstraintError(f"the GBNF grammar does not convert: {_first_line(str(exc))}") from None


def _after(marker: Any, grammar: str, is_token: bool) -> str:
    """`grammar` after the first `marker` (and up to two newlines), any text before it; a marker
    that is a token of its own ends the free text only as that token."""
    if not isinstance(marker, str) or not 0 < len(marker) <= MAX_MARKER_CHARS or "\n" in marker:
        raise ConstraintError(f"a constraint's \"after\" is a line of 1 to {MAX_MARKER_CHARS} characters")
    body = json.loads(grammar)["grammars"][0] if grammar.lstrip().startswith("{") else {"lark_grammar": grammar}
    pattern = re.escape(marker).replace("/", "\\/")
    if is_token:  # the free text cannot spell the marker out either: it would not end there
        free = f"start: FREE {marker} SEP @body\nFREE: /(?s:.*)/ & ~/(?s:.*){pattern}(?s:.*)/\n"
    else:
        free = f"start: free SEP @body\nfree[lazy]: /(?s:.*){pattern}/\n"
    free += "SEP: /\\n{0,2}/\n"
    return json.dumps({"grammars": [{"lark_grammar": free}, {**body, "name": "body"}]})


def _first_line(text: str, limit: int = 300) -> str:
    line = text.strip().split("\n", 1)[0]
    return line if len(line) <= limit else line[: limit - 3] + "..."


# --- tokens --------------------------------------------------------------------------------------


def llg_tokenizer(tokenizer_file: Path, vocab_size: int, eos_ids: list[int]) -> LLTokenizer:
    """llguidance's view of a model's tokenizer.json, over the model's vocabulary."""
    return LLTokenizer(tokenizer_file.read_text(), n_vocab=vocab_size, eos_token=eos_ids[0] if eos_ids else None)


def added_tokens(tokenizer_file: Path) -> frozenset[str]:
    """The texts of a tokenizer.json's added tokens (llguidance makes them all special)."""
    added = json.loads(tokenizer_file.read_text()).get("added_tokens") or []
    return frozenset(t["content"] for t in added if isinstance(t, dict) and isinstance(t.get("content"), str))


def special_ids(tokenizer: LLTokenizer, vocab_size: int, eos_ids: Collection[int]) -> np.ndarray:
    """The tokens llguidance takes as special (the added tokens, and the ids a checkpoint's vocabulary
    has past its tokenizer's) but the end of text, which its matchers allow, and then refuse to
    consume, once the grammar has stopped: as a bit mask (uint8, bit t of byte t // 8), the layout
    of a grammar's masks."""
    ids = np.array([t for t in range(vocab_size) if tokenizer.is_special_token(t) and t not in eos_ids],
                   dtype=np.int64)
    bits = np.zeros((vocab_size + 31) // 32 * 4, dtype=np.uint8)
    np.bitwise_or.at(bits, ids >> 3, (1 << (ids & 7)).astype(np.uint8))
    return bits


def allowed_mask(matcher: LLMatcher, special: np.ndarray, words: int | None = None) -> bytearray:
    """The tokens the grammar allows next, a bit each (bit t of 32-bit word t // 32), with every
    special token (`special`: their bit mask, special_ids) llguidance's mask allows but its matcher
    refuses taken out (a regex naming "</think>" gets the token allowed by the mask, then refused;
    found with one AND of the two masks: a checkpoint whose vocabulary is padded far past its
    tokenizer has as many special ids as padding, 244,225 for the bundled tokenizer at Qwen3.5's
    vocabulary, which took 0.45 ms a mask one id at a time). `words`: the
    mask's 32-bit words (ceil(V / 32) of the matcher's tokenizer), written then in place into the
    mask (half the host time of a step's masks: bench/structured.py's schema, 8 sequences x 4 rows,
    0.28 ms against 0.53), without the GIL."""
    if words is None:
        mask = bytearray(matcher.compute_bitmask())
    else:
        mask = bytearray(4 * words)
        matcher.unsafe_compute_mask_ptr(ctypes.addressof((ctypes.c_char * len(mask)).from_buffer(mask)), len(mask))
    hits = np.frombuffer(mask, dtype=np.uint8)[: len(special)] & special[: len(mask)]
    for byte in np.flatnonzero(hits).tolist():
        for bit in range(8):
            token = 8 * byte + bit
            if hits[byte] >> bit & 1 and matcher.validate_tokens([token]) != 1:
                mask[byte] &= ~(1 << bit) & 0xFF
    return mask


def first_mask_problem(matcher: LLMatcher, special: list[int], eos_ids: Collection[int]) -> str | None:
    """Why a freshly built matcher cannot start an output (None: it can): an error, no token
    allowed, or only the end of text (the constraint admits only the empty text)."""
    if matcher.is_error():
        return f"the constraint does not compile: {_first_line(matcher.get_error())}"
    mask = allowed_mask(matcher, special)
    if matcher.is_error():
        return f"the constraint fails at its first token: {_first_line(matcher.get_error())}"
    if not mask.strip(b"\0"):
        return "the constraint allows no token of this model's vocabulary at its start"
    for token in eos_ids:
        mask[token >> 3] &= ~(1 << (token & 7)) & 0xFF
    if not mask.strip(b"\0"):
        return "the constraint admits only an empty output"
    return None


# --- the compile process ---------------------------------------------------------------------------


def compile_checked(tokenizer: LLTokenizer, special: list[int], eos_ids: list[int], constraint: Any,
                    tokens: Collection[str]) -> dict[str, Any]:
    """{"grammar", "build_s", "mask_s"} of a constraint checked to start, or {"error"}; times in CPU
    seconds (a compile process runs at low priority: its wall time depends on the host's load)."""
    try:
        grammar = grammar_of(constraint, tokens)
    except ConstraintError as exc:
        return {"error": str(exc)}
    except Exception as exc:  # (llguidance's converters raise on some bad schemas and regexes)
        return {"error": f"the constraint does not compile: {_first_line(str(exc))}"}
    started = time.process_time()
    matcher = LLMatcher(tokenizer, grammar, log_level=0, limits=parser_limits())
    built = time.process_time()
    problem = first_mask_problem(matcher, special, eos_ids)
    result = {"grammar": grammar, "build_s": built - started, "mask_s": time.process_time() - built}
    return result if problem is None else {"error": problem}


def limit_cpu(seconds: float) -> None:
    """SIGXCPU (which ends this process) once it has used `seconds` more CPU time than so far."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    soft = math.ceil(usage.ru_utime + usage.ru_stime + seconds)
    resource.setrlimit(resource.RLIMIT_CPU, (soft, resource.getrlimit(resource.RLIMIT_CPU)[1]))


def on_thread(stack_bytes: int, work: Any, *args: Any) -> Any:
    """`work(*args)` on a thread with a stack of `stack_bytes` (llguidance recurses on the caller's
    stack: the same grammar must build wherever it passed)."""
    out: list[Any] = []
    previous = threading.stack_size(stack_bytes)
    try:
        thread = threading.Thread(target=lambda: out.append(work(*args)), daemon=True)
        thread.start()
    finally:
        threading.stack_size(previous)
    thread.join()
    return out[0]


def bound_this_process(memory_bytes: int) -> None:
    """A compile process's own bounds, set as it starts (not by its parent between fork and exec,
    which would keep the parent from spawning it with vfork: a copy of a large server's page tables,
    on its event loop): an address-space limit, the lowest CPU priority (the workers on this host come
    first), and SIGTERM when its parent dies."""
    resource.setrlimit(resource.RLIMIT_AS, (memory_bytes, memory_bytes))
    os.nice(19)
    ctypes.CDLL("libc.so.6").prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    if os.getppid() == 1:  # (its parent died before the line above)
        sys.exit(1)


def main(argv: list[str]) -> int:
    """The compile process: argv = [tokenizer.json, vocab size, end-of-text ids as JSON, address-space
    bytes]; reads {"constraint", "tokens", "cpu_s"} lines, answers one line each; past `cpu_s` of CPU
    time on one, the kernel ends it (SIGXCPU)."""
    bound_this_process(int(argv[3]))
    tokenizer_file, vocab_size, eos_ids = Path(argv[0]), int(argv[1]), json.loads(argv[2])
    tokenizer = llg_tokenizer(tokenizer_file, vocab_size, eos_ids)
    special = special_ids(tokenizer, vocab_size, eos_ids)
    print(json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        request = json.loads(line)
        limit_cpu(request["cpu_s"])
        answer = on_thread(COMPILE_STACK_BYTES, compile_checked, tokenizer, special, eos_ids,
                           request["constraint"], request.get("tokens", []))
        print(json.dumps(answer), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
