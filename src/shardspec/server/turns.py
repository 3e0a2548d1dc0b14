"""What the APIs that answer in blocks share (Responses' output items, Messages' content blocks):
one chat job run as an assistant turn, its text split as chat completions split it
(server.chat_output) into blocks — reasoning, text, tool calls — that events open, extend and close
as the text streams; a whole turn is the same events at once, so both give the same blocks.
"""

from __future__ import annotations

import re
from collections.abc import AsyncIterator
from contextlib import aclosing
from dataclasses import dataclass
from typing import Any

from fastapi import Request
from pydantic import BaseModel, ConfigDict

from shardspec.server.api import ApiError
from shardspec.server.chat_output import ChatOutput, Delta
from shardspec.server.generation import Choices, Generation, Service
from shardspec.server.jobs import Job
from shardspec.server.tools import ToolCall

REASONING, TEXT, CALL = "reasoning", "text", "call"


class ChatExtras(BaseModel):
    """What chat completions takes beyond OpenAI's fields (vLLM's), taken by the other chat-shaped
    APIs too and passed on to it as they are: it checks their values."""

    model_config = ConfigDict(strict=True, extra="forbid")
    chat_template_kwargs: Any = None
    structured_outputs: Any = None
    cache_salt: Any = None
    seed: Any = None
    repetition_penalty: Any = None
    presence_penalty: Any = None
    frequency_penalty: Any = None
    min_tokens: Any = None
    ignore_eos: Any = None
    logit_bias: Any = None

    def chat_extras(self) -> dict[str, Any]:
        return {name: getattr(self, name) for name in ChatExtras.model_fields}


@dataclass
class Block:
    """One block of a turn: its reasoning or text, or a tool call and its arguments' JSON so far."""

    kind: str  # REASONING, TEXT or CALL
    index: int  # its place in the turn
    text: str = ""
    call: ToolCall | None = None


@dataclass(frozen=True)
class BlockEvent:
    action: str  # "start", "delta" (with `piece`) or "stop"
    block: Block
    piece: str = ""


class TurnBlocks:
    """A choice's text, piece by piece, as the events of its blocks."""

    def __init__(self, output: ChatOutput):
        self.output = output
        self.blocks: list[Block] = []
        self.open: Block | None = None
        self.done = False

    def feed(self, text: str, final: bool) -> list[BlockEvent]:
        delta = self.output.feed(text)
        if final:
            delta += self.output.finish()
        events: list[BlockEvent] = []
        self._add(delta, events)
        if final:
            self._close(events)
            self.done = True
        return events

    def _add(self, delta: Delta, events: list[BlockEvent]) -> None:
        for kind, piece in ((REASONING, delta.reasoning), (TEXT, delta.content)):
            if piece:
                if self.open is None or self.open.kind != kind:
                    self._start(kind, None, events)
                self._extend(piece, events)
        for entry in delta.tool_calls:
            if "id" in entry:  # a new call (its first arguments may have been merged into it)
                self._start(CALL, self.output.calls[entry["index"]], events)
            if entry["function"]["arguments"]:
                self._extend(entry["function"]["arguments"], events)

    def _start(self, kind: str, call: ToolCall | None, events: list[BlockEvent]) -> None:
        self._close(events)
        self.open = Block(kind, len(self.blocks), call=call)
        self.blocks.append(self.open)
        events.append(BlockEvent("start", self.open))

    def _extend(self, piece: str, events: list[BlockEvent]) -> None:
        assert self.open is not None
        self.open.text += piece
        events.append(BlockEvent("delta", self.open, piece))

    def _close(self, events: list[BlockEvent]) -> None:
        if self.open is not None:
            events.append(BlockEvent("stop", self.open))
            self.open = None


class Turn:
    """One chat job (server.app.Service.chat_jobs) run as a turn of blocks, whole or streamed."""

    def __init__(self, service: Service, job: Job, output: ChatOutput):
        self.generation = Generation(service, job)
        self.choices = Choices([self.generation])
        self.blocks = TurnBlocks(output)

    async def begin(self, request: Request, stream: bool) -> list[BlockEvent]:
        """The whole turn's events or, `stream`, those of its first piece (errors before it: a status);
        ClientGone when the client leaves first."""
        event = (await self.choices.begin(request, stream))[0]
        return self.blocks.feed(event.text, not stream or event.finish_reason is not None)

    async def rest(self) -> AsyncIterator[list[BlockEvent]]:
        """The events of the pieces after the first; the turn's generation ends with this iterator."""
        try:
            async with aclosing(self.choices.rest()) as rest:
                async for _, event in rest:
                    yield self.blocks.feed(event.text, event.finish_reason is not None)
            if not self.blocks.done:
                yield self.blocks.feed("", True)
        except ApiError:  # (after the status: counted here, as chat completions' streams count theirs)
            metrics, endpoint = self.generation.service.metrics, self.generation.job.endpoint
            metrics.requests.labels(endpoint=endpoint, outcome="failed").inc()
            raise
        finally:
            await self.choices.aclose()

    @property
    def finish_reason(self) -> str | None:
        return self.generation.finish_reason

    @property
    def stop_string(self) -> str | None:
        return self.generation.stop_string

    def usage(self) -> tuple[int, int, int]:
        """(prompt tokens, of them found in the prefix cache, completion tokens)."""
        return len(self.generation.job.prompt_ids), self.generation.cached_tokens, self.generation.completion_tokens


def thinking_switch(kwargs: dict[str, Any] | None, enabled: bool | None, param: str) -> dict[str, Any] | None:
    """The template's kwargs with its thinking switch (`enable_thinking`, as Qwen's templates name it)
    set from an API's own field `param`; a 400 when chat_template_kwargs sets it the other way."""
    if enabled is None:
        return kwargs
    given = (kwargs or {}).get("enable_thinking", enabled)
    if given != enabled:
        raise ApiError(400, f"{param} and chat_template_kwargs.enable_thinking disagree: give one of them", param)
    return {**(kwargs or {}), "enable_thinking": enabled}


def renamed(exc: ApiError, names: dict[str, str]) -> ApiError:
    """The error with its param named as the API whose body was translated names it: `names` maps a
    regular expression of a chat body's param's start to the API's name (re.sub's replacement)."""
    for pattern, name in names.items():
        param, found = re.subn(f"^{pattern}(?=$|[.\\[])", name, exc.param or "")
        if found:
            exc.param = param
            break
    return exc
