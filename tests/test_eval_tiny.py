"""tools/eval_tiny.py's quality check: where a sampled completion is cut, what counts as a repeat,
which prompts a module gives."""

from __future__ import annotations

import ast

import pytest
from eval_tiny import cut_at_last_statement, held_out_signatures, parses, repeats_a_line, signatures

SIGNATURE = "def f(x):"
NESTED = "\n    for i in x:\n        if i:\n            yield i\n"


@pytest.mark.parametrize(("body", "finished", "kept"), [
    # the function ends where a line comes back to the def's indentation
    ("\n    y = x + 1\n    return y\nprint(y)\n", True, "\n    y = x + 1\n    return y\n"),
    # stopped by the token limit: the unfinished last line goes
    ("\n    a = 1\n    b = 2", False, "\n    a = 1\n"),
    # ... and a statement left inside an open bracket
    ("\n    a = 1\n    b = (2,\n", False, "\n    a = 1\n"),
    # ... and a block header with no block yet
    ("\n    a = 1\n    if a:\n", False, "\n    a = 1\n"),
    # nested blocks that are complete stay
    (NESTED, False, NESTED),
])
def test_a_completion_is_cut_after_its_last_complete_statement(body, finished, kept):
    cut = cut_at_last_statement(SIGNATURE, body, finished)
    assert cut == SIGNATURE + kept
    assert parses(cut)


def test_a_completion_with_broken_indentation_is_kept_whole_and_fails_to_parse():
    body = "\n    a = 1\n  b = 2\n"
    cut = cut_at_last_statement(SIGNATURE, body, True)
    assert cut == SIGNATURE + body and not parses(cut)


def test_a_repeat_is_the_same_non_blank_line_three_times_in_a_row():
    assert repeats_a_line("\n    n = n - 1\n    n = n - 1\n    n = n - 1\n")
    assert not repeats_a_line("\n    n = n - 1\n    n = n - 1\n    return n\n    n = n - 1\n")
    assert not repeats_a_line("\n    a = 1\n\n\n\n    b = 2\n")  # blank lines are not a repeat
    assert not repeats_a_line("\n    a = 1\n    a = 1\n    a = 1")  # the third is unfinished: not counted


def test_a_module_gives_its_functions_and_its_methods_under_their_class_line():
    source = ("import os\n\n@cache\ndef top(a,\n        b):\n    return a\n\n"
              "class K(Base):\n    def m(self):\n        pass\n")
    found = signatures(source)
    assert found == ["def top(a,\n        b):\n", "class K(Base):\n    def m(self):\n"]
    assert all(ast.parse(s + "    " * (1 + s.count("class")) + "pass\n") for s in found)
    assert signatures("def broken(:\n") == []


def test_asking_for_more_signatures_than_the_files_hold_is_refused_naming_both_counts():
    texts = ["def f(x):\n    return x\n", "def g():\n    pass\n"]
    assert sorted(held_out_signatures(texts, 2, seed=0)) == ["def f(x):", "def g():"]
    with pytest.raises(SystemExit, match=r"--signatures 3: the held-out files have 2 distinct signatures"):
        held_out_signatures(texts, 3, seed=0)
