"""Running a request's jobs: each choice's engine stream as Events (stop strings cut, the prompt
echoed, metrics counted), and all the choices of one request at once."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Awaitable
from contextlib import aclosing
from dataclasses import dataclass
from typing import Protocol, TypeVar

from fastapi import Request

from shardspec.constraints import ConstraintError
from shardspec.orchestrator.engine import ENGINE_ERRORS, Engine
from shardspec.orchestrator.metrics import ServingMetrics
from shardspec.orchestrator.requests import Chunk, GrammarError, TokenLogprob
from shardspec.server.api import ApiError, usage
from shardspec.server.chat_output import partial_match
from shardspec.server.jobs import Job
from shardspec.server.streaming import ClientGone, until_disconnected


class Service(Protocol):
    """What a generation needs of the server (server.app.Service)."""

    engine: Engine
    metrics: ServingMetrics

    def engine_failed(self, exc: Exception) -> Exception: ...

T = TypeVar("T")


@dataclass
class Event:
    """A piece of one choice's stream: its text, the finish reason on the last one, and the
    log-probabilities of its tokens when asked for."""

    text: str
    finish_reason: str | None
    logprobs: list[TokenLogprob] | None = None


class StopText:
    """Cuts streamed text at the first stop string; holds back a tail that may be the start of one.

    Only that tail (shorter than the longest stop) is kept and searched again, so the work per
    piece of text is bounded by the stops' lengths, not by the text generated so far."""

    def __init__(self, stops: list[str], include: bool = False):
        self.stops = stops
        self.include = include  # the matched stop string ends the text
        self.pending = ""
        self.matched: str | None = None  # the stop string that ended the text

    def feed(self, text: str) -> tuple[str, bool]:
        """(text safe to emit, whether a stop string matched)."""
        self.pending += text
        hits = [(i, len(stop), stop) for stop in self.stops if (i := self.pending.find(stop)) >= 0]
        if hits:
            at, length, self.matched = min(hits)
            out, self.pending = self.pending[: at + length * self.include], ""
            return out, True
        cut = len(self.pending) - max((partial_match(self.pending, stop) for stop in self.stops), default=0)
        out, self.pending = self.pending[:cut], self.pending[cut:]
        return out, False

    def flush(self) -> str:
        out, self.pending = self.pending, ""
        return out


class Generation:
    """One choice's engine stream as Events, with its token count and metrics."""

    def __init__(self, service: Service, job: Job):
        self.service = service
        self.job = job
        self.completion_tokens = 0
        self.cached_tokens = 0  # of its prompt, found in the prefix cache
        self.finish_reason: str | None = None
        self.stop_string: str | None = None  # the stop string that ended the choice, if one did
        self.outcome = "cancelled"
        self.echoed = False  # the prompt's text has been sent (echo)

    async def events(self) -> AsyncIterator[Event]:
        job, metrics = self.job, self.service.metrics
        stops = StopText(job.stops, job.include_stop)
        prompt_logprobs = job.logprobs if job.echo is not None else None
        stream = self.service.engine.generate(job.prompt_ids, max_tokens=max(job.max_tokens, 1), logprobs=job.logprobs,
                                              prompt_logprobs=prompt_logprobs, arrived=job.arrived, **job.sampling)
        try:
            async with aclosing(stream):
                async for chunk in stream:
                    if job.echo_only:
                        chunk.token_ids, chunk.text = [], ""
                        chunk.logprobs = None if chunk.logprobs is None else []
                    if chunk.timeline is not None:  # (the first chunk)
                        metrics.first_token(chunk.timeline, time.perf_counter() - job.arrived)
                    self._count(chunk.token_ids)
                    if chunk.cached_tokens is not None:
                        self.cached_tokens = chunk.cached_tokens
                    text, stopped = stops.feed(chunk.text)
                    finish = "stop" if stopped else chunk.finish_reason
                    self.finish_reason, self.stop_string = finish, stops.matched
                    text = text if stopped or finish is None else text + stops.flush()
                    yield self._event(chunk, text, finish)
                    if finish is not None:
                        break  # a stop string: leaving the stream cancels the sequence
            self.outcome = "finished"
            metrics.request_seconds.observe(time.perf_counter() - job.arrived)
        except (ConstraintError, GrammarError) as exc:  # (the request's constraint, refused or failed)
            self.outcome = "error"
            raise ApiError(400, str(exc), job.constraint_param) from None
        except ValueError as exc:
            self.outcome = "error"  # counted where the error reaches the client
            raise ApiError(400, str(exc), _param_named_in(str(exc))) from None
        except ENGINE_ERRORS as exc:
            self.outcome = "error"
            raise self.service.engine_failed(exc) from None
        finally:
            if self.outcome != "error":
                metrics.requests.labels(endpoint=job.endpoint, outcome=self.outcome).inc()

    def _event(self, chunk: Chunk, text: str, finish: str | None) -> Event:
        """The event of a chunk; the first one starts with the echoed prompt and its log-probabilities."""
        logprobs = chunk.logprobs
        if self.job.echo is not None and not self.echoed:
            self.echoed = True
            text = self.job.echo + text
            if logprobs is not None:
                first = TokenLogprob(self.job.prompt_ids[0], None, [])
                logprobs = [first, *(chunk.prompt_logprobs or []), *logprobs]
        return Event(text, finish, logprobs)

    def _count(self, token_ids: list[int]) -> None:
        metrics = self.service.metrics
        if self.completion_tokens == 0 and token_ids:
            metrics.prompt_tokens.inc(len(self.job.prompt_ids))
        self.completion_tokens += len(token_ids)
        metrics.generated_tokens.inc(len(token_ids))

    async def collect(self) -> Event:
        """The whole choice as one Event."""
        async with aclosing(self.events()) as events:
            pieces = [event async for event in events]
        logprobs = None if self.job.logprobs is None else [entry for e in pieces for entry in e.logprobs or []]
        return Event("".join(e.text for e in pieces), self.finish_reason, logprobs)


