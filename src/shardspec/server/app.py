"""The HTTP application: OpenAI-compatible routes on FastAPI over one running Engine.

Every request becomes one `engine.generate` stream; the engine batches all of them step by step
(continuous batching). A client that disconnects, or a stop string that matches, closes its stream,
which frees the sequence's cache slot at the next step.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import time
from collections.abc import AsyncIterator, Awaitable
from contextlib import aclosing
from dataclasses import dataclass, field
from typing import Any, TypeVar

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException

from shardspec.orchestrator.engine import Engine, EngineError
from shardspec.orchestrator.metrics import CONTENT_TYPE, ServingMetrics
from shardspec.orchestrator.requests import Chunk, TokenLogprob
from shardspec.orchestrator.tokenizer import Tokenizer
from shardspec.orchestrator.workers import WorkerLost
from shardspec.protocol.errors import RemoteError
from shardspec.server.api import (
    ApiError,
    ChatBody,
    ChatShape,
    CompletionBody,
    GenerationBody,
    Shape,
    parse_body,
    usage,
)
from shardspec.server.chat import ChatTemplate, ChatTemplateError

log = logging.getLogger("shardspec.server")

ENGINE_ERRORS = (EngineError, WorkerLost, RemoteError)
GENERATION_ENDPOINTS = ("/v1/completions", "/v1/chat/completions")
COMPLETION_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions
MAX_CHOICES = 128  # prompts x n in one request: each is a sequence in the engine
SEED_STRIDE = 0x9E3779B97F4A7C15  # odd: seed + j * it differs for every choice j < 2**63
T = TypeVar("T")


class ClientGone(Exception):
    """The HTTP client disconnected before its response was ready."""


@dataclass
class Job:
    """One validated generation: one choice of one prompt of a request."""

    endpoint: str
    prompt_ids: list[int]
    max_tokens: int
    sampling: dict[str, Any]
    stops: list[str]
    index: int = 0  # the choice's index in the response
    prompt_index: int = 0  # which of the request's prompts it continues
    logprobs: int | None = None  # top log-probabilities per token; None: none
    echo: str | None = None  # the prompt's text, to start the choice with (completions' echo)
    arrived: float = field(default_factory=time.perf_counter)

    @property
    def echo_only(self) -> bool:
        """echo with max_tokens 0: the prompt (and its log-probabilities) alone; one token is generated
        (the engine always samples one) and dropped."""
        return self.echo is not None and self.max_tokens == 0


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

    def __init__(self, stops: list[str]):
        self.stops = stops
        self.pending = ""

    def feed(self, text: str) -> tuple[str, bool]:
        """(text safe to emit, whether a stop string matched)."""
        self.pending += text
        hits = [i for stop in self.stops if (i := self.pending.find(stop)) >= 0]
        if hits:
            out, self.pending = self.pending[: min(hits)], ""
            return out, True
        cut = len(self.pending) - max((_partial_match(self.pending, stop) for stop in self.stops), default=0)
        out, self.pending = self.pending[:cut], self.pending[cut:]
        return out, False

    def flush(self) -> str:
        out, self.pending = self.pending, ""
        return out


def _partial_match(text: str, stop: str) -> int:
    """The length of the longest end of `text` that is a proper start of `stop` (0 if none)."""
    i = text.find(stop[0], max(0, len(text) - len(stop) + 1))
    while i >= 0:
        if stop.startswith(text[i:]):
            return len(text) - i
        i = text.find(stop[0], i + 1)
    return 0


class Generation:
    """One choice's engine stream as Events, with its token count and metrics."""

    def __init__(self, service: Service, job: Job):
        self.service = service
        self.job = job
        self.completion_tokens = 0
        self.finish_reason: str | None = None
        self.outcome = "cancelled"
        self.echoed = False  # the prompt's text has been sent (echo)

    async def events(self) -> AsyncIterator[Event]:
        job, metrics = self.job, self.service.metrics
        stops = StopText(job.stops)
        prompt_logprobs = job.logprobs if job.echo is not None else None
        stream = self.service.engine.generate(job.prompt_ids, max_tokens=max(job.max_tokens, 1), logprobs=job.logprobs,
                                              prompt_logprobs=prompt_logprobs, **job.sampling)
        try:
            async with aclosing(stream):
                async for chunk in stream:
                    if job.echo_only:
                        chunk.token_ids, chunk.text = [], ""
                        chunk.logprobs = None if chunk.logprobs is None else []
                    self._count(chunk.token_ids)
                    text, stopped = stops.feed(chunk.text)
                    finish = "stop" if stopped else chunk.finish_reason
                    self.finish_reason = finish
                    text = text if stopped or finish is None else text + stops.flush()
                    yield self._event(chunk, text, finish)
                    if finish is not None:
                        break  # a stop string: leaving the stream cancels the sequence
            self.outcome = "finished"
            metrics.request_seconds.observe(time.perf_counter() - job.arrived)
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
            metrics.time_to_first_token.observe(time.perf_counter() - self.job.arrived)
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
        """Each prompt's tokens once (as OpenAI counts them for n > 1), every choice's tokens."""
        prompts = {g.job.prompt_index: len(g.job.prompt_ids) for g in self.generations}
        return usage(sum(prompts.values()), sum(g.completion_tokens for g in self.generations))

    async def collect(self) -> list[Event]:
        return await _all([g.collect() for g in self.generations])

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
    for param in ("max_tokens", "temperature", "top_p", "top_k", "seed", "prompt_logprobs", "logprobs",
                  "presence_penalty", "frequency_penalty", "repetition_penalty", "prompt"):
        if param in message:
            return param
    return None


