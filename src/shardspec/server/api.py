"""The OpenAI API's shapes: request bodies (validated with pydantic), responses, chunks and errors."""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Callable
from typing import Any, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from shardspec.orchestrator.prefix import MAX_CACHE_SALT
from shardspec.orchestrator.requests import TokenLogprob
from shardspec.protocol.messages import MAX_LOGPROBS
from shardspec.server.chat import RESERVED

MAX_STOP_STRINGS = 4  # as OpenAI's API
MAX_STOP_CHARS = 1024  # each; the text held back while a stop may still be matching is shorter
MAX_CHAT_MESSAGES = 2048
Body = TypeVar("Body", bound=BaseModel)



class ApiError(Exception):
    """An error the client gets as {"error": {message, type, param, code}} with `status`."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 kind: str | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.kind = kind or ("invalid_request_error" if status < 500 else "server_error")

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}


class StreamOptions(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")
    include_usage: bool = False


class GenerationBody(BaseModel):
    """The fields both endpoints share. A field this server does not know is refused (400 naming it),
    as OpenAI's own server refuses one; a known feature it lacks is refused when it is asked for
    (`unsupported`): nothing in a body is silently ignored."""

    model_config = ConfigDict(strict=True, extra="forbid")
    model: str | None = None
    max_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: int | None = Field(None, ge=0)  # not OpenAI's; vLLM and others take it
    seed: int | None = Field(None, ge=0, lt=2**63)
    n: int | None = None
    stop: str | list[str] | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool | None = False  # not OpenAI's: generate max_tokens tokens (benchmarks)
    user: str | None = None  # the caller's id for its end user: accepted, it changes nothing here
    presence_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    repetition_penalty: float | None = Field(None, ge=0.01, le=100.0)  # not OpenAI's; vLLM's (below 0.01: overflow)
    logit_bias: dict[str, Any] | None = None  # token id (as a string) -> bias in [-100, 100]
    min_tokens: int | None = Field(None, ge=0)  # not OpenAI's; vLLM's: no stop before this many tokens
    response_format: dict[str, Any] | None = None
    structured_outputs: dict[str, Any] | None = None  # not OpenAI's; vLLM's: json, json_object, regex, choice, grammar
    # not OpenAI's; vLLM's: more token ids that end the output, the text of special tokens, the stop string
    stop_token_ids: list[int] | None = None
    skip_special_tokens: bool | None = True
    include_stop_str_in_output: bool | None = False
    # not OpenAI's; vLLM's: the prefix cache is shared only with requests of the same salt (serve --cache-salt)
    cache_salt: str | None = Field(None, min_length=1, max_length=MAX_CACHE_SALT)

    def unsupported(self) -> tuple[str, str] | None:
        """(param, why) for a feature this server does not have, asked for with a non-default value, or
        a value beyond its limits."""
        checks = [
            ("n", self.n is not None and self.n < 1, "n must be at least 1"),
            ("stream_options", self.stream_options is not None and not self.stream,
             "stream_options is only allowed with stream: true"),
            ("response_format", self.response_format is not None and self.response_format.get("type") not in
             ("text", "json_object", "json_schema"), 'response_format type is one of "text", "json_object", '
             '"json_schema"'),
            ("response_format", bool(self.structured_outputs) and self.response_format not in (None, {"type": "text"}),
             "give response_format or structured_outputs, not both"),
            ("stop", isinstance(self.stop, list) and len(self.stop) > MAX_STOP_STRINGS,
             f"at most {MAX_STOP_STRINGS} stop sequences"),
            ("stop", any(len(stop) > MAX_STOP_CHARS for stop in self.stop_strings()),
             f"a stop sequence has at most {MAX_STOP_CHARS} characters"),
        ]
        return next(((param, why) for param, bad, why in checks if bad), None)

    def structured_output(self) -> dict[str, Any] | None:
        """The output constraint asked for (Engine.generate's structured_output), or None."""
        if self.structured_outputs:
            return self.structured_outputs
        kind = (self.response_format or {}).get("type")
        if kind == "json_object":
            return {"json_object": True}
        if kind == "json_schema":
            spec = self.response_format.get("json_schema")
            schema = spec.get("schema") if isinstance(spec, dict) else None
            if schema is None:
                raise ApiError(400, 'response_format {"type": "json_schema"} needs json_schema.schema',
                               "response_format")
            return {"json": schema}
        return None

    def token_biases(self) -> dict[int, float]:
        """logit_bias with integer token ids; 400 naming an entry that is not {"id": number}."""
        biases = {}
        for key, value in (self.logit_bias or {}).items():
            token = key.strip()  # ASCII digits alone: int() reads "٣" too, and "²".isdigit() is true
            if not (token.isascii() and token.isdecimal() and len(token) <= 18) or type(value) not in (int, float):
                raise ApiError(400, f"logit_bias maps token ids to numbers in [-100, 100]; got {key!r:.40}: "
                               f"{value!r:.40}", "logit_bias")
            biases[int(token)] = float(value)
        return biases

    def stop_strings(self) -> list[str]:
        stops = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        return [s for s in stops if s]


class CompletionBody(GenerationBody):
    prompt: str | list[int] | list[str] | list[list[int]]
    max_tokens: int | None = Field(None, ge=0)  # 0 only with echo: the prompt's log-probabilities alone
    echo: bool | None = False
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    best_of: int | None = None
    suffix: str | None = None

    def unsupported(self) -> tuple[str, str] | None:
        checks = [
            ("max_tokens", self.max_tokens == 0 and not self.echo, "max_tokens must be at least 1 (0 only with echo)"),
            ("best_of", self.best_of not in (None, 1), "only best_of=1 is supported"),
            ("suffix", bool(self.suffix), "suffix is not supported"),
        ]
        return next(((p, why) for p, bad, why in checks if bad), None) or super().unsupported()

    def prompts(self) -> list[str | list[int]]:
        """The prompts: one text or token-id list, or a list of those."""
        prompt = self.prompt
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
            return list(prompt)
        return [prompt]


class ChatMessage(BaseModel):
    model_config = ConfigDict(strict=True, extra="allow")  # e.g. `name`, `tool_call_id`: passed on to the template
    # (a template drops a role it does not know without a word; "developer" is OpenAI's newer "system")
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[dict[str, Any]] | None = None
    tool_calls: list[dict[str, Any]] | None = None  # an assistant's calls, as the API returned them
    reasoning_content: str | None = None

    def for_template(self, index: int) -> dict[str, Any]:
        message = self.model_dump(exclude_none=True)
        message["content"] = _text_content(self.content, index)
        if self.role == "developer":
            message["role"] = "system"
        if self.tool_calls:
            message["tool_calls"] = [_call_for_template(call, f"messages[{index}].tool_calls[{j}]")
                                     for j, call in enumerate(self.tool_calls)]
        return message


def _call_for_template(call: dict[str, Any], param: str) -> dict[str, Any]:
    """An assistant's tool call with its arguments as an object, which templates iterate (the API
    carries them as a JSON string)."""
    function = call.get("function")
    if not isinstance(function, dict) or not isinstance(function.get("name"), str):
        raise ApiError(400, 'a tool call is {"id": ..., "type": "function", "function": {"name": ..., "arguments": '
                       '"{...}"}}', param)
    arguments = function.get("arguments", "{}")
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments or "{}")
        except json.JSONDecodeError as exc:
            raise ApiError(400, f"a tool call's arguments are not JSON: {exc}", f"{param}.function.arguments") from None
    if not isinstance(arguments, dict):
        raise ApiError(400, "a tool call's arguments are a JSON object", f"{param}.function.arguments")
    return {**call, "function": {**function, "arguments": arguments}}


