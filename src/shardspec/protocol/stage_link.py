"""The stage-link messages: what a pipeline's stages send each other, worker to worker or relayed
by the orchestrator, with no reply: a pass's hidden states, the last stage's record of a step, its
lookahead guesses. protocol.messages puts them in the op set (LINKS) and re-exports them."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

from shardspec.protocol.fields import bounded
from shardspec.protocol.step import StepReply


@dataclass(frozen=True)
class HiddenStates:
    """One pass's output of a stage for the next stage (tensor `hidden`, [B, T, H]): the `index`-th
    pass of step `step` (the id of the orchestrator's step request). `kind`: "pass" (the pass
    itself), "lookahead" (the verify pass run early on the last stage's guess of its tokens: the next
    stage uses it only if its record of the step before proves the guess right) or "redo" (the
    verify pass again, on the right tokens, after a wrong guess)."""

    OP: ClassVar[str] = "hidden"
    KINDS: ClassVar[tuple[str, ...]] = ("pass", "lookahead", "redo")
    step: int = bounded(0, 2**63 - 1)
    index: int = bounded(0, 1 << 20)
    kind: str = "pass"

    def __post_init__(self) -> None:
        if self.kind not in self.KINDS:
            raise ValueError(f"kind must be one of {', '.join(self.KINDS)}, got {self.kind!r}")


@dataclass(frozen=True)
class AcceptRecord:
    """What the last stage decided in step `step`, for the stages before it to commit and to feed
    the next pass: the step's reply (accepted drafts, emitted tokens, next drafts, finished).
    `guessed` (lookahead): a `Guesses` message of this step follows."""

    OP: ClassVar[str] = "accepts"
    step: int = bounded(0, 2**63 - 1)
    reply: StepReply
    guessed: bool = False


@dataclass(frozen=True)
class Guesses:
    """Lookahead: the last stage's guess of the tokens of the step after the next of each sequence
    `seqs` ([pending, d1..dk], if the next step keeps all its drafts), made after step `step`'s
    record left, for the stages before to run that step's pass on before the next record comes.
    Lookahead "tree": each entry is a tree's branches, (a, c, e1..ek) after each other
    (shard_worker/branches.py)."""

    OP: ClassVar[str] = "guesses"
    step: int = bounded(0, 2**63 - 1)
    seqs: list[int] = field(default_factory=list)
    guesses: list[list[int]] = field(default_factory=list)

    def __post_init__(self) -> None:
        if len(self.seqs) != len(self.guesses):
            raise ValueError(f"{len(self.seqs)} sequences with {len(self.guesses)} guesses")
