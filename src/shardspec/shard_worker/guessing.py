"""The last stage's lookahead (pipeline stages with MTP, eager passes): its guesses of a lone
sequence's steps, for the stages before to run a step's pass before the record of the step in flight
reaches them (stage.ForwardingStage).

While one sequence decodes alone, the last stage sends its guess once a step's record has left, in
time it would spend waiting for the next pass: a lone guess (the chain goes on for k + 1 more drafts:
the step after the next, if the next keeps all its drafts) or, with lookahead "tree", branches of
the next step's outcomes (branches.TreeGuesser). The next step's outcome then shows whether the
stages' pass on the guess holds (its row), which the step takes instead of a pass run again.
"""

from __future__ import annotations

from collections import deque
from typing import Any

from shardspec.shard_worker import branches
from shardspec.shard_worker.sequences import Sequence

# lookahead "auto": the last stage guesses for its first GUESS_FIRST guesses, then while at least
# GUESS_TO_PAY of its last (up to GUESS_WINDOW) guesses held; below that, at one lone step in
# GUESS_PROBE_EVERY, so that the share follows the text. A guess that holds saves the stages a link
# round trip; one that does not costs the stage before a state snapshot and restore, and the stages
# time they would have spent waiting (bench/pipeline.py: at 10 ms one way, guesses that held 12 %
# of the time made "on" faster than "off").
GUESS_FIRST = 16
GUESS_TO_PAY = 0.05
GUESS_WINDOW = 64
GUESS_PROBE_EVERY = 16


class Guessing:
    """When a lone step guesses (`always`: every one, else while guesses pay), what it sends, and
    whether the guess it sent before held. `tree`: branches of outcomes (TreeGuesser, `tree_width`
    branches a tree, 0 adaptive) instead of one guess."""

    def __init__(self, draft_len: int, always: bool, tree: bool, tree_width: int = 0):
        self.k, self.always = draft_len, always
        self.held: deque[bool] = deque(maxlen=GUESS_WINDOW)  # whether each of the last guesses held
        self.unguessed = 0  # lone steps since the last guess
        self.due: Sequence | None = None  # the sequence this step guesses for, once its record has left
        self.tree = branches.TreeGuesser(draft_len, tree_width) if tree else None
        self.sent: list[branches.Branch] = []  # the tree's branches of the last guess (its Guesses entry)

    def now(self) -> bool:
        """Whether this lone step guesses."""
        pays = len(self.held) < GUESS_FIRST or sum(self.held) >= GUESS_TO_PAY * len(self.held)
        return self.always or pays or self.unguessed + 1 >= GUESS_PROBE_EVERY

    def after(self, decoder: Any, s: Sequence, accepted: int, token: int, drafts: list[int], guessing: bool) -> None:
        """The lone step of `s` kept `accepted` drafts, added `token` and drafted `drafts` next: the row
        of the stages' pass on its guess that this proves (s.guess_row, -1: none), and whether to guess
        once its record has left (`guessing`: this step guesses)."""
        s.guess_row = self.row(s, accepted, token, drafts)
        if s.guess:
            self.held.append(s.guess_row >= 0)
        if self.tree is not None:
            self.tree.observe(decoder, accepted)
        self.unguessed = 0 if guessing else self.unguessed + 1
        self.due = s if guessing and not s.finished else None

    def row(self, s: Sequence, accepted: int, token: int, drafts: list[int]) -> int:
        """The row of the stages' pass on a guess of `s`'s next step that this step's outcome proves, or -1."""
        if self.tree is not None:
            return branches.held(self.sent, accepted, token, drafts) if s.guess else -1
        return 0 if s.guess and accepted == self.k and token == s.guess[0] else -1

    def take_due(self) -> Sequence | None:
        """The sequence the step just recorded guesses for (once), or None."""
        due, self.due = self.due, None
        return due

    def guess(self, decoder: Any, s: Sequence) -> list[int]:
        """`s`'s guess as a Guesses message carries it, from where the step's chain stopped: the lone
        guess [pending, d1..dk] (the chain k + 1 drafts on), or the tree's branches flattened."""
        if self.tree is not None:
            self.sent = self.tree.make(decoder, s.drafts)
            return branches.flatten(self.sent)
        head, token, slots, position, context = decoder.chain_end
        head = decoder._mtp(token[:, None], head[:, None], slots, position[:, None], context)[:, 0]
        return decoder._chain(head, slots, position + 1, context, self.k + 1)[0].tolist()