class ChatBody(GenerationBody):
    messages: list[ChatMessage] = Field(min_length=1, max_length=MAX_CHAT_MESSAGES)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool | None = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    tools: list[Any] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None  # only means something with tools; default true
    chat_template_kwargs: dict[str, Any] | None = None  # not OpenAI's; vLLM's: e.g. {"enable_thinking": false}
    functions: list[Any] | None = None  # the deprecated form of tools
    function_call: str | dict[str, Any] | None = None
    modalities: list[str] | None = None
    audio: dict[str, Any] | None = None
    prediction: dict[str, Any] | None = None
    reasoning_effort: str | None = None
    web_search_options: dict[str, Any] | None = None
    store: bool | None = None
    metadata: dict[str, Any] | None = None
    service_tier: str | None = None

    def unsupported(self) -> tuple[str, str] | None:
        checks = [
            ("top_logprobs", self.top_logprobs is not None and not self.logprobs,
             "top_logprobs needs logprobs: true"),
            ("chat_template_kwargs", bool(RESERVED & set(self.chat_template_kwargs or ())),
             f"chat_template_kwargs cannot set {sorted(RESERVED & set(self.chat_template_kwargs or ()))}"),
            ("functions", bool(self.functions), "function calls are not supported"),
            ("function_call", self.function_call not in (None, "none", "auto"), "function calls are not supported"),
            ("modalities", self.modalities not in (None, ["text"]), 'only modalities ["text"] is supported'),
            ("audio", self.audio is not None, "audio output is not supported"),
            ("prediction", self.prediction is not None, "predicted outputs are not supported"),
            ("reasoning_effort", self.reasoning_effort is not None, "reasoning_effort is not supported"),
            ("web_search_options", self.web_search_options is not None, "web search is not supported"),
            ("store", bool(self.store), "stored completions are not supported"),
            ("metadata", bool(self.metadata), "metadata is for stored completions, which are not supported"),
            ("service_tier", self.service_tier not in (None, "auto", "default"), "service tiers are not supported"),
        ]
        return next(((p, why) for p, bad, why in checks if bad), None) or super().unsupported()


