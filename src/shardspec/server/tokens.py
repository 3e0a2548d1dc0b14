"""POST /tokenize and /detokenize as vLLM has them, so that clients count a prompt against the
context: a prompt, or messages rendered by the chat template as chat completions renders them,
into {count, max_model_len, tokens}; token ids back into text. Tokenized as the generation routes
tokenize (in a thread, counted against the context as they come: a prompt beyond it is a 400).
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

from fastapi import Request
from pydantic import BaseModel, ConfigDict

from shardspec.server.api import ApiError, ChatBody, parse_body


class TokenizeBody(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")
    model: str | None = None
    prompt: str | None = None
    messages: list[Any] | None = None
    add_special_tokens: bool | None = None  # default: true for a prompt, false for messages (as vLLM)
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    return_token_strs: bool | None = False
    tools: list[Any] | None = None
    chat_template_kwargs: dict[str, Any] | None = None

    def unsupported(self) -> tuple[str, str] | None:
        checks = [
            ("prompt", (self.prompt is None) == (self.messages is None), "give a prompt or messages"),
            ("continue_final_message", self.continue_final_message, "continue_final_message is not supported"),
            ("add_special_tokens", bool(self.messages) and bool(self.add_special_tokens),
             "messages are tokenized without added special tokens: the chat template writes them"),
            ("tools", self.prompt is not None and self.tools is not None, "tools go with messages"),
            ("chat_template_kwargs", self.prompt is not None and self.chat_template_kwargs is not None,
             "chat_template_kwargs go with messages"),
        ]
        return next(((p, why) for p, bad, why in checks if bad), None)


class DetokenizeBody(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")
    model: str | None = None
    tokens: list[int]


class Tokenize:
    """The routes /tokenize and /detokenize over the server's Service."""

    def __init__(self, service: Any):
        self.service = service

    async def tokenize(self, request: Request) -> dict[str, Any]:
        body = parse_body(await request.body(), TokenizeBody)
        self.service.check_model(body.model)
        if (unsupported := body.unsupported()) is not None:
            raise ApiError(400, unsupported[1], unsupported[0])
        ids = await (self._prompt(body) if body.prompt is not None else self._messages(body))
        tokenizer = self.service.engine.tokenizer.inner
        strings = [tokenizer.id_to_token(i) for i in ids] if body.return_token_strs else None
        return {"count": len(ids), "max_model_len": self.service.context, "tokens": ids, "token_strs": strings}

    async def detokenize(self, request: Request) -> dict[str, Any]:
        body = parse_body(await request.body(), DetokenizeBody)
        self.service.check_model(body.model)
        tokenizer = self.service.engine.tokenizer
        if tokenizer is None:
            raise ApiError(400, "this model has no tokenizer.json", "tokens")
        vocabulary = tokenizer.inner.get_vocab_size(with_added_tokens=True)
        if (bad := next((t for t in body.tokens if not 0 <= t < vocabulary), None)) is not None:
            raise ApiError(400, f"token id {bad} is outside the vocabulary of {vocabulary} tokens", "tokens")
        return {"prompt": await asyncio.to_thread(tokenizer.decode, body.tokens)}

    async def _prompt(self, body: TokenizeBody) -> list[int]:
        assert body.prompt is not None
        ids = await self.service.encode(body.prompt, "prompt")  # (within the context, or a 400)
        if body.add_special_tokens is False:
            return ids
        tokenizer = self.service.engine.tokenizer.inner  # the tokenizer's own special tokens (a BOS) added
        return (await asyncio.to_thread(tokenizer.encode_batch, [body.prompt], add_special_tokens=True))[0].ids

    async def _messages(self, body: TokenizeBody) -> list[int]:
        fields = {"model": body.model, "messages": body.messages, "tools": body.tools,
                  "chat_template_kwargs": body.chat_template_kwargs}
        chat = parse_body(json.dumps({k: v for k, v in fields.items() if v is not None}).encode(), ChatBody)
        if (unsupported := chat.unsupported()) is not None:
            raise ApiError(400, unsupported[1], unsupported[0])
        _, prompt = await self.service.chat_prompt(chat, body.add_generation_prompt)
        return await self.service.encode(prompt, "messages", keep=False)  # (keeps nothing: no probe of others' texts)
