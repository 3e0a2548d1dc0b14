"""A request's record and its stream: the chunks a step's reply puts on its queue, and its stats."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from shardspec.protocol.messages import FAILED, PrefillSpec, SamplingParams, StepReply, TokenBias


class EngineError(RuntimeError):
    """Generation failed on the workers; the message says which and why."""


@dataclass
class TokenLogprob:
    """A token, its log-probability under the target model, and the most likely tokens there."""

    token: int
    logprob: float | None  # None only where a server echoes a prompt's first token (nothing before it)
    top: list[tuple[int, float]]  # (token, log-probability), most likely first


@dataclass
class Chunk:
    """New tokens of one request; the last chunk has finish_reason and stats. With logprobs asked
    for, one TokenLogprob per token; with prompt_logprobs, the first chunk has the prompt's tokens
    after the first."""

    token_ids: list[int]
    text: str = ""
    finish_reason: str | None = None
    stats: dict[str, Any] | None = None
    logprobs: list[TokenLogprob] | None = None
    prompt_logprobs: list[TokenLogprob] | None = None
    cached_tokens: int | None = None  # the first chunk: prompt tokens the prefix cache held
    timeline: FirstToken | None = None  # the first chunk: where its time to first token went


@dataclass(frozen=True)
class FirstToken:
    """Where a request's time to its first token went, in seconds from its arrival (perf_counter):
    `queued` it entered the scheduler's queue (after the prompt's checks, tokenizing a text prompt,
    compiling its grammar), `sent` the step that prefills it left for the workers (its wait for a
    slot, blocks and the steps before), `replied` that step's reply came back, of which `worker_s`
    the slowest worker spent in the step (the rest: the wire, the stage links, the reply's decoding)."""

    queued: float
    sent: float
    replied: float
    worker_s: float

    def phases(self) -> dict[str, float]:
        """The phases up to the reply: prepare, queue, the first step on the workers, and the wire
        and links around it."""
        return {"prepare": self.queued, "queue": self.sent - self.queued, "first step": self.worker_s,
                "wire": self.replied - self.sent - self.worker_s}


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
    logprobs: int = -1  # top log-probabilities per token; -1: none (PrefillSpec's meaning)
    prompt_logprobs: int = -1
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)  # Chunks, or the Exception that ends it
    generated: int = 0
    cancelled: bool = False
    finished: bool = False
    failed: bool = False  # its numbers went bad on the workers (SamplingError): it ended without its last tokens
    solo: bool = False  # admitted into a step without other new requests (see Engine._refused)
    started: float = field(default_factory=time.perf_counter)  # its arrival (a server's, or the engine's)
    queued_at: float = 0.0  # it entered the scheduler's queue
    sent_at: float | None = None  # the step that first prefills it was sent
    first_step_s: float = 0.0  # the slowest worker's time in that step
    first_token_at: float | None = None
    drafts: int = 0  # verify steps with drafts
    accepted_tokens: int = 0
    accepted_per_position: list[int] = field(init=False)
    output: list[int] = field(default_factory=list)  # the tokens streamed so far
    blocks: list[int] = field(default_factory=list)  # its K/V blocks on the workers (orchestrator.blocks)
    inflight: int = 0  # steps sent with it whose replies have not come
    preemptions: int = 0  # times its blocks were taken back and its tokens prefilled again
    drafts_pending: list[int] = field(default_factory=list)  # the drafts its next step verifies (last reply's)
    past_output: list[int] | None = None  # drafts its last step committed past a cut (a stop, the budget)
    # the prefix cache (orchestrator.prefix): its part while admitted, where its prefill starts (cached
    # positions, the saved state and the block to copy), the chain keys of its blocks
    cache: Any = None  # orchestrator.prefix.CacheUse (which knows requests)
    cached: int = 0
    restore: int = -1
    copy_from: int = -1
    cached_tokens: int = 0  # prompt tokens its first prefill found cached
    block_hashes: list[bytes] = field(default_factory=list)
    cache_salt: str | None = None  # it shares cached blocks and states only with requests of the same salt
    prefix_points: list[int] = field(default_factory=list)  # where other prompts may part from it (prefix cache)
    grammar: str = ""  # structured output: the key of the grammar its tokens match (orchestrator.grammars)
    logit_bias: list[TokenBias] = field(default_factory=list)
    min_tokens: int = 0  # its stop ids cannot end it before it has this many tokens

    def __post_init__(self) -> None:
        self.accepted_per_position = [0] * self.draft_tokens

    def prefill_spec(self) -> PrefillSpec:
        """Its prefill: the prompt, or after a preemption the prompt and every token streamed, to go on
        with the tokens still to come."""
        prompt_logprobs = self.prompt_logprobs if not self.output else -1
        saves = list(self.cache.saves) if self.cache is not None else []
        return PrefillSpec(self.seq, len(self.prompt) + len(self.output), self.sampling,
                           self.max_tokens - len(self.output), self.stop_ids, self.logprobs, prompt_logprobs,
                           list(self.blocks), self.cached, self.restore, self.copy_from, saves, len(self.output),
                           self.grammar, self.logit_bias, max(0, self.min_tokens - len(self.output)))

    def prefill_ids(self) -> list[int]:
        return self.prompt + self.output

    def known_length(self) -> int:
        """Positions in the workers' caches as of the last reply (the pending token is not yet in)."""
        return len(self.prompt) + max(len(self.output) - 1, 0)

    def committed_tokens(self) -> list[int]:
        """The tokens in the workers' caches as of the last reply: the prompt and the output but the
        pending token; after a step that cut its tokens short, all of them and the drafts it accepted
        past the cut."""
        if self.past_output is not None:
            return self.prompt + self.output + self.past_output
        return (self.prompt + self.output)[: self.known_length()]

    def logprob_rows(self, tokens: int, prefill: bool) -> tuple[int, int]:
        """(prompt rows, token rows) this request owns in a step's reply that brought `tokens` tokens."""
        prompt = len(self.prompt) - 1 if prefill and self.prompt_logprobs >= 0 else 0
        return prompt, tokens if self.logprobs >= 0 else 0

    def record(self, tokens: list[int], accepted: int, drafts: list[int], now: float) -> None:
        """Count a step's tokens and, for a verify step (accepted >= 0), its accepted drafts; keep
        its next drafts."""
        self.first_token_at = self.first_token_at or now
        self.generated += len(tokens)
        if accepted >= 0 and len(tokens) <= accepted:  # cut short: the caches hold all it accepted
            self.past_output = self.drafts_pending[len(tokens) : accepted]
        self.drafts_pending = drafts
        self.output.extend(tokens)
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
            "cached_tokens": self.cached_tokens,
        }
        if self.draft_tokens:
            stats |= spec_decode_metrics(self.drafts, self.draft_tokens, self.accepted_tokens,
                                         self.accepted_per_position)
        if self.forced_acceptance is not None:
            stats["forced_acceptance"] = self.forced_acceptance
        return stats


