"""A request's text into token ids, counted against the context as they come (server.app runs these in a
thread): a prompt whole, a chat prompt piece by piece between the template's added tokens, with the
pieces' ids kept across requests (ChatEncoder).
"""

from __future__ import annotations

import json
import threading
from array import array
from collections import OrderedDict
from collections.abc import Sequence

from tokenizers import Tokenizer as HFTokenizer

from shardspec.orchestrator.tokenizer import Tokenizer
from shardspec.server.chat import ChatPrompt

PREFIX_MARGIN = 64  # tokens a cut text's prefix may have beyond the whole text's over the same words
KEPT_BYTES = 16 << 20  # the chat pieces kept: their texts (a byte a character, as counted) and ids (4 bytes each)
KEPT_SHARE = 8  # a piece of more than KEPT_BYTES / KEPT_SHARE is not kept (it would push out most others)


def encode_without_the_gil(tokenizer: Tokenizer, text: str) -> list[int]:
    """`tokenizer.encode(text)`; the `tokenizers` library holds the GIL through `encode` (the event loop
    would stall for the whole prompt even with it in a thread), but releases it in `encode_batch`."""
    return tokenizer.inner.encode_batch([text], add_special_tokens=False)[0].ids


def encode_within(tokenizer: Tokenizer, text: str, limit: int) -> list[int] | None:
    """The token ids of `text`, or None once there are more than `limit`. A text longer than a few
    times `limit` is counted on growing prefixes (each twice the last, cut before a space, where a
    pre-tokenizer splits anyway): one far past the context costs the tokens of a few contexts, not
    its own (a 4 MiB prompt is 2.4M tokens, seconds and a gigabyte)."""
    size = 4 * (limit + 1)
    while len(text) > size:
        cut = text.rfind(" ", size // 2, size)
        if len(encode_without_the_gil(tokenizer, text[: cut if cut > 0 else size])) > limit + PREFIX_MARGIN:
            return None  # (the tokens of the prefix's last words may differ from the whole text's: a margin)
        size *= 2
    ids = encode_without_the_gil(tokenizer, text)
    return ids if len(ids) <= limit else None


class ChatEncoder:
    """A chat prompt's ids: split at the template's added tokens (<|im_start|>, <think>, ...), as
    `tokenizers` splits a text, the text between them tokenized as text (a request's own copies of an
    added token's text stay text: ChatPrompt's placeholders). So that a conversation's next turn, which
    renders every message before it again, tokenizes only what is new, the pieces' ids are kept, the
    least recently used dropped past KEPT_BYTES (a piece's text and ids: a text of many characters and
    few tokens counts its characters): a system prompt of thousands of tokens is tokenized once, not
    for every request that sends it. Safe to call from several threads."""

    def __init__(self, tokenizer: Tokenizer, kept_bytes: int = KEPT_BYTES):
        self.text_only = _text_only(tokenizer)
        self.added = {token.content: i for i, token in tokenizer.inner.get_added_tokens_decoder().items()}
        self.kept_bytes = kept_bytes
        self.kept: OrderedDict[str, array] = OrderedDict()  # a piece's text -> its ids
        self.holds = 0  # bytes in `kept`, as _size counts them
        self.lock = threading.Lock()

    def encode(self, prompt: ChatPrompt, limit: int) -> list[int] | None:
        """The prompt's ids, or None once there are more than `limit`."""
        ids: list[int] = []
        for piece in prompt.pieces(self.added):
            part = [piece] if isinstance(piece, int) else self._text(piece, limit - len(ids))
            if part is None or len(ids) + len(part) > limit:
                return None
            ids += part
        return ids

    def _text(self, text: str, limit: int) -> list[int] | None:
        with self.lock:
            kept = self.kept.get(text)
            if kept is not None:
                self.kept.move_to_end(text)
        if kept is not None:
            return kept.tolist() if len(kept) <= limit else None
        ids = encode_within(self.text_only, text, limit)
        if ids is not None and _size(text, ids) <= self.kept_bytes // KEPT_SHARE:
            with self.lock:
                if text not in self.kept:
                    self.kept[text] = array("I", ids)
                    self.holds += _size(text, ids)
                while self.holds > self.kept_bytes:
                    self.holds -= _size(*self.kept.popitem(last=False))
        return ids


def _size(text: str, ids: Sequence[int]) -> int:
    return len(text) + 4 * len(ids)


def _text_only(tokenizer: Tokenizer) -> Tokenizer:
    """The tokenizer without its added tokens: their texts are tokenized as any text."""
    config = json.loads(tokenizer.inner.to_str())
    config["added_tokens"] = []
    return Tokenizer(HFTokenizer.from_str(json.dumps(config)))
