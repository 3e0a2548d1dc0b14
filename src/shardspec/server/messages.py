"""POST /v1/messages, Anthropic's Messages API, on the chat machinery: the body's system prompt and
content blocks (text, tool_use, tool_result, thinking) become a chat body (server.app.Service.chat_jobs
runs it), and the turn's blocks (server.turns) become content blocks: thinking, text, tool_use.
Streamed as Anthropic's events; errors in Anthropic's shape. POST /v1/messages/count_tokens counts
a conversation's prompt.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Iterator
from contextlib import aclosing
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ConfigDict, Field

from shardspec.server.api import MAX_CHAT_MESSAGES, ApiError, ChatBody, parse_body
from shardspec.server.streaming import ClientGone, EventStream, sse
from shardspec.server.turns import CALL, REASONING, Block, BlockEvent, ChatExtras, Turn, renamed, thinking_switch

# a chat body's params as this API names them (errors raised on the chat path name these)
NAMES = {r"messages(\[\d+\]\S*)?": "messages", r"tools\[(\d+)\]\.function\.parameters": r"tools[\1].input_schema",
         r"tools\[(\d+)\]\.function": r"tools[\1]", "stop": "stop_sequences", "response_format": "output_config.format"}
ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
               404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error", 503: "overloaded_error"}


class MessagesError(ApiError):
    """An error in Anthropic's shape: {"type": "error", "error": {"type", "message"}}."""

    def body(self) -> dict[str, Any]:
        kind = ERROR_TYPES.get(self.status, "invalid_request_error" if self.status < 500 else "api_error")
        return {"type": "error", "error": {"type": kind, "message": self.message}}


def anthropic_error(exc: ApiError) -> MessagesError:
    """The error as this API names its params; the param leads the message (Anthropic's errors have no
    field for it)."""
    renamed(exc, NAMES)
    message = exc.message if not exc.param or exc.message.startswith(exc.param) else f"{exc.param}: {exc.message}"
    return MessagesError(exc.status, message, exc.param, exc.code, exc.kind)


class Conversation(ChatExtras):
    """What both routes take: the model, the conversation, its tools and thinking (and chat
    completions' extras)."""

    model: str
    messages: list[Any] = Field(min_length=1, max_length=MAX_CHAT_MESSAGES)
    system: str | list[Any] | None = None
    tools: list[Any] | None = None
    tool_choice: dict[str, Any] | None = None
    thinking: dict[str, Any] | None = None
    mcp_servers: Any = None

    def chat_fields(self) -> dict[str, Any]:
        choice, parallel = _tool_choice(self.tool_choice)
        thinking = thinking_switch(self.chat_template_kwargs, _thinking(self.thinking), "thinking")
        return {**self.chat_extras(), "model": self.model, "messages": chat_messages(self.messages, self.system),
                "tools": [_chat_tool(t, f"tools[{i}]") for i, t in enumerate(self.tools)] if self.tools else None,
                "tool_choice": choice, "parallel_tool_calls": parallel, "chat_template_kwargs": thinking}

    def unsupported(self) -> tuple[str, str] | None:
        return ("mcp_servers", "MCP servers are not supported") if self.mcp_servers else None


