"""POST /v1/responses, OpenAI's Responses API, on the chat machinery: the body's instructions and
input items (messages, function calls and their outputs, reasoning) become a chat body
(server.app.Service.chat_jobs runs it), and the turn's blocks (server.turns) become output items:
a reasoning item, a message, function calls. Streamed as the Responses events. Responses are kept
for `previous_response_id` in a bounded store (server.response_store); GET and DELETE
/v1/responses/{id} read and drop them.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from contextlib import aclosing
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ConfigDict, Field

from shardspec.server.api import ApiError, ChatBody, parse_body
from shardspec.server.response_store import ResponseStore
from shardspec.server.streaming import ClientGone, EventStream, sse
from shardspec.server.turns import CALL, REASONING, TEXT, Block, BlockEvent, ChatExtras, Turn, renamed, thinking_switch

# a chat body's params as this API names them (errors raised on the chat path name these)
NAMES = {r"messages(\[\d+\]\S*)?": "input", "max_tokens": "max_output_tokens", "response_format": "text.format",
         r"tools\[(\d+)\]\.function": r"tools[\1]"}
EFFORTS = ("none", "minimal", "low", "medium", "high", "xhigh")
INCLUDABLE = ("reasoning.encrypted_content",)  # asked for by stateless clients: reasoning items carry their text
KEPT = "(responses are kept in this server's memory when store is true, the least recently used dropped first)"
ITEM_PREFIX = {TEXT: "msg_", REASONING: "rs_", CALL: "fc_"}


class ReasoningOptions(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")
    effort: str | None = None
    summary: str | None = None
    generate_summary: str | None = None


class TextOptions(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")
    format: dict[str, Any] | None = None
    verbosity: str | None = None


class ResponsesBody(ChatExtras):
    """A Responses request. Sampling values are checked where chat completions checks them."""

    model: str | None = None
    input: str | list[Any] | None = None  # (none: previous_response_id's conversation goes on as it is)
    instructions: str | None = None
    tools: list[Any] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    max_output_tokens: int | None = Field(None, ge=1)
    max_tool_calls: int | None = None
    temperature: Any = None
    top_p: Any = None
    top_logprobs: int | None = None
    stream: bool | None = False
    stream_options: dict[str, Any] | None = None
    store: bool | None = True
    previous_response_id: str | None = None
    conversation: Any = None
    reasoning: ReasoningOptions | None = None
    text: TextOptions | None = None
    truncation: str | None = None
    metadata: dict[str, str] | None = None
    user: str | None = None
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None
    prompt_cache_retention: str | None = None
    include: list[str] | None = None
    background: bool | None = None
    service_tier: str | None = None
    prompt: Any = None
    context_management: Any = None
    top_k: Any = None  # (not OpenAI's, as the extras)
    stop: Any = None

    def unsupported(self) -> tuple[str, str] | None:
        effort = self.reasoning.effort if self.reasoning else None
        checks = [
            ("max_tool_calls", self.max_tool_calls is not None, "max_tool_calls is not supported"),
            ("top_logprobs", bool(self.top_logprobs), "log-probabilities are not supported by /v1/responses (use "
             "/v1/chat/completions)"),
            ("stream_options", self.stream_options is not None and not self.stream,
             "stream_options is only allowed with stream: true"),
            ("conversation", self.conversation is not None, "conversations are not supported: use "
             "previous_response_id"),
            ("reasoning.effort", effort is not None and effort not in EFFORTS, f"reasoning.effort is one of {EFFORTS}"),
            ("text.verbosity", self.text is not None and self.text.verbosity not in (None, "medium"),
             "text.verbosity other than medium is not supported"),
            ("truncation", self.truncation not in (None, "disabled"), 'only truncation "disabled" is supported: a '
             "conversation beyond the context is refused"),
            ("include", any(i not in INCLUDABLE for i in self.include or ()), f"include may name {INCLUDABLE} only"),
            ("background", bool(self.background), "background responses are not supported"),
            ("service_tier", self.service_tier not in (None, "auto", "default"), "service tiers are not supported"),
            ("prompt", self.prompt is not None, "stored prompts are not supported"),
            ("context_management", self.context_management is not None, "context management is not supported"),
        ]
        return next(((p, why) for p, bad, why in checks if bad), None)

    def thinking(self) -> bool | None:
        """The template's thinking switch: on unless reasoning.effort is "none"; None: the template's default."""
        effort = self.reasoning.effort if self.reasoning else None
        return None if effort is None else effort != "none"


class Responses:
    """The routes of /v1/responses over the server's Service."""

    def __init__(self, service: Any, store: ResponseStore | None = None):
        self.service = service
        self.store = store or ResponseStore()

    async def create(self, request: Request) -> Response:
        arrived = time.perf_counter()
        body = parse_body(await request.body(), ResponsesBody)
        if (unsupported := body.unsupported()) is not None:
            raise ApiError(400, unsupported[1], unsupported[0])
        authorization = request.headers.get("authorization")
        owner = self.store.owner(authorization)
        history = self._history(body.previous_response_id, owner)
        given = [{"type": "message", "role": "user", "content": body.input}] if isinstance(body.input, str) else \
            body.input or []
        try:
            chat = chat_body(body, chat_messages(history + given, body.instructions, len(history)))
            run = await self.service.chat_jobs(request.url.path, chat, authorization, arrived)
            turn = Turn(self.service, run.jobs[0], run.output())
            if turn.generation.job.constraint_param == "response_format":
                turn.generation.job.constraint_param = "text.format"
            first = await turn.begin(request, bool(body.stream))
        except ClientGone:
            return Response(status_code=499)
        except ApiError as exc:
            raise renamed(exc, NAMES) from None
        writer = ResponseWriter(self, body, turn, history + given, owner)
        if not body.stream:
            return JSONResponse(writer.finished())
        return EventStream(writer.stream(first))

    async def retrieve(self, request: Request, response_id: str) -> dict[str, Any]:
        stored = self.store.get(response_id, self.store.owner(request.headers.get("authorization")))
        if stored is None:
            raise _not_found(response_id)
        return stored.response

    async def delete(self, request: Request, response_id: str) -> dict[str, Any]:
        if self.store.get(response_id, self.store.owner(request.headers.get("authorization"))) is None:
            raise _not_found(response_id)
        self.store.delete(response_id)
        return {"id": response_id, "object": "response", "deleted": True}

    def _history(self, previous: str | None, owner: str) -> list[dict[str, Any]]:
        if previous is None:
            return []
        stored = self.store.get(previous, owner)
        if stored is None:
            raise ApiError(400, f"Previous response with id {previous!r:.80} not found {KEPT}", "previous_response_id",
                           "previous_response_not_found")
        return stored.items


