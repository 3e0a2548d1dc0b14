"""A request's text into token ids, counted against the context as they come (server.app runs these in a
thread): a prompt whole, a chat prompt piece by piece between the template's added tokens, with the
pieces' ids kept across requests (ChatEncoder).
"""

from __future__ import annotations

import json
import sys
import threading
from array import array
from collections import OrderedDict
from collections.abc import Sequence

from tokenizers import Tokenizer as HFTokenizer

from shardspec.orchestrator.tokenizer import Tokenizer
from shardspec.server.chat import ChatPrompt

PREFIX_MARGIN = 64  # tokens a cut text's prefix may have beyond the whole text's over the same words
KEPT_BYTES = 64 << 20  # the chat pieces kept, in Python objects: their texts, ids (4 bytes each) and entries
KEPT_SHARE = 8  # a piece of more than KEPT_BYTES / KEPT_SHARE is not kept (it would push out most others)
MIN_KEPT_CHARS = 256  # shorter pieces are tokenized each time (microseconds; an entry would cost more)
ENTRY_BYTES = 200  # an entry's tuple, dict slot and array header, about


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
    added token's text stay text: ChatPrompt's placeholders).

    So that a conversation's next turn, which renders every message before it again, tokenizes only
    what is new, the ids of pieces of MIN_KEPT_CHARS and more are kept per tenant (a request's cache
    salt: one tenant cannot time whether another sent a text), the least recently used dropped past
    KEPT_BYTES of Python objects: a system prompt of thousands of tokens is tokenized once, not for
    every request that sends it. Where the pieces' ids are not the whole text's (an added token that
    strips the spaces beside it, matches normalized text or whole words only, a pre-tokenizer that
    marks the first word: `piecewise` False), a prompt without a request's copies of added tokens is
    tokenized whole and nothing is kept. Safe to call from several threads."""

    def __init__(self, tokenizer: Tokenizer, kept_bytes: int = KEPT_BYTES):
        self.tokenizer = tokenizer
        self.text_only = _text_only(tokenizer)
        self.added = {token.content: i for i, token in tokenizer.inner.get_added_tokens_decoder().items()}
        self.piecewise = self._splits_as_the_whole()
        self.kept_bytes = kept_bytes
        self.kept: OrderedDict[tuple[str | None, str], array] = OrderedDict()  # (tenant, a piece's text) -> its ids
        self.holds = 0  # bytes in `kept`, as _size counts them
        self.lock = threading.Lock()

    def encode(self, prompt: ChatPrompt, limit: int, tenant: str | None = None, keep: bool = True) -> list[int] | None:
        """The prompt's ids, or None once there are more than `limit`; `keep`: read and keep pieces
        of `tenant` (else tokenize every piece, keeping none)."""
        if not self.piecewise and not prompt.literals:
            return encode_within(self.tokenizer, prompt.marked, limit)
        pieces = list(prompt.pieces(self.added))
        keep = keep and self.piecewise and any(isinstance(p, int) for p in pieces)  # (one piece: nothing to share)
        ids: list[int] = []
        for piece in pieces:
            if isinstance(piece, int):
                part: list[int] | None = [piece]
            elif keep and len(piece) >= MIN_KEPT_CHARS:
                part = self._kept(tenant, piece, limit - len(ids))
            else:
                part = encode_within(self.text_only, piece, limit - len(ids))
            if part is None or len(ids) + len(part) > limit:
                return None
            ids += part
        return ids

    def _kept(self, tenant: str | None, text: str, limit: int) -> list[int] | None:
        key = (tenant, text)
        with self.lock:
            kept = self.kept.get(key)
            if kept is not None:
                self.kept.move_to_end(key)
        if kept is not None:
            return kept.tolist() if len(kept) <= limit else None
        ids = encode_within(self.text_only, text, limit)
        if ids is not None and _size(text, ids) <= self.kept_bytes // KEPT_SHARE:
            with self.lock:
                if key not in self.kept:
                    self.kept[key] = array("I", ids)
                    self.holds += _size(text, ids)
                while self.holds > self.kept_bytes:
                    (_, old), old_ids = self.kept.popitem(last=False)
                    self.holds -= _size(old, old_ids)
        return ids

    def _splits_as_the_whole(self) -> bool:
        """Whether a text's ids are those of its pieces between the added tokens, on a probe of each
        added token between words, spaces and newlines (the flags and pre-tokenizers that break it
        show there)."""
        if not self.added:
            return True
        probe = "Hi" + "".join(f" a {t} b\n{t}\n\n c{t}d  {t}" for t in self.added) + " end"
        pieces = ChatPrompt(probe, {}).pieces(self.added)
        split = [i for p in pieces for i in ([p] if isinstance(p, int) else encode_without_the_gil(self.text_only, p))]
        return split == encode_without_the_gil(self.tokenizer, probe)


def _size(text: str, ids: Sequence[int]) -> int:
    """The Python memory an entry holds: its text, its ids and the entry (key tuple, dict slot)."""
    return sys.getsizeof(text) + 4 * len(ids) + ENTRY_BYTES


def _text_only(tokenizer: Tokenizer) -> Tokenizer:
    """The tokenizer without its added tokens: their texts are tokenized as any text."""
    config = json.loads(tokenizer.inner.to_str())
    config["added_tokens"] = []
    return Tokenizer(HFTokenizer.from_str(json.dumps(config)))
