"""The HTTP application: OpenAI-compatible routes on FastAPI over one running Engine.

Every request becomes one `engine.generate` stream; the engine batches all of them step by step
(continuous batching). A client that disconnects, or a stop string that matches, closes its stream,
which frees the sequence's cache slot at the next step.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import json
import logging
import time
from collections.abc import AsyncIterator, Callable
from contextlib import aclosing
from dataclasses import dataclass
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import HTMLResponse, JSONResponse, Response
from starlette.exceptions import HTTPException

from shardspec.orchestrator.engine import ENGINE_ERRORS, Engine
from shardspec.orchestrator.metrics import CONTENT_TYPE, ServingMetrics
from shardspec.server import status
from shardspec.server.api import ApiError, ChatBody, ChatShape, CompletionBody, GenerationBody, Shape, parse_body
from shardspec.server.cache_salts import CacheSalts
from shardspec.server.chat import ChatPrompt, ChatTemplate, ChatTemplateError
from shardspec.server.chat_output import THINK_CLOSE, THINK_OPEN, ChatOutput
from shardspec.server.encoding import ChatEncoder, encode_within
from shardspec.server.generation import Choices, Event, Generation
from shardspec.server.jobs import Job, check_logprob_entries, request_jobs
from shardspec.server.limits import HttpLimits
from shardspec.server.messages import Messages
from shardspec.server.responses import Responses
from shardspec.server.streaming import ClientGone, EventStream, sse
from shardspec.server.tokens import Tokenize
from shardspec.server.tools import Tool, calls_grammar, chosen_tools, parse_tools
from shardspec.utils import public_reason

log = logging.getLogger("shardspec.server")

GENERATION_ENDPOINTS = ("/v1/completions", "/v1/chat/completions", "/v1/responses", "/v1/messages")
COMPLETION_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions
@dataclass
class ChatJobs:
    """A chat request's jobs, and `output()`: a fresh split of one choice's text (server.chat_output)."""

    jobs: list[Job]
    output: Callable[[], ChatOutput]


class Service:
    """The served model: the engine, its name, chat template and metrics, and the route logic."""

    def __init__(self, engine: Engine, name: str, chat: ChatTemplate | None,
                 limits: HttpLimits | None = None, salts: CacheSalts | None = None):
        self.engine = engine
        self.name = name
        self.chat = chat
        self.limits = limits or HttpLimits()
        self.salts = salts or CacheSalts()
        self.created = int(time.time())
        self.metrics = ServingMetrics(engine.draft_tokens)
        self.logged_failure: str | None = None
        engine.observer = self.metrics
        tokenizer = engine.tokenizer
        # the model reasons between <think> and </think> (tokens of its own, as in Qwen's tokenizers)
        self.chat_encoder = None if tokenizer is None else ChatEncoder(tokenizer)
        self.added_tokens = frozenset() if self.chat_encoder is None else frozenset(self.chat_encoder.added)
        self.thinks = {THINK_OPEN, THINK_CLOSE} <= self.added_tokens

    @property
    def context(self) -> int:
        """A sequence's tokens at most, prompt and output."""
        return self.engine.load_info.max_seq_len

    # --- checks -------------------------------------------------------------------------------

    def engine_failed(self, exc: Exception) -> ApiError:
        failure = self.engine.failure
        if failure is not None:
            return self.unavailable(failure)
        log.error("generation failed: %s", exc)
        return ApiError(500, f"generation failed: {public_reason(str(exc))}", kind="server_error")

    def unavailable(self, failure: str) -> ApiError:
        """503 with the failure's first line; its details (a worker's log tail) go to the server's log."""
        if failure == self.engine.stopping:
            return ApiError(503, failure, code="shutting_down", kind="service_unavailable")
        if failure != self.logged_failure:
            log.error("the model's workers are unavailable: %s", failure)
            self.logged_failure = failure
        return ApiError(503, f"the model's workers are unavailable: {public_reason(failure)}",
                        code="workers_unavailable", kind="service_unavailable")

    def check(self, body: GenerationBody) -> None:
        self.check_model(body.model)
        if (unsupported := body.unsupported()) is not None:
            raise ApiError(400, unsupported[1], unsupported[0])
        if (failure := self.engine.failure) is not None:
            raise self.unavailable(failure)

    def check_model(self, model: str | None) -> None:
        if model is not None and model != self.name:
            raise ApiError(404, f"the model {model!r} does not exist; this server serves {self.name!r}",
                           "model", "model_not_found")

    def token_text(self, param: str):
        """A token id's text (what logprobs and echo name tokens by); 400 naming `param` without a tokenizer."""
        if self.engine.tokenizer is None:
            raise ApiError(400, f"this model has no tokenizer.json, which {param} needs to spell tokens", param)
        return self.token_text_or_none()

    def token_text_or_none(self):
        tokenizer = self.engine.tokenizer  # (each token spelled once a request: logprobs name many)
        return None if tokenizer is None else functools.cache(lambda token: tokenizer.decode([token]))

    async def encode(self, text: str | ChatPrompt, param: str, salt: str | None = None, keep: bool = True) -> list[int]:
        """The text's token ids, tokenized in a thread (a long prompt must not stall other requests)
        and counted against the context as they come; a chat prompt's pieces kept per cache salt
        (`keep`: ChatEncoder)."""
        if self.engine.tokenizer is None:
            raise ApiError(400, "this model has no tokenizer.json: send the prompt as token ids", param)
        if isinstance(text, str):
            ids = await asyncio.to_thread(encode_within, self.engine.tokenizer, text, self.context)
        else:
            ids = await asyncio.to_thread(self.chat_encoder.encode, text, self.context, salt, keep)
        if ids is None:
            raise ApiError(400, f"the prompt (over {self.context} tokens) does not fit the context of "
                           f"{self.context} tokens", param)
        return ids

    # --- generation ---------------------------------------------------------------------------

    async def completions(self, request: Request) -> Response:
        arrived = time.perf_counter()
        body = parse_body(await request.body(), CompletionBody)
        self.check(body)
        salt = self.salts.salt(request.headers.get("authorization"), body.cache_salt)
        texts = body.prompts()
        prompts = [await self.encode(p, "prompt") if isinstance(p, str) else p for p in texts]
        max_tokens = COMPLETION_DEFAULT_MAX_TOKENS if body.max_tokens is None else body.max_tokens
        jobs = request_jobs(request.url.path, body, prompts, "prompt", max_tokens, self.context)
        if body.logprobs is not None or body.echo:
            self.token_text("logprobs" if body.logprobs is not None else "echo")  # a tokenizer spells tokens
        for job in jobs:
            job.arrived = arrived
            job.logprobs = body.logprobs
            job.sampling["cache_salt"] = salt
            if body.echo:
                text = texts[job.prompt_index]
                job.echo = text if isinstance(text, str) else self.engine.tokenizer.decode(text)
        check_logprob_entries(jobs, self.limits.max_logprob_entries, "logprobs")
        return await self.respond(request, jobs, Shape(self.name, self.token_text_or_none()), body)

    async def chat_completions(self, request: Request) -> Response:
        arrived = time.perf_counter()
        body = parse_body(await request.body(), ChatBody)
        run = await self.chat_jobs(request.url.path, body, request.headers.get("authorization"), arrived)
        tokenizer = self.engine.tokenizer
        shape = ChatShape(self.name, run.output, self.token_text_or_none(), reasons=self.thinks,
                          token_bytes=functools.cache(tokenizer.token_bytes) if tokenizer is not None else None)
        return await self.respond(request, run.jobs, shape, body)

    async def chat_prompt(self, body: ChatBody, add_generation_prompt: bool = True) -> tuple[list[dict[str, Any]],
                                                                                              ChatPrompt]:
        """A chat body's messages as the template takes them, and its rendered prompt."""
        if self.chat is None:
            raise ApiError(400, "this model has no chat template (tokenizer_config.json): use /v1/completions",
                           "messages")
        if body.tools and not self.chat.writes_tool_calls:
            raise ApiError(400, "this model's chat template does not write tool calls in the format this server "
                           "parses (Qwen3.5's <tool_call><function=...> blocks)", "tools")
        parse_tools(body.tools or [])  # (a count of tokens is refused where generating would be: /tokenize too)
        messages = [m.for_template(i) for i, m in enumerate(body.messages)]
        try:  # in a thread, like tokenizing: a template may take long over many messages
            prompt = await asyncio.to_thread(self.chat.render_request, messages, body.tools, body.chat_template_kwargs,
                                             self.added_tokens, add_generation_prompt)
        except ChatTemplateError as exc:
            raise ApiError(400, str(exc), "messages") from None
        return messages, prompt

    async def chat_jobs(self, endpoint: str, body: ChatBody, authorization: str | None, arrived: float) -> ChatJobs:
        """A chat body's checked jobs, and how their text splits into reasoning, content and calls: what
        every chat-shaped API (chat completions, responses, messages) runs; `arrived`: when the request
        did (time.perf_counter)."""
        self.check(body)
        salt = self.salts.salt(authorization, body.cache_salt)
        tools = parse_tools(body.tools) if body.tools else []
        mode, callable_tools = chosen_tools(body.tool_choice, tools)
        messages, prompt = await self.chat_prompt(body)
        reasoning = self.thinks and prompt.marked.rfind(THINK_OPEN) > prompt.marked.rfind(THINK_CLOSE)
        constraint = self._chat_constraint(body, mode, callable_tools, reasoning)
        ids = await self.encode(prompt, "messages", salt)
        jobs = request_jobs(endpoint, body, [ids], "messages", body.max_completion_tokens or body.max_tokens,
                            self.context)
        points = await self._system_prompt_end(messages, body, ids, salt)
        for job in jobs:
            job.arrived = arrived
            job.logprobs = (body.top_logprobs or 0) if body.logprobs else None
            job.sampling["prefix_points"] = points
            job.sampling["structured_output"] = constraint
            if mode == "required":
                job.constraint_param = "tool_choice"
            job.sampling["cache_salt"] = salt
        check_logprob_entries(jobs, self.limits.max_logprob_entries, "top_logprobs" if body.top_logprobs else
                              "logprobs")
        parsed, parallel = (tools if mode != "none" else None), body.parallel_tool_calls is not False
        return ChatJobs(jobs, lambda: ChatOutput(reasoning, self.thinks, parsed, parallel))

    async def _system_prompt_end(self, messages: list[dict[str, Any]], body: ChatBody, ids: list[int],
                                 salt: str | None) -> list[int]:
        """[where the system prompt's turn ends in the prompt `ids`] when the conversation has one and
        goes on after it, else []: other conversations with the same system prompt part from this one
        there, so the prefix cache saves a state there (Engine.generate's prefix_points)."""
        if len(messages) < 2 or messages[0].get("role") not in ("system", "developer"):
            return []
        head = await asyncio.to_thread(self.chat.render_request, messages[:1], body.tools, body.chat_template_kwargs,
                                       self.added_tokens, False)
        head_ids = await self.encode(head, "messages", salt)  # (its pieces are the prompt's first: kept)
        n = len(head_ids)
        return [n] if 0 < n < len(ids) and ids[:n] == head_ids else []

    def _chat_constraint(self, body: ChatBody, mode: str, tools: list[Tool], reasoning: bool) -> dict[str, Any] | None:
        """The request's grammar: its response format, or a call of its tools when one is required;
        after the reasoning when the output starts inside it."""
        constraint = body.structured_output()
        if mode == "required":
            if constraint is not None:
                raise ApiError(400, "a required tool call and a response format cannot both constrain the output",
                               "tool_choice")
            constraint = {"grammar": calls_grammar(tools, body.parallel_tool_calls is not False, self.added_tokens)}
        if constraint is not None and reasoning:
            constraint = {**constraint, "after": THINK_CLOSE}
        return constraint

    async def respond(self, request: Request, jobs: list[Job], shape: Shape, body: GenerationBody) -> Response:
        choices = Choices([Generation(self, job) for job in jobs])
        try:
            events = await choices.begin(request, bool(body.stream))
        except ClientGone:
            return Response(status_code=499)
        if not body.stream:
            return await asyncio.to_thread(_whole_response, shape, choices, events)  # (off the loop: logprobs)
        first = events
        include_usage = body.stream_options is not None and body.stream_options.include_usage
        return EventStream(self._stream(shape, first, choices, include_usage))

    async def _stream(self, shape: Shape, first: list[Event], choices: Choices,
                      include_usage: bool) -> AsyncIterator[bytes]:
        try:
            for chunk in await asyncio.to_thread(_first_chunks, shape, choices, first):  # (an echo's logprobs)
                yield chunk
            async with aclosing(choices.rest()) as rest:  # closed with this stream: its pumps stop first
                async for index, event in rest:
                    if event.text or event.finish_reason is not None or event.logprobs:
                        chunk = shape.chunk(index, event.text, event.finish_reason, False,
                                            shape.logprobs(index, event.logprobs))
                        if not _says_nothing(chunk):  # (a chat's text held back: a marker may be starting)
                            yield sse(chunk)
        except ApiError as exc:  # headers are sent: the error travels as an event, then the stream's end
            self.metrics.requests.labels(endpoint=choices.generations[0].job.endpoint, outcome="failed").inc()
            yield sse(exc.body())
            yield sse("[DONE]")
            return
        finally:
            await choices.aclose()
        if include_usage:
            yield sse(shape.usage_chunk(choices.usage()))
        yield sse("[DONE]")

    # --- the rest -----------------------------------------------------------------------------

    def models(self) -> dict[str, Any]:
        return {"object": "list", "data": [self.model_card()]}

    def model_card(self) -> dict[str, Any]:
        return {"id": self.name, "object": "model", "created": self.created, "owned_by": "shardspec",
                "max_model_len": self.context}

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
        self.metrics.refresh(scheduler, self.engine.healthy, stats)
        return self.metrics.render()

    async def internal_stats(self) -> dict[str, Any]:
        if (failure := self.engine.failure) is not None:
            raise self.unavailable(failure)
        workers = await self.worker_stats()
        scheduler = self.engine.scheduler
        return {"running": len(scheduler.running), "waiting": len(scheduler.waiting), "max_seqs": scheduler.max_seqs,
                "workers": [dataclasses.asdict(stats) for stats in workers]}