SAMPLING_FAILED = ("the request's sampling values made numbers no token can be sampled from (non-finite logits or "
                   "probabilities, or no token left after the penalties, the bias, top-k, top-p and the grammar); "
                   "try less extreme values")


class SamplingError(ValueError):
    """A request's own values made its numbers unusable on the workers; it failed alone."""


class GrammarError(ValueError):
    """A request's constraint failed on the workers (an error of llguidance's, or masks over the step
    budget); it failed alone, without a text that breaks the constraint."""


def deliver(reply: StepReply, running: dict[int, Request],
            tensors: dict[str, torch.Tensor] | None = None) -> list[Request]:
    """Put each sequence's new tokens (and log-probabilities) on its request's queue; returns the
    requests that finished."""
    now = time.perf_counter()
    finished = []
    table = LogprobTable(reply, tensors or {})
    errors = {error.seq: error.message for error in reply.errors}
    steps = zip(reply.seqs, reply.tokens, reply.accepted, reply.drafts, reply.finished, strict=True)
    for index, (seq, tokens, accepted, drafts, finish) in enumerate(steps):
        request = running.get(seq)
        if request is None:  # cancelled or preempted while this step was in flight
            continue
        if finish == FAILED:
            request.finished = request.failed = True
            finished.append(request)
            why = errors.get(seq)
            request.queue.put_nowait(SamplingError(SAMPLING_FAILED) if why is None else GrammarError(
                f"the structured output constraint failed after {request.generated} tokens: {why}"))
            continue
        prompt_rows, token_rows = request.logprob_rows(len(tokens), prefill=request.generated == 0)
        table.check(index, prompt_rows + token_rows, max(request.logprobs, request.prompt_logprobs))
        first = request.generated == 0
        request.record(tokens, accepted, drafts, now)
        chunk = Chunk(tokens, cached_tokens=request.cached_tokens if first else None)
        if first:
            sent = now if request.sent_at is None else request.sent_at  # (None: a reply not of the engine's steps)
            chunk.timeline = FirstToken(request.queued_at - request.started, sent - request.started,
                                        now - request.started, request.first_step_s)
        if prompt_rows:
            chunk.prompt_logprobs = table.entries(index, 0, request.prompt[1:], request.prompt_logprobs)
        if token_rows:
            chunk.logprobs = table.entries(index, prompt_rows, tokens, request.logprobs)
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


class LogprobTable:
    """A step reply's log-probability tensors, checked against its `logprob_rows`: the dtypes and
    shapes it names, rows that add up (a worker's reply is checked like any received message)."""

    def __init__(self, reply: StepReply, tensors: dict[str, torch.Tensor]):
        counts = list(reply.logprob_rows) or [0] * len(reply.seqs)
        if len(counts) != len(reply.seqs) or min(counts, default=0) < 0:
            raise EngineError("a worker's reply lists log-probability rows that do not match its sequences")
        self.starts = [sum(counts[:i]) for i in range(len(counts))]
        self.counts = counts
        self.width = 0
        if not reply.logprob_rows:
            return
        chosen, values, ids = (tensors.get(name) for name in ("logprobs", "top_logprobs", "top_ids"))
        total = sum(counts)
        if not (isinstance(chosen, torch.Tensor) and isinstance(values, torch.Tensor) and isinstance(ids, torch.Tensor)
                and chosen.dtype == values.dtype == torch.float32 and ids.dtype == torch.int64
                and tuple(chosen.shape) == (total,) and values.dim() == 2 and values.shape[0] == total
                and ids.shape == values.shape):
            raise EngineError("a worker's log-probability tensors do not have the dtypes and shapes its reply names")
        self.chosen, self.values, self.ids = chosen.tolist(), values.tolist(), ids.tolist()
        self.width = values.shape[1]

    def check(self, index: int, expected: int, top: int) -> None:
        """Sequence `index` of the reply must own `expected` rows with at least `top` columns."""
        if self.counts[index] != expected or (expected and top > self.width):
            raise EngineError(f"a worker's reply has {self.counts[index]} log-probability rows of {self.width} for "
                              f"a sequence that asked for {expected} of {top}")

    def entries(self, index: int, skip: int, tokens: list[int], top: int) -> list[TokenLogprob]:
        """TokenLogprobs of `tokens`, from sequence `index`'s rows after its first `skip`."""
        start = self.starts[index] + skip
        return [TokenLogprob(token, self.chosen[r], list(zip(self.ids[r][:top], self.values[r][:top])))
                for token, r in zip(tokens, range(start, start + len(tokens)), strict=True)]
