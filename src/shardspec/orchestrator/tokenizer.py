"""Text <-> token ids with the checkpoint's `tokenizer.json` (the `tokenizers` library)."""

from __future__ import annotations

from pathlib import Path

from tokenizers import Tokenizer as _HFTokenizer

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
