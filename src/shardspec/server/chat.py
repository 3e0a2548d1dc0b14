"""Chat prompts rendered from the checkpoint's `chat_template` the way transformers renders them.

Same Jinja environment as `transformers`' `apply_chat_template`: a sandbox with trim_blocks,
lstrip_blocks and loop controls, `raise_exception`, a `tojson` that does not HTML-escape, and the
tokenizer's special tokens (`bos_token`, `eos_token`, ...) as variables.
"""

from __future__ import annotations

import functools
import json
import re
import secrets
from collections.abc import Collection, Iterator
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment

from shardspec.orchestrator.tokenizer import tokenizer_config

SPECIAL_TOKENS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")
# variables the server sets, which chat_template_kwargs cannot
RESERVED = frozenset({"messages", "tools", "documents", "add_generation_prompt", *SPECIAL_TOKENS})
# a conversation with one tool call, rendered to learn the template's format for calls
PROBE_TOOLS = [{"type": "function", "function": {"name": "probe_function", "parameters": {
    "type": "object", "properties": {"probe_key": {"type": "string"}}}}}]
PROBE_MESSAGES = [{"role": "user", "content": "probe"}, {"role": "assistant", "content": "", "tool_calls": [
    {"id": "call_probe", "type": "function", "function": {"name": "probe_function",
                                                          "arguments": {"probe_key": "probe_value"}}}]}]


@dataclass(frozen=True)
class ChatPrompt:
    """A request's rendered conversation. The added tokens' texts (<|im_start|>, <think>, ...) that came
    with the request stand as placeholders in `marked`, so that only the template's own text is split
    into those tokens: a message cannot forge a turn, a tool result or a call."""

    marked: str
    literals: dict[str, str]  # placeholder -> the added token's text it stands for

    def unmark(self, text: str) -> str:
        for placeholder, literal in self.literals.items():
            text = text.replace(placeholder, literal)
        return text

    def pieces(self, tokens: dict[str, int]) -> Iterator[str | int]:
        """The prompt split at the template's added tokens (`tokens`: text -> id; the leftmost, then
        the longest, as `tokenizers` splits): their ids, and the text between them as text."""
        pattern = re.compile("|".join(re.escape(t) for t in sorted(tokens, key=len, reverse=True)) or "(?!)")
        at = 0
        for match in pattern.finditer(self.marked):
            if match.start() > at:
                yield self.unmark(self.marked[at : match.start()])
            yield tokens[match.group()]
            at = match.end()
        if at < len(self.marked):
            yield self.unmark(self.marked[at:])


class _Marker:
    """Replaces the added tokens' texts in a request's strings with placeholders: ASCII that JSON and
    trim leave as it is, with a fresh nonce (no text holds one by chance)."""

    def __init__(self, tokens: Collection[str]):
        nonce = secrets.token_hex(8)
        self.placeholders = {t: f"[{nonce}:{i}]" for i, t in enumerate(sorted(tokens, key=len, reverse=True))}
        self.pattern = re.compile("|".join(map(re.escape, self.placeholders)) or "(?!)")
        self.used: dict[str, str] = {}

    def mark(self, value: Any) -> Any:
        if isinstance(value, str):
            return self.pattern.sub(self._placeholder, value)
        if isinstance(value, dict):
            return {key: self.mark(item) for key, item in value.items()}
        if isinstance(value, list):
            return [self.mark(item) for item in value]
        return value

    def _placeholder(self, match: re.Match) -> str:
        placeholder = self.placeholders[match.group()]
        self.used[placeholder] = match.group()
        return placeholder


class ChatTemplateError(ValueError):
    """The template refused the conversation (`raise_exception`) or could not render it."""


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None, separators: Any = None,
            sort_keys: bool = False) -> str:
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _environment() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env


def _token_text(value: Any) -> str | None:
    """A special token from tokenizer_config.json: a string or an AddedToken-style {"content": ...}."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


class ChatTemplate:
    def __init__(self, source: str, special_tokens: dict[str, str]):
        self.template = _environment().from_string(source)
        self.special_tokens = special_tokens

    @classmethod
    def from_folder(cls, folder: Path) -> ChatTemplate | None:
        """The folder's `tokenizer_config.json` chat template, or None when it has none."""
        config = tokenizer_config(folder)  # a bounded regular file, or {}
        source = config.get("chat_template")
        if isinstance(source, list):  # named templates: [{"name": "default", "template": ...}, ...]
            source = next((t.get("template") for t in source if t.get("name") == "default"), None)
        if not isinstance(source, str):
            return None
        tokens = {name: text for name in SPECIAL_TOKENS if (text := _token_text(config.get(name))) is not None}
        return cls(source, tokens)

    def render(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
               tools: list[dict[str, Any]] | None = None, kwargs: dict[str, Any] | None = None) -> str:
        """The prompt of a conversation; `kwargs` are the template's own variables (such as
        enable_thinking)."""
        try:
            return self.template.render(**(kwargs or {}), messages=messages, tools=tools or None, documents=None,
                                        add_generation_prompt=add_generation_prompt, **self.special_tokens)
        except jinja2.exceptions.TemplateError as exc:
            raise ChatTemplateError(f"the model's chat template rejected the messages: {exc}") from None
        except (TypeError, AttributeError, ValueError) as exc:  # a message shape the template cannot take
            raise ChatTemplateError(f"the model's chat template could not render the messages: {exc}") from None

    def render_request(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None,
                       kwargs: dict[str, Any] | None, tokens: Collection[str],
                       add_generation_prompt: bool = True) -> ChatPrompt:
        """The prompt of a request's conversation, a placeholder standing in for each added token's
        text (`tokens`) in the request's strings: the messages (an assistant's aside: the model's own
        words, calls and reasoning keep their tokens), the tools and the template's kwargs. As
        transformers' split_special_tokens treats special tokens, for every added token."""
        marker = _Marker(tokens)
        messages = [m if m.get("role") == "assistant" else marker.mark(m) for m in messages]
        marked = self.render(messages, add_generation_prompt, marker.mark(tools), marker.mark(kwargs))
        return ChatPrompt(marked, marker.used)

    @functools.cached_property
    def writes_tool_calls(self) -> bool:
        """Whether the template renders tools and calls in Qwen3.5's format (server.tools), the one
        whose calls the server parses."""
        try:
            text = self.render(PROBE_MESSAGES, add_generation_prompt=False, tools=PROBE_TOOLS)
        except ChatTemplateError:
            return False
        return "probe_function" in text.split("<tool_call>")[0] and \
            "<function=probe_function>\n<parameter=probe_key>\nprobe_value\n</parameter>" in text