class Choices:
    """The generations of one request (its prompts times n), run at once."""

    def __init__(self, generations: list[Generation]):
        self.generations = generations
        self.streams = [g.events() for g in generations]

    def usage(self) -> dict[str, int]:
        """Each prompt's tokens once (as OpenAI counts them for n > 1; its cached tokens as its first
        choice found them), every choice's tokens."""
        prompts: dict[int, tuple[int, int]] = {}
        for g in self.generations:
            prompts.setdefault(g.job.prompt_index, (len(g.job.prompt_ids), g.cached_tokens))
        return usage(sum(n for n, _ in prompts.values()), sum(g.completion_tokens for g in self.generations),
                     sum(cached for _, cached in prompts.values()))

    async def collect(self) -> list[Event]:
        return await _all([g.collect() for g in self.generations])

    async def begin(self, request: Request, stream: bool) -> list[Event]:
        """Every choice whole or, `stream`, its first event (the engine's errors before any token are a
        status then), awaited while the client stays; on an error or a disconnect (ClientGone) the
        choices are closed and it is raised."""
        try:
            return await until_disconnected(request, self.first() if stream else self.collect())
        except (ClientGone, ApiError):
            await self.aclose()
            raise

    async def first(self) -> list[Event]:
        """Every choice's first event (the engine's errors before any token surface here)."""
        return await _all([anext(stream) for stream in self.streams])

    async def rest(self) -> AsyncIterator[tuple[int, Event]]:
        """(choice index, event) after the first events, in the order they come."""
        queue: asyncio.Queue = asyncio.Queue()

        async def pump(index: int, stream: AsyncIterator[Event]) -> None:
            try:
                async for event in stream:
                    queue.put_nowait((index, event, None))
            except Exception as exc:  # an ApiError: the consumer raises it
                queue.put_nowait((index, None, exc))
                return
            queue.put_nowait((index, None, None))

        pumps = [asyncio.ensure_future(pump(g.job.index, s)) for g, s in zip(self.generations, self.streams)]
        try:
            for _ in pumps:
                while (item := await queue.get())[1] is not None:
                    yield item[0], item[1]
                if item[2] is not None:
                    raise item[2]
        finally:
            await _cancel(pumps)

    async def aclose(self) -> None:
        for stream in self.streams:
            await stream.aclose()  # type: ignore[attr-defined]


async def _all(work: list[Awaitable[T]]) -> list[T]:
    """Await all of `work` at once; the first error (or a cancellation) cancels the rest."""
    tasks = [asyncio.ensure_future(w) for w in work]
    try:
        return list(await asyncio.gather(*tasks))
    finally:
        await _cancel(tasks)


async def _cancel(tasks: list[asyncio.Future]) -> None:
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)


def _param_named_in(message: str) -> str | None:
    for param in ("min_tokens", "max_tokens", "temperature", "top_p", "top_k", "seed", "prompt_logprobs", "logprobs",
                  "stop_token_ids", "logit_bias",
                  "presence_penalty", "frequency_penalty", "repetition_penalty", "prompt"):
        if param in message:
            return param
    for param in ("structured output", "JSON schema", "grammar", "regex", "choice"):
        if param in message:
            return "response_format"
    return None