def _text_content(content: str | list[dict[str, Any]] | None, index: int) -> str:
    """A message's text: a string, or text parts ([{"type": "text", "text": ...}]) joined."""
    if content is None or isinstance(content, str):
        return content or ""
    texts = []
    for part in content:
        if part.get("type") != "text" or not isinstance(part.get("text"), str):
            raise ApiError(400, "only text content parts ({\"type\": \"text\", \"text\": ...}) are supported",
                           f"messages[{index}].content")
        texts.append(part["text"])
    return "\n".join(texts)


def parse_body(raw: bytes, model: type[Body]) -> Body:
    """The validated body, or an ApiError 400 naming the offending field."""
    try:
        return model.model_validate_json(raw)
    except ValidationError as exc:
        raise _validation_error(exc) from None


def _validation_error(exc: ValidationError) -> ApiError:
    error = exc.errors(include_url=False)[0]
    if error["type"] == "json_invalid":
        return ApiError(400, f"the request body is not valid JSON: {error['ctx'].get('error', '')}".rstrip(": "))
    if not error["loc"]:
        return ApiError(400, f"the request body must be a JSON object: {error['msg']}")
    path = [str(part) for part in error["loc"] if not _is_union_tag(part)]
    param = ".".join(path)
    if error["type"] == "extra_forbidden":
        return ApiError(400, f"{param} is not a parameter this server accepts (the accepted ones are listed in "
                        "docs/architecture.md, 'Serving')", param)
    if path[0] == "prompt":
        return ApiError(400, "prompt must be a string, a list of token ids, or a list of either",
                        "prompt")
    return ApiError(400, f"{param}: {error['msg']}", param)


def _is_union_tag(part: Any) -> bool:
    """pydantic names the union member that failed in the error location ('list[int]'): not a field."""
    return isinstance(part, str) and ("[" in part or part in ("str", "int", "float", "bool"))


# --- responses ----------------------------------------------------------------------------------


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> dict[str, Any]:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached_tokens}}


LOGPROB_FLOOR = -9999.0  # for a log-probability of -inf (JSON has no infinity), as vLLM clamps it


def _logprob(value: float) -> float:
    return max(value, LOGPROB_FLOOR)


