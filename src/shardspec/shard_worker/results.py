"""What a step of a runner returns (StepResult: the reply and its tensors) and what a runner counts
(SpecCounters: drafts and grammar work; RunnerStats: its part of the worker's stats)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from shardspec.protocol.messages import FAILED, SequenceError, StepReply
from shardspec.shard_worker.logprobs import LogprobRows, reply_tensors
from shardspec.shard_worker.sequences import Sequence


@dataclass
class StepResult:
    seqs: list[int] = field(default_factory=list)
    tokens: list[list[int]] = field(default_factory=list)
    accepted: list[int] = field(default_factory=list)
    drafts: list[list[int]] = field(default_factory=list)
    finished: list[str] = field(default_factory=list)
    logits: list[torch.Tensor] = field(default_factory=list)  # per pass, when asked for
    logprob_rows: list[int] = field(default_factory=list)  # per sequence (see StepReply)
    rows: list[LogprobRows] = field(default_factory=list)
    pending_rows: dict[int, list[LogprobRows]] = field(default_factory=dict)  # by sequence, until `add`
    errors: list[SequenceError] = field(default_factory=list)  # why sequences whose grammar failed did

    def reply(self, step_s: float = 0.0) -> StepReply:
        rows = self.logprob_rows if any(self.logprob_rows) else []
        return StepReply(seqs=self.seqs, tokens=self.tokens, accepted=self.accepted, drafts=self.drafts,
                         finished=self.finished, step_s=step_s, logprob_rows=rows, errors=self.errors)

    def tensors(self) -> dict[str, torch.Tensor]:
        """The reply's tensors: the logits when asked for, the log-probabilities when any sequence asked."""
        tensors = {"logits": torch.cat(self.logits).cpu()} if self.logits else {}
        return tensors | (reply_tensors(self.rows) if self.rows else {})

    def add(self, seq: Sequence, tokens: list[int], accepted: int) -> None:
        self.seqs.append(seq.seq)
        self.tokens.append(tokens)
        self.accepted.append(accepted)
        self.drafts.append(list(seq.drafts))
        self.finished.append(seq.finished)
        rows = self.pending_rows.pop(seq.seq, [])
        self.rows.extend(rows)
        self.logprob_rows.append(sum(len(r.chosen) for r in rows))
        if seq.finished == FAILED and seq.grammar is not None and seq.grammar.failure:
            self.errors.append(SequenceError(seq.seq, seq.grammar.failure))

    def fail(self, seq: Sequence) -> None:
        """Turn the sequence's entry (its last) into a failure: no tokens (its log-probability rows stay,
        for the offsets of the others'; the orchestrator reads none of a failed sequence's)."""
        i = len(self.seqs) - 1 - self.seqs[::-1].index(seq.seq)
        self.tokens[i], self.drafts[i], self.finished[i] = [], [], FAILED
        if seq.grammar is not None and seq.grammar.failure:
            self.errors.append(SequenceError(seq.seq, seq.grammar.failure))


@dataclass
class SpecCounters:
    drafts: int = 0
    draft_tokens: int = 0
    accepted_tokens: int = 0
    accepted_per_position: list[int] = field(default_factory=list)

    grammar_tokens: int = 0  # tokens sampled under a grammar (structured output)
    forced_tokens: int = 0  # of them, those the grammar allowed alone (no choice: jump-forward)
    grammar_s: float = 0.0  # the host's time in grammar work (masks, advances, rollbacks)
    grammar_steps: int = 0  # steps with grammar work

    def constrained(self, logits: torch.Tensor) -> None:
        """Count the masked rows [P, V] of P tokens sampled under a grammar."""
        self.grammar_tokens += logits.shape[0]
        self.forced_tokens += int((torch.isfinite(logits).sum(-1) == 1).sum())

    def constrained_counted(self, tokens: int, forced: int) -> None:
        """Count `tokens` sampled under a grammar, `forced` of them the only token their mask allowed."""
        self.grammar_tokens += tokens
        self.forced_tokens += forced

    def count(self, accepted: list[int], draft_len: int) -> None:
        self.drafts += len(accepted)
        self.draft_tokens += len(accepted) * draft_len
        self.accepted_tokens += sum(accepted)
        for n in accepted:
            for j in range(n):
                self.accepted_per_position[j] += 1


@dataclass
class RunnerStats:
    """What a runner reports in the worker's stats (StatsReply's fields of the same names)."""

    cache_bytes: int = 0
    slots_total: int = 0
    slots_free: int = 0
    live_sequences: list[int] = field(default_factory=list)
    draft_len: int = 0
    drafts: int = 0
    draft_tokens: int = 0
    accepted_tokens: int = 0
    accepted_per_position: list[int] = field(default_factory=list)
    forwarded_max: int = 0  # a stage before the last: the most steps whose record was awaited at once
    lookaheads: int = 0  # verify passes run on a guess
    lookaheads_right: int = 0  # those whose guess held
    branches: int = 0  # rows of the passes run on a tree of guesses (their mean width: branches / lookaheads)
    launched_ahead: int = 0  # passes queued behind the step before (ahead.LaunchAhead)
    grammar_tokens: int = 0
    forced_tokens: int = 0
    grammar_s: float = 0.0
    grammar_steps: int = 0
