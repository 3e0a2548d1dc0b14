"""The role of a pipeline stage before the last: its layers over every pass of a step, sent on.

The last stage decides (decoder.Decoder) and sends each step's result to the earlier stages as an
acceptance record. An earlier stage does not wait for it: it replies at once and runs the next step,
of another micro-batch, while the later stages finish this one. It applies a record (commits its
speculative state, takes the next tokens and drafts) when a later step or a release names one of
that step's sequences (_settle).

Lookahead: when a step advances one sequence alone, the stage runs its next verify pass on the last
stage's guess of its tokens (which follows the record before, as a message of its own) instead of
waiting for the step's record, and runs it again when the record proves the guess wrong
(_lookahead_step, _resolve). With lookahead "tree" the guess is a tree of branches, one outcome of
the step in flight each, run as one batched pass in branch slots (_tree_step, branches.py).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from shardspec.protocol.errors import ErrorCode, ProtocolError
from shardspec.protocol.messages import PrefillSpec, SaveFinished, StepRequest
from shardspec.shard_worker import branches
from shardspec.shard_worker.results import RunnerStats, StepResult
from shardspec.shard_worker.runner import ModelRunner
from shardspec.shard_worker.sequences import Sequence

# graph copies per batch bucket, one per step whose record is still to come (one per micro-batch in
# flight: pp of them by default); more at once run eagerly
STAGE_COPIES = 4


@dataclass
class Forwarded:
    """A step this stage has run its layers over, until the last stage's record comes."""

    step: int
    new: list[int]  # the sequences it prefilled
    running: list[Sequence]  # the sequences it verified
    commit: Callable[[list[list[int]]], Any] | None  # its verify pass's commit (accepts -> None)
    guessed: list[int] | None = None  # a lookahead: the tokens it verified, the last stage's guess
    snapshot: Any = None  # a lookahead ran after it, as if it kept all its drafts: the state before (CausalLM.snapshot)
    saved: Any = None  # what its verify pass saved for the commit (Batch.saved): a tree forks states from it

    def names(self, seqs: set[int]) -> bool:
        return any(seq in seqs for seq in self.new) or any(s.seq in seqs for s in self.running)


