"""A request's record and its stream: the chunks a step's reply puts on its queue, and its stats."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import Any, Protocol

from shardspec.protocol.messages import PrefillSpec, SamplingParams, StepReply


class EngineError(RuntimeError):
    """Generation failed on the workers; the message says which and why."""


@dataclass
class Chunk:
    """New tokens of one request; the last chunk has finish_reason and stats."""

    token_ids: list[int]
    text: str = ""
    finish_reason: str | None = None
    stats: dict[str, Any] | None = None


class StepObserver(Protocol):
    """Told about every step's reply (e.g. serving metrics); must not block."""

    def on_step(self, step_s: float, accepted: list[int]) -> None:
        """step_s: the slowest rank's step time; accepted: drafts accepted per sequence (-1: prefill)."""


@dataclass
class Request:
    """One generation: what the workers need to start it, its output queue, and its counters."""

    seq: int
    prompt: list[int]
    max_tokens: int
    sampling: SamplingParams
    stop_ids: list[int]
    draft_tokens: int  # MTP drafts per step when it was made; 0: MTP off
    forced_acceptance: float | None = None
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)  # Chunks, or the Exception that ends it
    generated: int = 0
    cancelled: bool = False
    finished: bool = False
    solo: bool = False  # admitted into a step without other new requests (see Engine._refused)
    started: float = field(default_factory=time.perf_counter)
    first_token_at: float | None = None
    drafts: int = 0  # verify steps with drafts
    accepted_tokens: int = 0
    accepted_per_position: list[int] = field(init=False)

    def __post_init__(self) -> None:
        self.accepted_per_position = [0] * self.draft_tokens

    def prefill_spec(self) -> PrefillSpec:
        return PrefillSpec(self.seq, len(self.prompt), self.sampling, self.max_tokens, self.stop_ids)

    def record(self, tokens: list[int], accepted: int, now: float) -> None:
        """Count a step's tokens and, for a verify step (accepted >= 0), its accepted drafts."""
        self.first_token_at = self.first_token_at or now
        self.generated += len(tokens)
        if accepted >= 0 and self.draft_tokens:
            self.drafts += 1
            self.accepted_tokens += accepted
            for j in range(accepted):
                self.accepted_per_position[j] += 1

    def fail(self, exc: Exception) -> None:
        self.finished = True
        self.queue.put_nowait(exc)

    def stats(self, now: float) -> dict[str, Any]:
        elapsed = now - self.started
        first = self.first_token_at or now
        stats = {
            "prompt_tokens": len(self.prompt),
            "generated_tokens": self.generated,
            "tokens_per_s": self.generated / elapsed if elapsed > 0 else 0.0,
            "decode_tokens_per_s": (self.generated - 1) / (now - first) if now > first else 0.0,
            "time_to_first_token_s": first - self.started,
        }
        if self.draft_tokens:
            stats |= spec_decode_metrics(self.drafts, self.draft_tokens, self.accepted_tokens,
                                         self.accepted_per_position)
        if self.forced_acceptance is not None:
            stats["forced_acceptance"] = self.forced_acceptance
        return stats


def deliver(reply: StepReply, running: dict[int, Request]) -> list[Request]:
    """Put each sequence's new tokens on its request's queue; returns the requests that finished."""
    now = time.perf_counter()
    finished = []
    for seq, tokens, accepted, finish in zip(reply.seqs, reply.tokens, reply.accepted, reply.finished, strict=True):
        request = running.get(seq)
        if request is None:  # cancelled while this step was in flight
            continue
        request.record(tokens, accepted, now)
        chunk = Chunk(tokens)
        if finish:
            chunk.finish_reason, chunk.stats = finish, request.stats(now)
            request.finished = True
            finished.append(request)
        request.queue.put_nowait(chunk)
    return finished


def spec_decode_metrics(drafts: int, k: int, accepted: int, per_position: list[int]) -> dict[str, Any]:
    """The speculative-decoding figures of a request or a worker, from its counters."""
    return {
        "drafts": drafts,
        "draft_tokens": drafts * k,
        "accepted_tokens": accepted,
        "acceptance_per_position": [n / drafts if drafts else 0.0 for n in per_position],
        "mean_acceptance_length": 1 + accepted / drafts if drafts else 1.0,
    }