class EventStream(StreamingResponse):
    """Server-sent events whose source is closed however the response ends (a disconnect included),
    so that the engine frees the sequence at once, not whenever the generator is collected."""

    def __init__(self, events: AsyncIterator[bytes]):
        super().__init__(events, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self.events = events

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self.events.aclose()  # type: ignore[attr-defined]


def _sse(data: dict[str, Any] | str) -> bytes:
    return f"data: {data if isinstance(data, str) else json.dumps(data, ensure_ascii=False)}\n\n".encode()


def _encode_without_the_gil(tokenizer: Tokenizer, text: str) -> list[int]:
    """`tokenizer.encode(text)`; the `tokenizers` library holds the GIL through `encode` (the event loop
    would stall for the whole prompt even with it in a thread), but releases it in `encode_batch`."""
    return tokenizer.inner.encode_batch([text], add_special_tokens=False)[0].ids


def _short_reason(text: str, limit: int = 200) -> str:
    """A failure's first line, bounded: what an HTTP client is told (no log tails, no tracebacks)."""
    line = text.strip().split("\n", 1)[0].rstrip(":").strip()
    return line if len(line) <= limit else line[: limit - 3] + "..."


async def _until_disconnected(request: Request, work: Awaitable[T]) -> T:
    """Await `work`; if the client disconnects first, cancel it (closing its engine stream)."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_disconnect(request))
    try:
        await asyncio.wait([task, watcher], return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
    if task.cancelled():
        raise ClientGone()
    return task.result()


async def _disconnect(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


class Service:
    """The served model: the engine, its name, chat template and metrics, and the route logic."""

    def __init__(self, engine: Engine, name: str, chat: ChatTemplate | None):
        self.engine = engine
        self.name = name
        self.chat = chat
        self.created = int(time.time())
        self.metrics = ServingMetrics(engine.draft_tokens)
        self.logged_failure: str | None = None
        engine.observer = self.metrics

    # --- checks -------------------------------------------------------------------------------

    def engine_failed(self, exc: Exception) -> ApiError:
        failure = self.engine.failure
        if failure is not None:
            return self.unavailable(failure)
        log.error("generation failed: %s", exc)
        return ApiError(500, f"generation failed: {_short_reason(str(exc))}", kind="server_error")

    def unavailable(self, failure: str) -> ApiError:
        """503 with the failure's first line; its details (a worker's log tail) go to the server's log."""
        if failure != self.logged_failure:
            log.error("the model's workers are unavailable: %s", failure)
            self.logged_failure = failure
        return ApiError(503, f"the model's workers are unavailable: {_short_reason(failure)}",
                        code="workers_unavailable", kind="service_unavailable")

    def check(self, body: GenerationBody) -> None:
        if body.model is not None and body.model != self.name:
            raise ApiError(404, f"the model {body.model!r} does not exist; this server serves {self.name!r}",
                           "model", "model_not_found")
        if (unsupported := body.unsupported()) is not None:
            raise ApiError(400, unsupported[1], unsupported[0])
        if (failure := self.engine.failure) is not None:
            raise self.unavailable(failure)

    def token_text(self, param: str):
        """A token id's text (what logprobs and echo name tokens by); 400 naming `param` without a tokenizer."""
        if self.engine.tokenizer is None:
            raise ApiError(400, f"this model has no tokenizer.json, which {param} needs to spell tokens", param)
        return self.token_text_or_none()

    def token_text_or_none(self):
        tokenizer = self.engine.tokenizer
        return None if tokenizer is None else (lambda token: tokenizer.decode([token]))

    async def encode(self, text: str, param: str) -> list[int]:
        """The text's token ids, tokenized in a thread: a long prompt must not stall other requests."""
        if self.engine.tokenizer is None:
            raise ApiError(400, "this model has no tokenizer.json: send the prompt as token ids", param)
        return await asyncio.to_thread(_encode_without_the_gil, self.engine.tokenizer, text)

    def jobs(self, endpoint: str, body: GenerationBody, prompts: list[list[int]], param: str,
             max_tokens: int | None) -> list[Job]:
        """n jobs per prompt, choice i * n + j being prompt i's j-th: its seed derived from the request's
        (seed + j * an odd constant), so that sampled choices differ and choice 0 is the request alone."""
        n = body.n or 1
        if len(prompts) * n > MAX_CHOICES:
            raise ApiError(400, f"{len(prompts)} prompts x n={n} makes {len(prompts) * n} choices; at most "
                           f"{MAX_CHOICES} per request", "n" if n > 1 else param)
        jobs = []
        for i, ids in enumerate(prompts):
            for j in range(n):
                job = self.job(endpoint, body, ids, param, max_tokens)
                if body.seed is not None:
                    job.sampling["seed"] = (body.seed + j * SEED_STRIDE) % 2**63
                job.index, job.prompt_index = i * n + j, i
                jobs.append(job)
        return jobs

    def job(self, endpoint: str, body: GenerationBody, prompt_ids: list[int], param: str,
            max_tokens: int | None) -> Job:
        context = self.engine.load_info.max_seq_len
        if not prompt_ids:
            raise ApiError(400, "the prompt is empty", param)
        if len(prompt_ids) >= context:
            raise ApiError(400, f"the prompt ({len(prompt_ids)} tokens) does not fit the context of {context} "
                           "tokens", param)
        max_tokens = context - len(prompt_ids) if max_tokens is None else max_tokens
        if len(prompt_ids) + max_tokens > context:
            raise ApiError(400, f"prompt ({len(prompt_ids)} tokens) + max_tokens ({max_tokens}) exceeds the "
                           f"context of {context} tokens", "max_tokens")
        sampling = {"temperature": 1.0 if body.temperature is None else body.temperature,
                    "top_p": 1.0 if body.top_p is None else body.top_p, "top_k": body.top_k or 0,
                    "seed": body.seed, "stop_at_eos": not body.ignore_eos,
                    "presence_penalty": body.presence_penalty or 0.0,
                    "frequency_penalty": body.frequency_penalty or 0.0,
                    "repetition_penalty": 1.0 if body.repetition_penalty is None else body.repetition_penalty}
        return Job(endpoint, prompt_ids, max_tokens, sampling, body.stop_strings())

    # --- generation ---------------------------------------------------------------------------

    async def completions(self, request: Request) -> Response:
        body = parse_body(await request.body(), CompletionBody)
        self.check(body)
        texts = body.prompts()
        prompts = [await self.encode(p, "prompt") if isinstance(p, str) else p for p in texts]
        max_tokens = COMPLETION_DEFAULT_MAX_TOKENS if body.max_tokens is None else body.max_tokens
        jobs = self.jobs(request.url.path, body, prompts, "prompt", max_tokens)
        if body.logprobs is not None or body.echo:
            self.token_text("logprobs" if body.logprobs is not None else "echo")  # a tokenizer spells tokens
        for job in jobs:
            job.logprobs = body.logprobs
            if body.echo:
                text = texts[job.prompt_index]
                job.echo = text if isinstance(text, str) else self.engine.tokenizer.decode(text)
        return await self.respond(request, jobs, Shape(self.name, self.token_text_or_none()), body)

    async def chat_completions(self, request: Request) -> Response:
        body = parse_body(await request.body(), ChatBody)
        self.check(body)
        if self.chat is None:
            raise ApiError(400, "this model has no chat template (tokenizer_config.json): use /v1/completions",
                           "messages")
        messages = [m.for_template(i) for i, m in enumerate(body.messages)]
        try:  # in a thread, like tokenizing: a template may take long over many messages
            prompt = await asyncio.to_thread(self.chat.render, messages, add_generation_prompt=True)
        except ChatTemplateError as exc:
            raise ApiError(400, str(exc), "messages") from None
        jobs = self.jobs(request.url.path, body, [await self.encode(prompt, "messages")], "messages",
                         body.max_completion_tokens or body.max_tokens)
        for job in jobs:
            job.logprobs = (body.top_logprobs or 0) if body.logprobs else None
        return await self.respond(request, jobs, ChatShape(self.name, self.token_text_or_none()), body)

    async def respond(self, request: Request, jobs: list[Job], shape: Shape, body: GenerationBody) -> Response:
        choices = Choices([Generation(self, job) for job in jobs])
        try:
            if not body.stream:
                events = await _until_disconnected(request, choices.collect())
                return JSONResponse(shape.response([
                    shape.choice(g.job.index, e.text, e.finish_reason, shape.logprobs(g.job.index, e.logprobs))
                    for g, e in zip(choices.generations, events)], choices.usage()))
            first = await _until_disconnected(request, choices.first())  # errors before any token: a status
        except ClientGone:
            await choices.aclose()
            return Response(status_code=499)
        except ApiError:
            await choices.aclose()
            raise
        include_usage = body.stream_options is not None and body.stream_options.include_usage
        return EventStream(self._stream(shape, first, choices, include_usage))

    async def _stream(self, shape: Shape, first: list[Event], choices: Choices,
                      include_usage: bool) -> AsyncIterator[bytes]:
        try:
            for generation, event in zip(choices.generations, first):
                index = generation.job.index
                logprobs = shape.logprobs(index, event.logprobs)
                yield _sse(shape.chunk(index, event.text, event.finish_reason, True, logprobs))
            async with aclosing(choices.rest()) as rest:  # closed with this stream: its pumps stop first
                async for index, event in rest:
                    if event.text or event.finish_reason is not None or event.logprobs:
                        yield _sse(shape.chunk(index, event.text, event.finish_reason, False,
                                               shape.logprobs(index, event.logprobs)))
        except ApiError as exc:  # headers are sent: the error travels as an event
            self.metrics.requests.labels(endpoint=choices.generations[0].job.endpoint, outcome="failed").inc()
            yield _sse(exc.body())
            return
        finally:
            await choices.aclose()
        if include_usage:
            yield _sse(shape.usage_chunk(choices.usage()))
        yield _sse("[DONE]")

    # --- the rest -----------------------------------------------------------------------------

    def models(self) -> dict[str, Any]:
        return {"object": "list", "data": [self.model_card()]}

    def model_card(self) -> dict[str, Any]:
        return {"id": self.name, "object": "model", "created": self.created, "owned_by": "shardspec",
                "max_model_len": self.engine.load_info.max_seq_len}

    async def worker_stats(self) -> list[Any]:
        """Every worker's StatsReply, or [] while they are down."""
        if not self.engine.healthy:
            return []
        try:
            return await self.engine.stats()
        except ENGINE_ERRORS:
            return []

    async def metrics_text(self) -> bytes:
        scheduler = self.engine.scheduler
        stats = await self.worker_stats()
        self.metrics.refresh(len(scheduler.running), len(scheduler.waiting), self.engine.healthy, stats)
        return self.metrics.render()

    async def internal_stats(self) -> dict[str, Any]:
        if (failure := self.engine.failure) is not None:
            raise self.unavailable(failure)
        workers = await self.worker_stats()
        scheduler = self.engine.scheduler
        return {"running": len(scheduler.running), "waiting": len(scheduler.waiting), "max_slots": scheduler.max_slots,
                "workers": [dataclasses.asdict(stats) for stats in workers]}