def _whole_response(shape: Shape, choices: Choices, events: list[Event]) -> Response:
    """The response, each choice encoded apart: json.dumps holds the GIL, and the event loop waits
    for one choice's at most (a choice of 21,000 log-probabilities takes ~10 ms)."""
    encoded = [_json(shape.choice(g.job.index, e.text, e.finish_reason, shape.logprobs(g.job.index, e.logprobs)))
               for g, e in zip(choices.generations, events)]
    envelope = _json(shape.response([], choices.usage()))  # (its strings cannot hold "choices":[] unescaped)
    return Response(envelope.replace('"choices":[]', f'"choices":[{",".join(encoded)}]', 1),
                    media_type="application/json")


def _json(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False, allow_nan=False, separators=(",", ":"))  # (as JSONResponse)


def _says_nothing(chunk: dict[str, Any]) -> bool:
    """A chat chunk of an empty delta, without an end or log-probabilities."""
    choice = chunk["choices"][0]
    return choice.get("delta") == {} and choice["finish_reason"] is None and choice["logprobs"] is None


def _first_chunks(shape: Shape, choices: Choices, first: list[Event]) -> list[bytes]:
    return [sse(shape.chunk(g.job.index, e.text, e.finish_reason, True, shape.logprobs(g.job.index, e.logprobs)))
            for g, e in zip(choices.generations, first)]


