"""Which sequences each step advances: the waiting queue, the running table and the free slots.

Continuous batching: every step admits waiting requests into free slots (they prefill in that step)
while the running ones decode, so sequences join and leave between steps. Workers keep each
sequence's state, so a step names sequences and carries only the new prompts' token ids.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

import torch

from shardspec.orchestrator.requests import Request
from shardspec.protocol.messages import ReleaseRequest, StepRequest


@dataclass
class Batch:
    """The sequences of one step: new ones to prefill, running ones to decode."""

    prefill: list[Request]
    decode: list[int]

    def command(self) -> tuple[StepRequest, dict[str, torch.Tensor]]:
        """The step request, and its prompts as one int64 tensor frame."""
        step = StepRequest(prefill=[r.prefill_spec() for r in self.prefill], decode=self.decode)
        prompt_ids = torch.tensor([t for r in self.prefill for t in r.prompt], dtype=torch.int64)
        return step, {"prompt_ids": prompt_ids}


class Scheduler:
    """Requests waiting for a slot, and the running ones by sequence id; at most max_slots run."""

    def __init__(self, max_slots: int) -> None:
        self.max_slots = max_slots
        self.waiting: deque[Request] = deque()
        self.running: dict[int, Request] = {}

    def add(self, request: Request) -> None:
        self.waiting.append(request)

    def has_work(self) -> bool:
        return bool(self.running) or (bool(self.waiting) and len(self.running) < self.max_slots)

    def schedule(self) -> Batch | None:
        """The next step's batch: every running sequence, and the waiting ones that free slots take."""
        if not self.has_work():
            return None
        decode = list(self.running)
        admitted = []
        while self.waiting and len(self.running) < self.max_slots:
            request = self.waiting.popleft()
            self.running[request.seq] = request
            admitted.append(request)
        return Batch(admitted, decode)

    def drop_cancelled(self) -> ReleaseRequest | None:
        """Forget the requests whose callers stopped listening; the release of their slots, if any ran."""
        self.waiting = deque(r for r in self.waiting if not r.cancelled)
        return self.release([r for r in self.running.values() if r.cancelled])

    def release(self, requests: list[Request]) -> ReleaseRequest | None:
        """Take finished or cancelled requests out of the running table; the release for the workers."""
        for request in requests:
            self.running.pop(request.seq, None)
        return ReleaseRequest([r.seq for r in requests]) if requests else None

    def take_all(self) -> list[Request]:
        """Every request, running then waiting, now no longer scheduled."""
        requests = [*self.running.values(), *self.waiting]
        self.running.clear()
        self.waiting.clear()
        return requests