def create_app(engine: Engine, name: str, chat: ChatTemplate | None) -> FastAPI:
    """The FastAPI application serving `engine` under the model id `name`."""
    service = Service(engine, name, chat)
    app = FastAPI(title="shardspec", docs_url=None, redoc_url=None, openapi_url=None)
    app.state.service = service
    _add_error_handlers(app, service)
    app.add_api_route("/v1/completions", service.completions, methods=["POST"])
    app.add_api_route("/v1/chat/completions", service.chat_completions, methods=["POST"])

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return service.models()

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str) -> dict[str, Any]:
        if model_id != service.name:
            raise ApiError(404, f"the model {model_id!r} does not exist", "model", "model_not_found")
        return service.model_card()

    @app.get("/health")
    async def health() -> dict[str, str]:
        if (failure := engine.failure) is not None:
            raise service.unavailable(failure)
        return {"status": "ok"}

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(await service.metrics_text(), media_type=CONTENT_TYPE)

    @app.get("/v1/internal/stats")
    async def internal_stats() -> dict[str, Any]:
        return await service.internal_stats()

    return app


def _add_error_handlers(app: FastAPI, service: Service) -> None:
    @app.exception_handler(ApiError)
    async def api_error(request: Request, exc: ApiError) -> JSONResponse:
        if request.url.path in GENERATION_ENDPOINTS:
            outcome = "rejected" if exc.status < 500 else "failed"
            service.metrics.requests.labels(endpoint=request.url.path, outcome=outcome).inc()
        return JSONResponse(exc.body(), status_code=exc.status)

    @app.exception_handler(HTTPException)
    async def http_error(_request: Request, exc: HTTPException) -> JSONResponse:
        return JSONResponse(ApiError(exc.status_code, str(exc.detail)).body(), status_code=exc.status_code)

    @app.exception_handler(Exception)
    async def internal_error(_request: Request, exc: Exception) -> JSONResponse:
        log.exception("unhandled error")
        return JSONResponse(ApiError(500, f"internal error: {type(exc).__name__}").body(), status_code=500)
