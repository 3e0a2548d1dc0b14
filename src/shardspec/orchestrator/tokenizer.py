"""Text <-> token ids with the checkpoint's `tokenizer.json` (the `tokenizers` library)."""

from __future__ import annotations

import json
from pathlib import Path

from tokenizers import Tokenizer as _HFTokenizer


class Tokenizer:
    def __init__(self, inner: _HFTokenizer, chat_template: str | None = None):
        self.inner = inner
        self.chat_template = chat_template

    @classmethod
    def from_folder(cls, folder: Path) -> Tokenizer | None:
        """The folder's tokenizer, or None when it has no tokenizer.json."""
        path = folder / "tokenizer.json"
        if not path.is_file():
            return None
        template = None
        config = folder / "tokenizer_config.json"
        if config.is_file():
            template = json.loads(config.read_text()).get("chat_template")
        return cls(_HFTokenizer.from_file(str(path)), template)

    def encode(self, text: str) -> list[int]:
        return self.inner.encode(text, add_special_tokens=False).ids

    def decode(self, ids: list[int]) -> str:
        return self.inner.decode(ids, skip_special_tokens=False)


class Detokenizer:
    """Incremental decoding: emits text only once it is complete (no half UTF-8 characters)."""

    def __init__(self, tokenizer: Tokenizer):
        self.tokenizer = tokenizer
        self.ids: list[int] = []
        self.emitted = 0

    def add(self, ids: list[int], final: bool = False) -> str:
        self.ids += ids
        text = self.tokenizer.decode(self.ids)
        if text.endswith("\ufffd") and not final:
            return ""
        new, self.emitted = text[self.emitted :], len(text)
        return new