def _not_found(response_id: str) -> ApiError:
    return ApiError(404, f"Response with id {response_id!r:.80} not found {KEPT}", "response_id", "not_found")


# --- the request as a chat body ---------------------------------------------------------------


def chat_body(body: ResponsesBody, messages: list[dict[str, Any]]) -> ChatBody:
    fields: dict[str, Any] = {
        "model": body.model, "messages": messages, "max_tokens": body.max_output_tokens,
        "temperature": body.temperature, "top_p": body.top_p, "parallel_tool_calls": body.parallel_tool_calls,
        "tools": [_chat_tool(tool, f"tools[{i}]") for i, tool in enumerate(body.tools)] if body.tools else None,
        "tool_choice": _chat_tool_choice(body.tool_choice),
        "top_k": body.top_k, "stop": body.stop, **body.chat_extras(),
    }
    # the format is the final message's (an agent's output type): a turn that must call has no message
    forced = body.tool_choice == "required" or isinstance(body.tool_choice, dict)
    response_format = _response_format(body.text.format if body.text else None)
    fields["response_format"] = None if forced else response_format
    fields["chat_template_kwargs"] = thinking_switch(body.chat_template_kwargs, body.thinking(), "reasoning.effort")
    return parse_body(json.dumps({k: v for k, v in fields.items() if v is not None}).encode(), ChatBody)


