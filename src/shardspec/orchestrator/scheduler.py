"""Which sequences each step advances: the waiting queue, the running table and the free slots.

Continuous batching: every step admits waiting requests into free slots (they prefill in that step)
while the running ones decode, so sequences join and leave between steps. Workers keep each
sequence's state, so a step names sequences and carries only the new prompts' token ids.

Micro-batches: the running sequences are split into `groups`, and a step advances one group. With
pipeline stages, steps of different groups are in flight at once, each on a different stage. A
request joins the group it is admitted into and stays there; admission keeps the groups even.

K/V blocks (orchestrator.blocks): a request is admitted while the pool has blocks for its prompt
and what its first step may write; before each step its sequences get blocks for what that step
and the ones in flight before it may write. When the pool runs dry, the newest running request is
preempted: its blocks go back, and it waits at the head of the queue to prefill its prompt and the
tokens it streamed so far, under a new sequence id, and go on.

Prefix cache (orchestrator.prefix): admission starts a request's prefill at its longest hit; each
reply caches the blocks its sequences filled; a finished sequence's release saves its state.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

import torch

from shardspec.orchestrator.blocks import BlockPool
from shardspec.orchestrator.prefix import PrefixCache
from shardspec.orchestrator.requests import Request
from shardspec.protocol.messages import BlockGrant, ReleaseRequest, StepReply, StepRequest


@dataclass
class ScheduledStep:
    """The sequences of one step: new ones to prefill, running ones to decode."""

    prefill: list[Request]
    decode: list[int]
    group: int = 0
    grow: list[BlockGrant] = field(default_factory=list)
    preempted: list[int] = field(default_factory=list)  # sequences to release before this step

    def command(self) -> tuple[StepRequest, dict[str, torch.Tensor]]:
        """The step request, and its prompts as one int64 tensor frame."""
        step = StepRequest(prefill=[r.prefill_spec() for r in self.prefill], decode=self.decode, grow=self.grow)
        prompt_ids = torch.tensor([t for r in self.prefill for t in r.prefill_ids()], dtype=torch.int64)
        return step, {"prompt_ids": prompt_ids}


class Scheduler:
    """Requests waiting for a slot, and the running ones by sequence id (each in one of `groups`
    micro-batches); at most max_seqs run."""

    def __init__(self, max_seqs: int, groups: int = 1) -> None:
        self.max_seqs = max_seqs
        self.groups = groups
        self.waiting: deque[Request] = deque()
        self.running: dict[int, Request] = {}  # in admission order: the newest last
        self.group_of: dict[int, int] = {}  # sequence id -> its micro-batch
        self.pool: BlockPool | None = None  # set at each load (use)
        self.cache: PrefixCache | None = None
        self.step_advance = 1  # positions a step may advance a sequence: draft tokens + 1
        self.new_seq = None  # a fresh sequence id for a preempted request (the engine's counter)
        self.preemptions = 0

    def use(self, pool: BlockPool, cache: PrefixCache, draft_tokens: int, new_seq) -> None:
        """The workers' block pool and prefix cache after a load; draft_tokens: MTP drafts per step (0: off)."""
        self.pool, self.cache, self.step_advance, self.new_seq = pool, cache, draft_tokens + 1, new_seq

    def blocks_needed(self, request: Request) -> int:
        """The blocks `request` must hold before its next step: for what that step may write past
        the positions its steps in flight may add to its last known length."""
        paging = self.pool.paging
        return paging.blocks_for(request.known_length() + request.inflight * self.step_advance + paging.step_span)

    def add(self, request: Request) -> None:
        self.waiting.append(request)

    def schedule(self, group: int = 0) -> ScheduledStep | None:
        """The next step of micro-batch `group`: its running sequences, and the waiting ones it admits
        into free slots (up to its even share of what can run); None when it has nothing to do."""
        decode = [seq for seq in self.running if self.group_of[seq] == group]
        grow, preempted = self._grow(decode)
        share = -(-min(self.max_seqs, len(self.running) + len(self.waiting)) // self.groups)
        admitted = []
        while self.waiting and len(self.running) < self.max_seqs and len(decode) + len(admitted) < share:
            if admitted and self.waiting[0].solo:
                break
            request = self.waiting[0]
            if not self.cache.admit(request, self.blocks_needed(request)):
                break
            self.waiting.popleft()
            self.running[request.seq] = request
            self.group_of[request.seq] = group
            admitted.append(request)
            if request.solo:  # suspected of a refused step: admitted alone, so that it fails alone
                break
        if decode or admitted:
            return ScheduledStep(admitted, decode, group, grow, preempted)
        if preempted:  # (their release must still go out)
            return ScheduledStep([], [], group, [], preempted)
        return None

    def _grow(self, decode: list[int]) -> tuple[list[BlockGrant], list[int]]:
        """Blocks for the sequences of `decode` (which loses those preempted meanwhile); returns the
        grants and the sequences preempted."""
        grants, preempted = [], []
        for seq in list(decode):
            request = self.running.get(seq)
            if request is None:  # preempted for an earlier one
                continue
            missing = self.blocks_needed(request) - len(request.blocks)
            while missing > 0 and (blocks := self.pool.take(missing)) is None:
                victim = next(reversed(self.running.values()))
                preempted.append(self._preempt(victim))
                if victim is request:
                    break
            else:
                if missing > 0:
                    request.blocks += blocks
                    grants.append(BlockGrant(seq, blocks))
        decode[:] = [seq for seq in decode if seq in self.running]
        return [g for g in grants if g.seq in self.running], preempted

    def _preempt(self, request: Request) -> int:
        """Take a running request's blocks back and queue it first, under a new sequence id, to
        prefill what it has so far; returns its old id."""
        old = request.seq
        self.running.pop(old)
        self.group_of.pop(old)
        self.cache.release(request)
        request.seq = next(self.new_seq)
        request.preemptions += 1
        self.preemptions += 1
        self.waiting.appendleft(request)
        return old

    def retry(self, requests: list[Request]) -> None:
        """Put requests whose admission the workers refused back at the head of the queue."""
        self.waiting.extendleft(reversed(requests))

    def drop_cancelled(self) -> ReleaseRequest | None:
        """Forget the requests whose callers stopped listening; the release of their slots, if any ran."""
        self.waiting = deque(r for r in self.waiting if not r.cancelled)
        return self.release([r for r in self.running.values() if r.cancelled])

    def replied(self, reply: StepReply) -> None:
        """After a step's reply (delivered): the prefix cache takes what its sequences committed."""
        for seq, accepted in zip(reply.seqs, reply.accepted):
            request = self.running.get(seq)
            if request is None or request.finished:
                continue
            if accepted < 0:
                self.cache.prefilled(request)
            else:
                self.cache.advance(request)

    def release(self, requests: list[Request]) -> ReleaseRequest | None:
        """Take finished, cancelled or refused requests out of the running table; the release for the
        workers, which first saves the states of finished ones the prefix cache keeps."""
        saves = []
        for request in requests:
            self.running.pop(request.seq, None)
            self.group_of.pop(request.seq, None)
            if request.finished and not request.cancelled and not request.failed:  # (a failed one: nothing to keep)
                self.cache.prefilled(request)  # (once only: it may have finished in its prefill)
                if (save := self.cache.finish(request)) is not None:
                    saves.append(save)
            self.cache.release(request)
        return ReleaseRequest([r.seq for r in requests], saves) if requests else None

    def take_all(self) -> list[Request]:
        """Every request, running then waiting, now no longer scheduled."""
        requests = [*self.running.values(), *self.waiting]
        for request in self.running.values():
            self.cache.release(request)
        self.running.clear()
        self.group_of.clear()
        self.waiting.clear()
        return requests