def create_app(engine: Engine, name: str, chat: ChatTemplate | None,
               limits: HttpLimits | None = None, cache_salt: str = "optional") -> FastAPI:
    """The FastAPI application serving `engine` under the model id `name`; `cache_salt`: which requests
    share the prefix cache (server.cache_salts)."""
    service = Service(engine, name, chat, limits=limits, salts=CacheSalts(cache_salt))
    app = FastAPI(title="shardspec", docs_url=None, redoc_url=None, openapi_url=None)
    app.state.service = service
    _add_error_handlers(app, service)
    app.add_api_route("/v1/completions", service.completions, methods=["POST"])
    app.add_api_route("/v1/chat/completions", service.chat_completions, methods=["POST"])
    responses, messages, tokenize = Responses(service), Messages(service), Tokenize(service)
    app.add_api_route("/v1/responses", responses.create, methods=["POST"])
    app.add_api_route("/v1/responses/{response_id}", responses.retrieve, methods=["GET"])
    app.add_api_route("/v1/responses/{response_id}", responses.delete, methods=["DELETE"])
    app.add_api_route("/v1/messages", messages.create, methods=["POST"])
    app.add_api_route("/v1/messages/count_tokens", messages.count_tokens, methods=["POST"])
    app.add_api_route("/tokenize", tokenize.tokenize, methods=["POST"])
    app.add_api_route("/detokenize", tokenize.detokenize, methods=["POST"])

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

    started = time.monotonic()

    @app.get("/status.json")
    async def status_json() -> dict[str, Any]:
        return await status.report(service, started)

    @app.get("/status")
    @app.get("/")
    async def status_page() -> HTMLResponse:
        return HTMLResponse(status.page())

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