def _chat_tool(tool: Any, param: str) -> dict[str, Any]:
    if not isinstance(tool, dict) or tool.get("type") != "function":
        kind = tool.get("type") if isinstance(tool, dict) else None
        raise ApiError(400, f"only function tools ({{\"type\": \"function\", \"name\": ..., \"parameters\": ...}}) are "
                       f"supported, got type {kind!r:.40}", param)
    function = {k: tool[k] for k in ("name", "description", "parameters", "strict") if tool.get(k) is not None}
    return {"type": "function", "function": function}


def _chat_tool_choice(choice: str | dict[str, Any] | None) -> str | dict[str, Any] | None:
    if not isinstance(choice, dict):
        return choice
    if choice.get("type") != "function" or not isinstance(choice.get("name"), str):
        raise ApiError(400, 'tool_choice is "none", "auto", "required" or {"type": "function", "name": ...}',
                       "tool_choice")
    return {"type": "function", "function": {"name": choice["name"]}}


def _response_format(spec: dict[str, Any] | None) -> dict[str, Any] | None:
    kind = (spec or {}).get("type")
    if spec is None or kind == "text":
        return None
    if kind == "json_object":
        return {"type": "json_object"}
    if kind == "json_schema":
        if not isinstance(spec.get("schema"), dict):
            raise ApiError(400, 'text.format {"type": "json_schema"} needs a schema', "text.format.schema")
        return {"type": "json_schema", "json_schema": {"name": spec.get("name", "output"), "schema": spec["schema"]}}
    raise ApiError(400, 'text.format type is one of "text", "json_object", "json_schema"', "text.format.type")


def chat_messages(items: list[Any], instructions: str | None, offset: int = 0) -> list[dict[str, Any]]:
    """The chat messages of the instructions and the input items (item i named input[i - offset]; the
    `offset` items before, the stored conversation's, named previous_response_id):
    messages; a function call joins the assistant's message before it (one turn's calls together);
    a function call's output is a tool message; a reasoning item is the next assistant message's
    reasoning_content."""
    messages: list[dict[str, Any]] = [{"role": "system", "content": instructions}] if instructions else []
    reasoning: str | None = None
    for i, item in enumerate(items):
        param = f"input[{i - offset}]" if i >= offset else "previous_response_id"
        if not isinstance(item, dict):
            raise ApiError(400, "an input item is an object", param)
        kind = item.get("type", "message")
        if kind == "reasoning":
            reasoning = _reasoning_text(item, param)
            continue
        if kind == "function_call_output":
            messages.append({"role": "tool", "tool_call_id": _string(item, "call_id", param),
                             "content": _text(item.get("output"), f"{param}.output")})
            continue
        if kind == "message":
            message = _message(item, param)
        elif kind == "function_call":
            message = _call_message(item, param, messages)
        else:
            raise ApiError(400, f"input items of type {kind!r:.40} are not supported (message, function_call, "
                           "function_call_output, reasoning)", f"{param}.type")
        if message["role"] == "assistant" and reasoning is not None:
            message.setdefault("reasoning_content", reasoning)
            reasoning = None
        if message is not (messages[-1] if messages else None):
            messages.append(message)
    if not any(m["role"] != "system" for m in messages):
        raise ApiError(400, "the input has no message", "input")
    return messages


def _message(item: dict[str, Any], param: str) -> dict[str, Any]:
    role = item.get("role")
    if role not in ("user", "assistant", "system", "developer"):
        raise ApiError(400, f"a message's role is user, assistant, system or developer, got {role!r:.40}",
                       f"{param}.role")
    content = _text(item.get("content"), f"{param}.content")
    return {"role": "system" if role == "developer" else role, "content": content}


