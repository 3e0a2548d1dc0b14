"""Text <-> token ids with the checkpoint's `tokenizer.json` (the `tokenizers` library)."""

from __future__ import annotations

import functools
from pathlib import Path

from tokenizers import Tokenizer as _HFTokenizer
from tokenizers.decoders import ByteLevel

from shardspec.models.config import MAX_TOKENIZER_BYTES, ConfigError, read_bytes, read_json


class Tokenizer:
    def __init__(self, inner: _HFTokenizer, chat_template: str | None = None):
        self.inner = inner
        self.chat_template = chat_template

    @classmethod
    def from_folder(cls, folder: Path) -> Tokenizer | None:
        """The folder's tokenizer, or None when it has no tokenizer.json; ConfigError for one that
        is not a bounded regular file or that `tokenizers` cannot parse."""
        path = folder / "tokenizer.json"
        if not path.exists():
            return None
        data = read_bytes(path, MAX_TOKENIZER_BYTES)
        try:
            inner = _HFTokenizer.from_str(data.decode())
        except Exception as exc:  # not UTF-8, or any parse error (tokenizers raises a bare Exception)
            raise ConfigError(f"cannot read {path}: {exc}") from None
        return cls(inner, tokenizer_config(folder).get("chat_template"))

    def encode(self, text: str) -> list[int]:
        return self.inner.encode(text, add_special_tokens=False).ids

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        return self.inner.decode(ids, skip_special_tokens=skip_special_tokens)

    def token_bytes(self, token: int) -> bytes:
        """A token's own bytes, a piece of a UTF-8 character included (what OpenAI's logprobs carry
        as `bytes`): a byte-level BPE's token spelled back through its byte alphabet; otherwise, and
        for an added token, its text's UTF-8."""
        piece = self.inner.id_to_token(token)
        byte_level = isinstance(self.inner.decoder, ByteLevel) and token not in self._added_ids
        if piece is not None and byte_level and all(c in _BYTE_OF for c in piece):
            return bytes(_BYTE_OF[c] for c in piece)
        return self.decode([token]).encode()

    @functools.cached_property
    def _added_ids(self) -> frozenset[int]:
        return frozenset(self.inner.get_added_tokens_decoder())


def _byte_alphabet() -> dict[str, int]:
    """A byte-level BPE's characters -> the bytes they stand for (GPT-2's table: printable bytes as
    themselves, the rest from U+0100 on, in order)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars = {b: chr(b) for b in printable}
    for n, b in enumerate(b for b in range(256) if b not in chars):
        chars[b] = chr(256 + n)
    return {c: b for b, c in chars.items()}


_BYTE_OF = _byte_alphabet()


class Detokenizer:
    """Incremental decoding: emits text only once it is complete (no half UTF-8 characters), by
    default without the text of special tokens (an end-of-text token ends the text; it is not part
    of it)."""

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = True):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.ids: list[int] = []
        self.emitted = 0

    def add(self, ids: list[int], final: bool = False) -> str:
        self.ids += ids
        text = self.tokenizer.decode(self.ids, self.skip_special_tokens)
        if text.endswith("\ufffd") and not final:
            return ""
        new, self.emitted = text[self.emitted :], len(text)
        return new


def tokenizer_config(folder: Path) -> dict:
    """The folder's tokenizer_config.json ({} when it has none); ConfigError for a bad one."""
    path = folder / "tokenizer_config.json"
    if not path.exists():
        return {}
    config = read_json(path)
    if not isinstance(config, dict):
        raise ConfigError(f"{path} must hold a JSON object")
    return config