class ForwardingStage(ModelRunner):
    COPIES = STAGE_COPIES

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.forwarded: deque[Forwarded] = deque()  # steps whose record is to come
        self.forwarded_max = 0
        self.lookaheads = self.lookaheads_right = 0  # verify passes run on a guess; those whose guess held
        self.branches_run = 0  # rows of the passes run on a tree of guesses
        self.last_saved: dict = {}  # what the last verify pass saved for its commit

    def stats(self) -> RunnerStats:
        stats = super().stats()
        stats.forwarded_max, stats.lookaheads, stats.lookaheads_right = (self.forwarded_max, self.lookaheads,
                                                                         self.lookaheads_right)
        stats.branches = self.branches_run
        return stats

    @torch.inference_mode()
    def step(self, request: StepRequest, prompt_ids: torch.Tensor) -> StepResult:
        """The stage's layers over every pass of the step, sent on; its result is the last stage's (an
        empty reply here), its record applied later (_settle)."""
        prompts = self._begin(request, prompt_ids)
        if (ahead := self._ahead_of(request)) is not None:
            self._tree_step(ahead) if self.branching else self._lookahead_step(ahead)
            return StepResult()
        self._settle(set(request.decode))
        before = set(self.sequences)
        self._prefill_all(request, prompts, StepResult())
        running = self.table.running(request)
        commit = None
        if running:
            commit = self._stage_verify(self._next_pass(), self._verify_rows(running), self._context(running))
        new = [s for s in self.sequences if s not in before]
        if new or running:  # else the last stage has nothing to run either (the same finished flags): no record
            self._forwarded(Forwarded(self.steps, new, running, commit, saved=self.last_saved if running else None))
        return StepResult()

    @torch.inference_mode()  # (a commit it settles writes into the graphs' inference tensors)
    def release(self, seqs: list[int], saves: list[SaveFinished] = ()) -> list[int]:
        self._settle(set(seqs))  # a slot is free (and its state final) once the commit of its last step has landed
        return super().release(seqs, saves)

    def _prefill_slots(self, seqs: list[Sequence], specs: list[PrefillSpec], prompts: torch.Tensor,
                       slots: torch.Tensor, result: StepResult, want_logits: bool) -> None:
        """The layers over the prompts from their cached position, saving states on the way; the first
        tokens and drafts come with the last stage's record."""
        saves = self._saves_by_position(specs)
        for ids, batch in self._chunks(prompts, slots, specs[0].cached, tuple(saves)):
            self._forward(ids, batch)
            if batch.kv_len in saves:
                self._save_states(slots, saves[batch.kv_len])

    def _send(self, index: int, hidden: torch.Tensor, kind: str = "pass") -> None:
        self.links.send_hidden(self.steps, index, hidden, kind)  # (one copy off the device)

    def _follow_pass(self, packed: torch.Tensor, accepts: torch.Tensor, hidden: torch.Tensor, saved: dict,
                     context: int) -> None:
        """The commit pass: keep the accepted prefix of the verify pass (the record's counts)."""
        self.model.commit(saved, self.rows.slots(packed), accepts[:, 0])

    def _verify_pass(self, *args, **kwargs) -> tuple:
        out = super()._verify_pass(*args, **kwargs)
        self.last_saved = out[2]  # (hidden, argmax, what the pass saved for its commit, ...)
        return out

    def _stage_verify(self, index: int, rows: list[list[int]], context: int, kind: str = "pass") -> Callable:
        """The layers over a verify pass (pass `index` of the step, sequences.Rows), sent on as a `kind`
        message; returns the pass's commit."""
        x = self._receive(index, (len(rows), self.draft_len + 1), kind)
        hidden, _, commit = self.passes.verify(rows, context, x)
        self._send(index, hidden, kind)
        return commit

    def _forwarded(self, step: Forwarded) -> None:
        self.forwarded.append(step)
        self.forwarded_max = max(self.forwarded_max, len(self.forwarded))

    # --- the last stage's records ---------------------------------------------------------------

    def _settle(self, seqs: set[int]) -> None:
        """Apply the records of the forwarded steps that name any of `seqs`, and of every step before
        them (records come in step order)."""
        last = max((i for i, f in enumerate(self.forwarded) if f.names(seqs)), default=-1)
        for _ in range(last + 1):
            self._apply(self.forwarded.popleft())

    def _apply(self, step: Forwarded) -> None:
        """The last stage's record of a forwarded step: commit the accepted prefixes, take the next
        tokens, drafts and guesses."""
        body = self.links.recv_record(step.step)
        self.links.drop_guesses(before=step.step)  # (guesses no lookahead took)
        record, running, new = body.reply, step.running, step.new
        if record.seqs != new + [s.seq for s in running]:
            raise ProtocolError(ErrorCode.INTERNAL, "the last stage's record does not list this step's sequences")
        guess_step = step.step if body.guessed else -1  # (its guesses come next: _guess)
        for seq, tokens, drafts, finished in zip(new, record.tokens, record.drafts, record.finished):
            s = self.sequences[seq]  # (a sequence that failed has no tokens, and no next one)
            s.next_token, s.drafts, s.finished = tokens[0] if tokens else 0, drafts, finished
            s.guess, s.guess_step = [], guess_step
        accepted = [max(n, 0) for n in record.accepted[len(new) :]]
        if self.draft_len and running:
            if step.snapshot is None:  # (else the lookahead committed it as if it kept all; _resolve)
                step.commit([[n, 0] for n in accepted])  # without drafts the pass wrote its state itself
            self.counters.count(accepted, self.draft_len)
        tail = zip(running, accepted, record.tokens[len(new) :], record.drafts[len(new) :], record.finished[len(new) :])
        for s, n, tokens, drafts, finished in tail:
            s.length += n + 1
            s.next_token = tokens[-1] if tokens else s.next_token
            s.drafts, s.finished, s.guess, s.guess_step = drafts, finished, [], guess_step
        if step.snapshot is not None:
            self._resolve(step, accepted[0])

    # --- lookahead ------------------------------------------------------------------------------

    def _ahead_of(self, request: StepRequest) -> Sequence | None:
        """The sequence a step runs a lookahead for: it advances one sequence alone, whose previous
        step, of it alone, is the one step still waiting for its record, and whose record before
        that carried a guess. Every stage before the last sees the same commands and records, so
        they all decide alike."""
        if not self.lookahead or request.prefill or len(request.decode) != 1 or len(self.forwarded) != 1:
            return None
        s, previous = self.sequences[request.decode[0]], self.forwarded[0]
        if s.finished or previous.new or [r.seq for r in previous.running] != [s.seq]:
            return None
        return s if self._guess(s) else None

    def _guess(self, s: Sequence) -> list[int]:
        """The last stage's guess for `s` from its latest record, read off the link the first time
        ([] when it made none)."""
        if s.guess_step >= 0:
            guess = self.links.recv_guesses(s.guess_step).get(s.seq, [])
            vocab = self.model.config.vocab_size
            if self.branching:
                try:
                    branches.unflatten(guess, self.draft_len, vocab)
                except ValueError as exc:
                    raise ProtocolError(ErrorCode.BAD_MESSAGE, str(exc)) from None
            elif guess and (len(guess) != self.draft_len + 1 or not all(0 <= t < vocab for t in guess)):
                raise ProtocolError(ErrorCode.BAD_MESSAGE, f"a guess is not {self.draft_len + 1} token ids")
            s.guess, s.guess_step = guess, -1
        return s.guess

    def _lookahead_step(self, s: Sequence) -> None:
        """Run this step's verify pass on the guess of the record before the last (as if the step
        still in flight keeps all its drafts and its new token is the guessed one), send it on, then
        apply the record of the step in flight: a wrong guess sends the pass again (_resolve)."""
        k, previous = self.draft_len, self.forwarded[0]
        slots = torch.tensor([s.slot], device=self.device)
        previous.snapshot = self.model.snapshot(slots)
        previous.commit([[k, 0]])  # as if it keeps all its drafts
        guessed = list(s.guess)
        # (sequences.Rows) at the positions after the in-flight step's
        rows = [[*guessed, s.length + k + 1, s.slot, -1, k]]
        commit = self._stage_verify(self._next_pass(), rows, self._context([s], k + 1), "lookahead")
        self.lookaheads += 1
        self._forwarded(Forwarded(self.steps, [], [s], commit, guessed=guessed))
        self._apply(self.forwarded.popleft())

    def _resolve(self, step: Forwarded, accepted: int) -> None:
        """The record of a step a lookahead ran on top of, which committed it as if it kept all its
        drafts: the guess was right when it did and its new token and drafts are the guessed ones.
        Else put the state back, commit what was kept and run the next step's pass again on the
        record's tokens. A finished sequence leaves the lookahead with no record to come, and its state
        at what it kept (which a release may save)."""
        s, ahead = step.running[0], self.forwarded[0]
        if s.finished:  # the last stage skips it from now on
            self.forwarded.popleft()
            if accepted != self.draft_len:
                self.model.restore(step.snapshot, torch.tensor([s.slot], device=self.device))
                step.commit([[accepted, 0]])
        elif accepted != self.draft_len or [s.next_token, *s.drafts] != ahead.guessed:
            self.model.restore(step.snapshot, torch.tensor([s.slot], device=self.device))
            step.commit([[accepted, 0]])
            # the lookahead's pass again, as pass 0 of its step (a lookahead step has no other)
            ahead.commit = self._stage_verify(0, self._verify_rows([s]), self._context([s]), "redo")
        else:
            self.lookaheads_right += 1

    # --- a tree of guesses (branches.py) --------------------------------------------------------

    def _tree_step(self, s: Sequence) -> None:
        """Run this step's verify pass once per branch of the last stage's tree, as one batched pass in
        branch slots (each forked from the sequence's state past the drafts its branch keeps of the step
        in flight), send it on, then apply the record of the step in flight: the held branch's blocks
        and state become the sequence's, or the pass runs again on the record's tokens. A stage after
        the first whose record is in when the tree's states come cuts the tree there (_cut_tree)."""
        k, previous, device = self.draft_len, self.forwarded[0], self.device
        tree = branches.unflatten(s.guess, k, self.model.config.vocab_size)
        self.links.timeline.add(self.steps, "branches started")
        self.lookaheads, self.branches_run = self.lookaheads + 1, self.branches_run + len(tree)
        index = self._next_pass()
        x = self._receive(index, (len(tree), k + 1), "lookahead")
        if x is not None and self.links.has_record(previous.step):
            return self._cut_tree(s, tree, index, x)
        starts = [s.length + b.accepted + 1 for b in tree]
        slots = self.branch_slots.fork(self.model, s.slot, starts, k + 1)
        self.model.commit(branches.rows_of(previous.saved, [0] * len(tree)), slots,
                          torch.tensor([b.accepted for b in tree], device=device))
        rows = [[b.token, *b.drafts, start, slot, -1, k] for b, start, slot in zip(tree, starts, slots.tolist())]
        hidden, _, _ = self.passes.verify(rows, self._context([s], k + 1), x)
        saved = self.last_saved
        self._send(index, hidden, "lookahead")
        ahead = Forwarded(self.steps, [], [s], None)
        self._forwarded(ahead)
        row = self._settle_tree(s, tree)
        if row >= 0:
            self.branch_slots.take(self.model, row, s.slot)
            ahead.saved = branches.rows_of(saved, [row])
            ahead.commit = lambda accepts: self.model.commit(ahead.saved, torch.tensor([s.slot], device=device),
                                                             torch.tensor([accepts[0][0]], device=device))
        elif not s.finished:
            ahead.commit = self._stage_verify(0, self._verify_rows([s]), self._context([s]), "redo")
            ahead.saved = self.last_saved

    def _settle_tree(self, s: Sequence, tree: list[branches.Branch]) -> int:
        """Apply the record of the step in flight (forwarded[0]; the tree's step, if queued, after it):
        the row of the branch it proves, or -1 (a finished sequence's tree step is dropped: the last
        stage skips it from now on, no record of it comes)."""
        length = s.length
        self._apply(self.forwarded.popleft())
        row = -1 if s.finished else branches.held(tree, s.length - length - 1, s.next_token, s.drafts)
        if s.finished and self.forwarded:
            self.forwarded.popleft()
        self.lookaheads_right += row >= 0
        self.links.timeline.add(self.steps, "branch taken" if row >= 0 else "branches cancelled")
        return row

    def _cut_tree(self, s: Sequence, tree: list[branches.Branch], index: int, x: torch.Tensor) -> None:
        """The tree's states came after the record of the step in flight: only the branch it proves goes
        on (its row, a pass on the sequence's own state, which the record committed), sent as a
        lookahead of one row; none when none did (the stage before sends the pass again)."""
        self.links.timeline.add(self.steps, "branches cut")
        row = self._settle_tree(s, tree)
        if s.finished:
            return
        ahead = Forwarded(self.steps, [], [s], None)
        if row >= 0:
            hidden, _, ahead.commit = self.passes.verify(self._verify_rows([s]), self._context([s]), x[row : row + 1])
            self._send(index, hidden, "lookahead")
        else:
            ahead.commit = self._stage_verify(0, self._verify_rows([s]), self._context([s]), "redo")
        ahead.saved = self.last_saved
        self._forwarded(ahead)