def _call_message(item: dict[str, Any], param: str, messages: list[dict[str, Any]]) -> dict[str, Any]:
    """The assistant message a function call belongs to: the one just before it, or a new one."""
    arguments = _string(item, "arguments", param)
    try:
        json.loads(arguments or "{}")
    except json.JSONDecodeError as exc:
        raise ApiError(400, f"a function call's arguments are not JSON: {exc}", f"{param}.arguments") from None
    call = {"id": _string(item, "call_id", param), "type": "function",
            "function": {"name": _string(item, "name", param), "arguments": arguments}}
    message = messages[-1] if messages and messages[-1]["role"] == "assistant" else {"role": "assistant",
                                                                                      "content": ""}
    message.setdefault("tool_calls", []).append(call)
    return message


def _reasoning_text(item: dict[str, Any], param: str) -> str:
    parts = item.get("content") or item.get("summary") or []
    if not isinstance(parts, list):
        raise ApiError(400, "a reasoning item's content is a list of parts", f"{param}.content")
    return _text(parts, f"{param}.content")


def _string(item: dict[str, Any], key: str, param: str) -> str:
    value = item.get(key)
    if not isinstance(value, str):
        raise ApiError(400, f"{key} is a string", f"{param}.{key}")
    return value


def _text(content: Any, param: str) -> str:
    """A content's text: a string, or text parts joined (input_text, output_text, reasoning_text, ...)."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise ApiError(400, "content is a string or a list of text parts", param)
    texts = []
    for j, part in enumerate(content):
        text = part.get("text", part.get("refusal")) if isinstance(part, dict) else None
        if not isinstance(text, str):
            kind = part.get("type") if isinstance(part, dict) else None
            raise ApiError(400, f"only text parts are supported, got {kind!r:.40}", f"{param}[{j}]")
        texts.append(text)
    return "\n".join(texts)


# --- the answer ---------------------------------------------------------------------------------


class ResponseWriter:
    """One response: its object, its output items from the turn's blocks, and its events."""

    def __init__(self, api: Responses, body: ResponsesBody, turn: Turn, items: list[Any], owner: str):
        self.api = api
        self.body = body
        self.turn = turn
        self.items = items
        self.owner = owner
        self.id = f"resp_{uuid.uuid4().hex}"
        self.created_at = int(time.time())
        self.item_ids: dict[int, str] = {}
        self.sequence = 0

    def finished(self) -> dict[str, Any]:
        """The response object of the whole turn, stored when the body asks (store, by default)."""
        output = [self.item(block, True) for block in self.turn.blocks.blocks]
        incomplete = self.turn.finish_reason == "length"
        response = self.response("incomplete" if incomplete else "completed", output, self.usage())
        if self.body.store is not False:
            self.api.store.put(self.id, self.owner, [*self.items, *output], response)
        return response

    async def stream(self, first: list[BlockEvent]) -> AsyncIterator[bytes]:
        try:
            yield self.event("response.created", response=self.response("in_progress", []))
            yield self.event("response.in_progress", response=self.response("in_progress", []))
            for event in first:
                for chunk in self.block_events(event):
                    yield chunk
            async with aclosing(self.turn.rest()) as rest:
                async for events in rest:
                    for event in events:
                        for chunk in self.block_events(event):
                            yield chunk
        except ApiError as exc:  # headers are sent: the error travels as events
            renamed(exc, NAMES)
            yield self.event("error", code=exc.code or exc.kind, message=exc.message, param=exc.param)
            output = [self.item(block, True) for block in self.turn.blocks.blocks]
            error = {"code": exc.code or exc.kind, "message": exc.message}
            yield self.event("response.failed", response=self.response("failed", output, self.usage(), error))
            return
        finally:
            await self.turn.choices.aclose()
        response = self.finished()
        yield self.event(f"response.{response['status']}", response=response)

    def block_events(self, event: BlockEvent) -> Iterator[bytes]:
        block, where = event.block, {"item_id": self.item_id(event.block), "output_index": event.block.index}
        call = block.kind == CALL
        if event.action == "start":
            yield self.event("response.output_item.added", output_index=block.index, item=self.item(block, False))
            if not call:
                yield self.event("response.content_part.added", **where, content_index=0, part=self.part(block, ""))
        elif event.action == "delta":
            if call:
                yield self.event("response.function_call_arguments.delta", **where, delta=event.piece)
            else:
                extra = {"logprobs": []} if block.kind == TEXT else {}
                yield self.event(f"response.{_part_type(block)}.delta", **where, content_index=0, delta=event.piece,
                                 **extra)
        else:
            if call:
                assert block.call is not None
                yield self.event("response.function_call_arguments.done", **where, name=block.call.name,
                                 arguments=block.text)
            else:
                extra = {"logprobs": []} if block.kind == TEXT else {}
                yield self.event(f"response.{_part_type(block)}.done", **where, content_index=0, text=block.text,
                                 **extra)
                yield self.event("response.content_part.done", **where, content_index=0,
                                 part=self.part(block, block.text))
            yield self.event("response.output_item.done", output_index=block.index, item=self.item(block, True))

    def event(self, kind: str, **fields: Any) -> bytes:
        self.sequence += 1
        return sse({"type": kind, "sequence_number": self.sequence - 1, **fields}, kind)

    def item_id(self, block: Block) -> str:
        return self.item_ids.setdefault(block.index, ITEM_PREFIX[block.kind] + uuid.uuid4().hex)

    def item(self, block: Block, done: bool) -> dict[str, Any]:
        status = "completed" if done else "in_progress"
        if done and self.turn.finish_reason == "length" and block is self.turn.blocks.blocks[-1]:
            status = "incomplete"  # (cut off by max_output_tokens: a call's arguments may lack what it requires)
        if block.kind == CALL:
            assert block.call is not None
            return {"id": self.item_id(block), "type": "function_call", "call_id": block.call.id,
                    "name": block.call.name, "arguments": block.text if done else "", "status": status}
        content = [self.part(block, block.text)] if done else []
        if block.kind == REASONING:
            return {"id": self.item_id(block), "type": "reasoning", "summary": [], "content": content,
                    "encrypted_content": None, "status": status}
        return {"id": self.item_id(block), "type": "message", "role": "assistant", "status": status, "content": content}

    def part(self, block: Block, text: str) -> dict[str, Any]:
        if block.kind == REASONING:
            return {"type": "reasoning_text", "text": text}
        return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}

    def usage(self) -> dict[str, Any]:
        prompt, cached, completion = self.turn.usage()
        tokenizer = self.api.service.engine.tokenizer
        # (counted from its text: the tokens of a text read again may differ from those that wrote it)
        reasoning = min(completion, sum(len(tokenizer.encode(b.text)) for b in self.turn.blocks.blocks
                                        if b.kind == REASONING))
        return {"input_tokens": prompt, "input_tokens_details": {"cached_tokens": cached},
                "output_tokens": completion, "output_tokens_details": {"reasoning_tokens": reasoning},
                "total_tokens": prompt + completion}

    def response(self, status: str, output: list[dict[str, Any]], usage: dict[str, Any] | None = None,
                 error: dict[str, Any] | None = None) -> dict[str, Any]:
        body = self.body
        reasoning = body.reasoning or ReasoningOptions()
        return {
            "id": self.id, "object": "response", "created_at": self.created_at, "status": status,
            "background": False, "error": error,
            "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
            "instructions": body.instructions, "max_output_tokens": body.max_output_tokens, "max_tool_calls": None,
            "metadata": body.metadata or {}, "model": self.api.service.name, "output": output,
            "parallel_tool_calls": body.parallel_tool_calls is not False,
            "previous_response_id": body.previous_response_id,
            "reasoning": {"effort": reasoning.effort, "summary": reasoning.summary}, "service_tier": "default",
            "store": body.store is not False,
            "temperature": 1.0 if body.temperature is None else body.temperature,
            "text": {"format": (body.text.format if body.text else None) or {"type": "text"}, "verbosity": "medium"},
            "tool_choice": body.tool_choice or "auto", "tools": body.tools or [],
            "top_p": 1.0 if body.top_p is None else body.top_p, "truncation": "disabled", "usage": usage,
            "user": body.user,
        }


def _part_type(block: Block) -> str:
    return "reasoning_text" if block.kind == REASONING else "output_text"