class Shape:
    """The response and chunk shapes of one endpoint (text completions here; chat below), and its
    log-probability objects, whose tokens `token_text` spells."""

    object = "text_completion"
    chunk_object = "text_completion"
    id_prefix = "cmpl-"

    def __init__(self, model: str, token_text: Any = None):
        self.model = model
        self.id = self.id_prefix + uuid.uuid4().hex
        self.created = int(time.time())
        self.token_text = token_text
        self.text_offset: dict[int, int] = {}  # per choice: where its next token's text starts

    def envelope(self, obj: str, choices: list[dict[str, Any]]) -> dict[str, Any]:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model,
                "system_fingerprint": None, "choices": choices}

    def choice(self, index: int, text: str, finish_reason: str | None, logprobs: Any = None) -> dict[str, Any]:
        return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}

    def delta(self, index: int, text: str, finish_reason: str | None, first: bool, logprobs: Any = None) -> dict:
        return self.choice(index, text, finish_reason, logprobs)

    def response(self, choices: list[dict[str, Any]], use: dict[str, int]) -> dict[str, Any]:
        return self.envelope(self.object, choices) | {"usage": use}

    def chunk(self, index: int, text: str, finish_reason: str | None, first: bool, logprobs: Any = None) -> dict:
        return self.envelope(self.chunk_object, [self.delta(index, text, finish_reason, first, logprobs)])

    def usage_chunk(self, use: dict[str, int]) -> dict[str, Any]:
        return self.envelope(self.chunk_object, []) | {"usage": use}

    def logprobs(self, index: int, entries: list[TokenLogprob] | None) -> dict[str, Any] | None:
        """The legacy completions object: tokens, token_logprobs, top_logprobs (token -> logprob, the
        chosen token among them, as vLLM has it), text_offset; an echoed prompt's first token has None."""
        if entries is None:
            return None
        tokens = [self.token_text(e.token) for e in entries]
        offsets = []
        for token in tokens:
            offsets.append(self.text_offset.get(index, 0))
            self.text_offset[index] = offsets[-1] + len(token)
        tops = [None if e.logprob is None else
                {self.token_text(t): _logprob(v) for t, v in e.top} | {token: _logprob(e.logprob)}
                for e, token in zip(entries, tokens)]
        chosen = [None if e.logprob is None else _logprob(e.logprob) for e in entries]
        return {"tokens": tokens, "token_logprobs": chosen, "top_logprobs": tops, "text_offset": offsets}


class ChatShape(Shape):
    """Chat responses: each choice's text split into reasoning, content and tool calls by an
    `output()` (server.chat_output), as a whole or as it streams."""

    object = "chat.completion"
    chunk_object = "chat.completion.chunk"
    id_prefix = "chatcmpl-"

    def __init__(self, model: str, output: Callable[[], Any], token_text: Any = None, reasons: bool = False,
                 token_bytes: Callable[[int], bytes] | None = None):
        """`output` makes a choice's server.chat_output.ChatOutput (which needs this module's errors);
        `token_bytes` a token's own bytes (Tokenizer.token_bytes; default: its text's UTF-8)."""
        super().__init__(model, token_text)
        self.token_bytes = token_bytes
        self.output = output
        self.reasons = reasons  # the model may reason: messages carry reasoning_content
        self.streams: dict[int, Any] = {}  # a choice index -> its streaming split

    def choice(self, index: int, text: str, finish_reason: str | None, logprobs: Any = None) -> dict[str, Any]:
        output = self.output()
        split = output.whole(text)
        message: dict[str, Any] = {"role": "assistant", "content": split.content or (None if output.calls else "")}
        if self.reasons:
            message["reasoning_content"] = split.reasoning or None
        if output.calls:
            message["tool_calls"] = [call.openai() for call in output.calls]
        return {"index": index, "message": message, "logprobs": logprobs,
                "finish_reason": _finish(finish_reason, output)}

    def delta(self, index: int, text: str, finish_reason: str | None, first: bool, logprobs: Any = None) -> dict:
        output = self.streams.setdefault(index, self.output())
        split = output.feed(text)
        if finish_reason is not None:
            split += output.finish()
        delta: dict[str, Any] = {"role": "assistant"} if first else {}
        if split.reasoning:
            delta["reasoning_content"] = split.reasoning
        if split.content or first:
            delta["content"] = split.content
        if split.tool_calls:
            delta["tool_calls"] = split.tool_calls
        return {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": _finish(finish_reason, output)}

    def logprobs(self, index: int, entries: list[TokenLogprob] | None) -> dict[str, Any] | None:
        """{"content": [{token, logprob, bytes, top_logprobs: [{token, logprob, bytes}]}]}."""
        if entries is None:
            return None
        return {"content": [self._scored(e.token, e.logprob) | {"top_logprobs": [self._scored(t, v) for t, v in e.top]}
                            for e in entries], "refusal": None}

    def _scored(self, token: int, logprob: float) -> dict[str, Any]:
        text = self.token_text(token)
        raw = self.token_bytes(token) if self.token_bytes is not None else text.encode()
        return {"token": text, "logprob": _logprob(logprob), "bytes": list(raw)}


def _finish(reason: str | None, output: Any) -> str | None:
    """A choice that ends where the model stopped after calling tools finishes with "tool_calls"."""
    return "tool_calls" if reason == "stop" and output.calls else reason
