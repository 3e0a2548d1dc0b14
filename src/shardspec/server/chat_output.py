"""A chat completion's text split into what OpenAI's API returns apart: the reasoning (between
`<think>` and `</think>`), the content, and the tool calls (`<tool_call>` blocks, server.tools).

The split runs on the text as it streams, holding back only what may still be the start of a
marker, so that the streamed deltas concatenate to the fields of the whole response, for every way
the text is cut into pieces (an MTP step's tokens straddling `</think>` included).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from shardspec.server.tools import CALL_CLOSE, CALL_OPEN, CallParser, Tool, ToolCall

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"


@dataclass
class Delta:
    """What a piece of text added: reasoning, content, and OpenAI tool-call delta entries."""

    reasoning: str = ""
    content: str = ""
    tool_calls: list[dict[str, Any]] = field(default_factory=list)

    def __iadd__(self, other: Delta) -> Delta:
        self.reasoning += other.reasoning
        self.content += other.content
        for entry in other.tool_calls:
            self._add_call(entry)
        return self

    def _add_call(self, entry: dict[str, Any]) -> None:
        last = self.tool_calls[-1] if self.tool_calls else None
        if last is not None and last["index"] == entry["index"] and set(entry) == {"index", "function"}:
            last["function"]["arguments"] += entry["function"]["arguments"]  # one entry per call and delta
        else:
            self.tool_calls.append(entry)


class Trimmed:
    """Streamed text less its leading and trailing whitespace: trailing whitespace is held back
    until text follows it."""

    def __init__(self) -> None:
        self.started = False
        self.held = ""

    def feed(self, text: str) -> str:
        if not self.started:
            text = text.lstrip()
            if not text:
                return ""
            self.started = True
        text = self.held + text
        body = text.rstrip()
        self.held = text[len(body) :]
        return body


class ChatOutput:
    """The split of one choice's text. `reasoning`: the prompt leaves the model inside `<think>`;
    `thinks`: the model may open one itself at the start; `tools`: parse `<tool_call>` blocks of
    these functions (None: they are content; a block of another function is text where it stands);
    `parallel`: more than one call (else a block after the first call is text)."""

    def __init__(self, reasoning: bool = False, thinks: bool = False, tools: list[Tool] | None = None,
                 parallel: bool = True):
        self.mode = "reasoning" if reasoning else "content"
        self.thinks = thinks and not reasoning
        self.tools = tools
        self.parallel = parallel
        self.pending = ""
        self.reasoning, self.content = Trimmed(), Trimmed()
        self.calls: list[ToolCall] = []
        self.parser: CallParser | None = None
        self.after_call = "content"  # the mode a call's end returns to

    def feed(self, text: str) -> Delta:
        self.pending += text
        out = Delta()
        while self.pending and self._step(out):
            pass
        return out

    def whole(self, text: str) -> Delta:
        """The split of a whole text at once."""
        delta = self.feed(text)
        delta += self.finish()
        return delta

    def finish(self) -> Delta:
        """The rest, at the end of the text: a marker's start held back is text after all, and an
        unfinished call is closed with what it had."""
        out = Delta()
        rest, self.pending = self.pending, ""
        if self.mode == "reasoning":
            out.reasoning += self.reasoning.feed(rest)
        elif self.mode == "call":
            self._call_text(rest, out)  # (a held-back "</tool_call" has no ">" to end a function's tag)
            self._end_call(out)
        else:
            out.content += self.content.feed(rest)
        return out

    # --- one marker at a time -----------------------------------------------------------------

    def _markers(self) -> dict[str, str]:
        """The markers that end the current mode, each with the mode it starts. A call may come in
        the reasoning too (a model may call before it closes its think): it is a call all the same."""
        if self.mode == "call":
            return {CALL_CLOSE: self.after_call}
        calls = self.tools is not None and (self.parallel or not self.calls)
        markers = {CALL_OPEN: "call"} if calls else {}
        if self.mode == "reasoning":
            markers[THINK_CLOSE] = "content"
        elif self._may_think():
            markers[THINK_OPEN] = "reasoning"
        return markers

    def _step(self, out: Delta) -> bool:
        """Consume pending text up to and through the next marker (True), or all that cannot be the
        start of one (False)."""
        markers = self._markers()
        found = [(i, m) for m in markers if (i := self.pending.find(m)) >= 0]
        keep = max((partial_match(self.pending, m) for m in markers), default=0)
        at, marker = min(found) if found else (len(self.pending) - keep, "")
        rest = self._emit(self.mode, self.pending[:at], out)
        if rest is not None:  # not a call after all: the rest of its block is read again as text
            self.pending = rest + self.pending[at:]
            return True
        self.pending = self.pending[at + len(marker) :]
        if not marker:
            return False
        if self.mode == "call":
            self._end_call(out)
        elif markers[marker] == "call":
            self.after_call, self.parser = self.mode, CallParser(self.tools or [])
        self.mode, self.thinks = markers[marker], False
        return True

    def _may_think(self) -> bool:
        """A `<think>` opens reasoning only before any content: where the text so far (less leading
        whitespace) is `<think>` or the start of it."""
        head = self.pending.lstrip()[: len(THINK_OPEN)]
        if self.thinks and (self.content.started or not THINK_OPEN.startswith(head)):
            self.thinks = False
        return self.thinks

    def _emit(self, mode: str, text: str, out: Delta) -> str | None:
        """Emit `text` in `mode`; a call's text may turn out not to be one: then the text to read again."""
        if mode == "reasoning":
            out.reasoning += self.reasoning.feed(text)
        elif mode == "content":
            out.content += self.content.feed(text)
        else:
            return self._call_text(text, out)
        return None

    def _call_text(self, text: str, out: Delta) -> str | None:
        parser = self.parser
        assert parser is not None
        named = parser.call is not None
        pieces = list(parser.feed(text))
        if parser.undeclared is not None:  # text up to the function's tag where the block began, the rest again
            self.mode, self.parser = self.after_call, None
            self._emit(self.mode, CALL_OPEN + parser.text[: parser.undeclared], out)
            return parser.text[parser.undeclared :]
        if parser.call is not None and not named:
            self.calls.append(parser.call)
            out.tool_calls.append({"index": len(self.calls) - 1, "id": parser.call.id, "type": "function",
                                   "function": {"name": parser.call.name, "arguments": ""}})
        for piece in pieces:
            out._add_call({"index": len(self.calls) - 1, "function": {"arguments": piece}})
        return None

    def _end_call(self, out: Delta) -> None:
        parser, self.parser = self.parser, None
        assert parser is not None
        if parser.call is None:  # no function named: the block's text stays where it was, nothing lost
            self._emit(self.after_call, CALL_OPEN + parser.text, out)
            return
        if closing := parser.close():
            out._add_call({"index": len(self.calls) - 1, "function": {"arguments": closing}})


def partial_match(text: str, marker: str) -> int:
    """The length of the longest end of `text` that is a proper start of `marker` (0 if none)."""
    i = text.find(marker[0], max(0, len(text) - len(marker) + 1))
    while i >= 0:
        if marker.startswith(text[i:]):
            return len(text) - i
        i = text.find(marker[0], i + 1)
    return 0
