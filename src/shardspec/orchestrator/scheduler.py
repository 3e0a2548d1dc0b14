"""Which sequences each step advances: the waiting queue, the running table and the free slots.

Continuous batching: every step admits waiting requests into free slots (they prefill in that step)
while the running ones decode, so sequences join and leave between steps. Workers keep each
sequence's state, so a step names sequences and carries only the new prompts' token ids.

Micro-batches: the running sequences are split into `groups`, and a step advances one group. With
pipeline stages, steps of different groups are in flight at once, each on a different stage. A
request joins the group it is admitted into and stays there; admission keeps the groups even.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

import torch

from shardspec.orchestrator.requests import Request
from shardspec.protocol.messages import ReleaseRequest, StepRequest


@dataclass
class ScheduledStep:
    """The sequences of one step: new ones to prefill, running ones to decode."""

    prefill: list[Request]
    decode: list[int]
    group: int = 0

    def command(self) -> tuple[StepRequest, dict[str, torch.Tensor]]:
        """The step request, and its prompts as one int64 tensor frame."""
        step = StepRequest(prefill=[r.prefill_spec() for r in self.prefill], decode=self.decode)
        prompt_ids = torch.tensor([t for r in self.prefill for t in r.prompt], dtype=torch.int64)
        return step, {"prompt_ids": prompt_ids}


class Scheduler:
    """Requests waiting for a slot, and the running ones by sequence id (each in one of `groups`
    micro-batches); at most max_slots run."""

    def __init__(self, max_slots: int, groups: int = 1) -> None:
        self.max_slots = max_slots
        self.groups = groups
        self.waiting: deque[Request] = deque()
        self.running: dict[int, Request] = {}
        self.group_of: dict[int, int] = {}  # sequence id -> its micro-batch

    def add(self, request: Request) -> None:
        self.waiting.append(request)

    def schedule(self, group: int = 0) -> ScheduledStep | None:
        """The next step of micro-batch `group`: its running sequences, and the waiting ones it admits
        into free slots (up to its even share of what can run); None when it has nothing to do."""
        decode = [seq for seq in self.running if self.group_of[seq] == group]
        share = -(-min(self.max_slots, len(self.running) + len(self.waiting)) // self.groups)
        admitted = []
        while self.waiting and len(self.running) < self.max_slots and len(decode) + len(admitted) < share:
            if admitted and self.waiting[0].solo:
                break
            request = self.waiting.popleft()
            self.running[request.seq] = request
            self.group_of[request.seq] = group
            admitted.append(request)
            if request.solo:  # suspected of a refused step: admitted alone, so that it fails alone
                break
        return ScheduledStep(admitted, decode, group) if decode or admitted else None

    def retry(self, requests: list[Request]) -> None:
        """Put requests whose admission the workers refused back at the head of the queue."""
        self.waiting.extendleft(reversed(requests))

    def drop_cancelled(self) -> ReleaseRequest | None:
        """Forget the requests whose callers stopped listening; the release of their slots, if any ran."""
        self.waiting = deque(r for r in self.waiting if not r.cancelled)
        return self.release([r for r in self.running.values() if r.cancelled])

    def release(self, requests: list[Request]) -> ReleaseRequest | None:
        """Take finished or cancelled requests out of the running table; the release for the workers."""
        for request in requests:
            self.running.pop(request.seq, None)
            self.group_of.pop(request.seq, None)
        return ReleaseRequest([r.seq for r in requests]) if requests else None

    def take_all(self) -> list[Request]:
        """Every request, running then waiting, now no longer scheduled."""
        requests = [*self.running.values(), *self.waiting]
        self.running.clear()
        self.group_of.clear()
        self.waiting.clear()
        return requests