class OutputConfig(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")
    format: dict[str, Any] | None = None  # {"type": "json_schema", "schema": ...}: structured output
    effort: str | None = None  # (accepted: not graded here)


class MessagesBody(Conversation):
    """A Messages request: max_tokens is required, as Anthropic requires it. Sampling values are
    checked where chat completions checks them."""

    max_tokens: int = Field(ge=1)
    output_config: OutputConfig | None = None
    cache_control: dict[str, Any] | None = None  # (a hint: the prefix cache works without it)
    stop_sequences: list[str] | None = None
    stream: bool | None = False
    temperature: Any = None
    top_p: Any = None
    top_k: Any = None
    metadata: dict[str, Any] | None = None
    service_tier: str | None = None
    container: Any = None
    context_management: Any = None

    def chat_fields(self) -> dict[str, Any]:
        sampling = {"max_tokens": self.max_tokens, "stop": self.stop_sequences, "temperature": self.temperature,
                    "top_p": self.top_p, "top_k": self.top_k}
        fields = super().chat_fields() | sampling
        # the format is the final text's: a turn that must call has none
        fields["response_format"] = None if fields["tool_choice"] not in (None, "auto", "none") else \
            _response_format(self.output_config.format if self.output_config else None)
        return fields

    def unsupported(self) -> tuple[str, str] | None:
        checks = [("container", self.container is not None, "containers are not supported"),
                  ("context_management", self.context_management is not None, "context management is not supported"),
                  ("service_tier", self.service_tier not in (None, "auto", "standard_only"),
                   'service_tier is "auto" or "standard_only"')]
        return next(((p, why) for p, bad, why in checks if bad), None) or super().unsupported()


def chat_body(body: Conversation) -> ChatBody:
    if (unsupported := body.unsupported()) is not None:
        raise ApiError(400, unsupported[1], unsupported[0])
    fields = {k: v for k, v in body.chat_fields().items() if v is not None}
    return parse_body(json.dumps(fields).encode(), ChatBody)


def _authorization(request: Request) -> str | None:
    """The API key as the cache salts read it: Anthropic's clients send it as x-api-key."""
    key = request.headers.get("x-api-key")
    return request.headers.get("authorization") or (f"Bearer {key}" if key else None)


class Messages:
    """The routes of /v1/messages over the server's Service."""

    def __init__(self, service: Any):
        self.service = service

    async def create(self, request: Request) -> Response:
        return await _in_anthropic_shape(self._create(request))

    async def count_tokens(self, request: Request) -> Response:
        return await _in_anthropic_shape(self._count_tokens(request))

    async def _create(self, request: Request) -> Response:
        arrived = time.perf_counter()
        body = parse_body(await request.body(), MessagesBody)
        run = await self.service.chat_jobs(request.url.path, chat_body(body), _authorization(request), arrived)
        turn = Turn(self.service, run.jobs[0], run.output())
        if turn.generation.job.constraint_param == "response_format":
            turn.generation.job.constraint_param = "output_config.format"
        try:
            first = await turn.begin(request, bool(body.stream))
        except ClientGone:
            return Response(status_code=499)
        writer = MessageWriter(self.service.name, turn)
        if not body.stream:
            return JSONResponse(writer.message(writer.stop_reason()))
        return EventStream(writer.stream(first))

    async def _count_tokens(self, request: Request) -> Response:
        chat = chat_body(parse_body(await request.body(), Conversation))
        self.service.check(chat)
        _, prompt = await self.service.chat_prompt(chat)
        return JSONResponse({"input_tokens": len(await self.service.encode(prompt, "messages", keep=False))})


async def _in_anthropic_shape(work: Awaitable[Response]) -> Response:
    try:
        return await work
    except ApiError as exc:
        raise anthropic_error(exc) from None


# --- the request as a chat body ---------------------------------------------------------------


def _tool_choice(choice: dict[str, Any] | None) -> tuple[str | dict[str, Any] | None, bool | None]:
    """(chat completions' tool_choice, parallel_tool_calls) for Anthropic's tool_choice."""
    if choice is None:
        return None, None
    kind, parallel = choice.get("type"), False if choice.get("disable_parallel_tool_use") else None
    if kind in ("auto", "none"):
        return kind, parallel
    if kind == "any":
        return "required", parallel
    if kind == "tool" and isinstance(choice.get("name"), str):
        return {"type": "function", "function": {"name": choice["name"]}}, parallel
    raise ApiError(400, 'tool_choice is {"type": "auto"}, {"type": "any"}, {"type": "none"} or {"type": "tool", '
                   '"name": ...}', "tool_choice")


def _response_format(spec: dict[str, Any] | None) -> dict[str, Any] | None:
    if spec is None:
        return None
    if spec.get("type") != "json_schema" or not isinstance(spec.get("schema"), dict):
        raise ApiError(400, 'output_config.format is {"type": "json_schema", "schema": {...}}', "output_config.format")
    return {"type": "json_schema", "json_schema": {"name": "output", "schema": spec["schema"]}}


def _thinking(thinking: dict[str, Any] | None) -> bool | None:
    """The template's thinking switch: on for "enabled", "adaptive" and "between_tools" (budget_tokens
    is not enforced: max_tokens bounds the thinking and the answer together), off for "disabled"."""
    if thinking is None:
        return None
    if thinking.get("type") in ("enabled", "adaptive", "between_tools", "disabled"):
        return thinking["type"] != "disabled"
    raise ApiError(400, 'thinking is {"type": "enabled", "budget_tokens": ...}, {"type": "adaptive"} or '
                   '{"type": "disabled"}', "thinking.type")


def _chat_tool(tool: Any, param: str) -> dict[str, Any]:
    if not isinstance(tool, dict) or tool.get("type", "custom") != "custom":
        kind = tool.get("type") if isinstance(tool, dict) else None
        raise ApiError(400, f"only client tools ({{\"name\": ..., \"input_schema\": ...}}) are supported, got type "
                       f"{kind!r:.40}", param)
    function = {"name": tool.get("name"), "description": tool.get("description"),
                "parameters": tool.get("input_schema")}
    return {"type": "function", "function": {k: v for k, v in function.items() if v is not None}}


def chat_messages(messages: list[Any], system: str | list[Any] | None) -> list[dict[str, Any]]:
    """The chat messages of a system prompt and Messages' messages: a user message's tool_result
    blocks are tool messages (before its text); an assistant's thinking is its reasoning_content and
    its tool_use blocks its tool calls."""
    chat = [{"role": "system", "content": _text(system, "system")}] if system else []
    for i, message in enumerate(messages):
        param = f"messages[{i}]"
        role = message.get("role") if isinstance(message, dict) else None
        if role not in ("user", "assistant"):
            raise ApiError(400, f"a message's role is user or assistant, got {role!r:.40}", f"{param}.role")
        content = message.get("content")
        blocks = [{"type": "text", "text": content}] if isinstance(content, str) else content
        if not isinstance(blocks, list) or not all(isinstance(b, dict) for b in blocks):
            raise ApiError(400, "content is a string or a list of content blocks", f"{param}.content")
        chat += [_assistant(blocks, param)] if role == "assistant" else _user(blocks, param)
    if messages[-1].get("role") == "assistant":
        raise ApiError(400, "the last message is the assistant's: continuing a prefilled answer is not supported",
                       f"messages[{len(messages) - 1}]")
    return chat


def _user(blocks: list[dict[str, Any]], param: str) -> list[dict[str, Any]]:
    results, texts = [], []
    for j, block in enumerate(blocks):
        where = f"{param}.content[{j}]"
        if block.get("type") == "tool_result":
            if not isinstance(block.get("tool_use_id"), str):
                raise ApiError(400, "a tool_result names its tool_use_id", f"{where}.tool_use_id")
            results.append({"role": "tool", "tool_call_id": block["tool_use_id"],
                            "content": _text(block.get("content") or "", f"{where}.content")})
        else:
            texts.append(_block_text(block, where))
    return results + ([{"role": "user", "content": "\n".join(texts)}] if texts or not results else [])


def _assistant(blocks: list[dict[str, Any]], param: str) -> dict[str, Any]:
    message: dict[str, Any] = {"role": "assistant", "content": ""}
    texts = []
    for j, block in enumerate(blocks):
        kind, where = block.get("type"), f"{param}.content[{j}]"
        if kind == "thinking" and isinstance(block.get("thinking"), str):
            message["reasoning_content"] = block["thinking"]
        elif kind == "redacted_thinking":
            continue  # (encrypted by another server: nothing this model can read)
        elif kind == "tool_use":
            message.setdefault("tool_calls", []).append(_call(block, where))
        else:
            texts.append(_block_text(block, where))
    message["content"] = "\n".join(texts)
    return message


def _call(block: dict[str, Any], param: str) -> dict[str, Any]:
    if not isinstance(block.get("id"), str) or not isinstance(block.get("name"), str):
        raise ApiError(400, "a tool_use block has an id and a name", param)
    if not isinstance(block.get("input"), dict):
        raise ApiError(400, "a tool_use block's input is an object", f"{param}.input")
    return {"id": block["id"], "type": "function",
            "function": {"name": block["name"], "arguments": json.dumps(block["input"], ensure_ascii=False)}}


def _block_text(block: dict[str, Any], param: str) -> str:
    if block.get("type") != "text" or not isinstance(block.get("text"), str):
        raise ApiError(400, f"content blocks of type {block.get('type')!r:.40} are not supported here (text, "
                       "tool_use, tool_result, thinking)", f"{param}.type")
    return block["text"]


def _text(content: str | list[Any], param: str) -> str:
    if isinstance(content, str):
        return content
    if not isinstance(content, list) or not all(isinstance(b, dict) for b in content):
        raise ApiError(400, "a string or a list of text blocks", param)
    return "\n".join(_block_text(block, f"{param}[{j}]") for j, block in enumerate(content))


# --- the answer ---------------------------------------------------------------------------------


class MessageWriter:
    """One message: its object and its events from the turn's blocks."""

    def __init__(self, model: str, turn: Turn):
        self.model = model
        self.turn = turn
        self.id = f"msg_{uuid.uuid4().hex}"

    def message(self, stop: tuple[str | None, str | None], blocks: list[Block] | None = None) -> dict[str, Any]:
        content = [self.block(b) for b in (self.turn.blocks.blocks if blocks is None else blocks)]
        return {"id": self.id, "type": "message", "role": "assistant", "model": self.model, "content": content,
                "stop_reason": stop[0], "stop_sequence": stop[1], "usage": self.usage()}

    def stop_reason(self) -> tuple[str, str | None]:
        """(stop_reason, stop_sequence)."""
        if self.turn.finish_reason == "length":
            return "max_tokens", None
        if any(b.kind == CALL for b in self.turn.blocks.blocks):
            return "tool_use", None
        if self.turn.stop_string is not None:
            return "stop_sequence", self.turn.stop_string
        return "end_turn", None

    def usage(self) -> dict[str, int]:
        """Anthropic counts the prompt's tokens read from the cache apart from its input_tokens."""
        prompt, cached, completion = self.turn.usage()
        return {"input_tokens": prompt - cached, "output_tokens": completion, "cache_read_input_tokens": cached,
                "cache_creation_input_tokens": 0}

    def block(self, block: Block, started: bool = False) -> dict[str, Any]:
        """A content block, whole or (`started`) as content_block_start opens it."""
        if block.kind == REASONING:
            return {"type": "thinking", "thinking": "" if started else block.text, "signature": ""}
        if block.kind == CALL:
            assert block.call is not None
            return {"type": "tool_use", "id": block.call.id, "name": block.call.name,
                    "input": {} if started else block.call.arguments}
        return {"type": "text", "text": "" if started else block.text}

    async def stream(self, first: list[BlockEvent]) -> AsyncIterator[bytes]:
        try:
            yield _event("message_start", message=self.message((None, None), []))
            for chunk in self.block_events(first):
                yield chunk
            async with aclosing(self.turn.rest()) as rest:
                async for events in rest:
                    for chunk in self.block_events(events):
                        yield chunk
        except ApiError as exc:  # headers are sent: the error travels as an event
            yield sse(anthropic_error(exc).body(), "error")
            return
        finally:
            await self.turn.choices.aclose()
        stop_reason, stop_sequence = self.stop_reason()
        yield _event("message_delta", delta={"stop_reason": stop_reason, "stop_sequence": stop_sequence},
                     usage=self.usage())
        yield _event("message_stop")

    def block_events(self, events: list[BlockEvent]) -> Iterator[bytes]:
        for event in events:
            index = event.block.index
            if event.action == "start":
                yield _event("content_block_start", index=index, content_block=self.block(event.block, True))
            elif event.action == "delta":
                yield _event("content_block_delta", index=index, delta=_delta(event.block.kind, event.piece))
            else:
                yield _event("content_block_stop", index=index)


def _delta(kind: str, piece: str) -> dict[str, str]:
    if kind == REASONING:
        return {"type": "thinking_delta", "thinking": piece}
    if kind == CALL:
        return {"type": "input_json_delta", "partial_json": piece}
    return {"type": "text_delta", "text": piece}


def _event(kind: str, **fields: Any) -> bytes:
    return sse({"type": kind, **fields}, kind)

