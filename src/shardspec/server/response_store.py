"""Responses kept for `previous_response_id` (and GET /v1/responses/{id}): in memory, bounded in count
and in bytes, the least recently used dropped first. Each holds its whole conversation (the items
of its input, earlier responses' included, and its output), so a follow-up needs only its own
entry; an entry is readable only by requests with the owner key of the one that made it.
"""

from __future__ import annotations

import hashlib
import json
import secrets
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

DEFAULT_MAX_RESPONSES = 1024
DEFAULT_MAX_BYTES = 64 << 20


@dataclass(frozen=True)
class StoredResponse:
    owner: str
    items: list[dict[str, Any]]  # the conversation: input items, then the response's output items
    response: dict[str, Any]  # the response object, as GET returns it
    size: int  # bytes of both as JSON


class ResponseStore:
    def __init__(self, max_responses: int = DEFAULT_MAX_RESPONSES, max_bytes: int = DEFAULT_MAX_BYTES):
        if max_responses < 1 or max_bytes < 1:
            raise ValueError(f"a response store holds at least one response and byte, got {max_responses}, "
                             f"{max_bytes}")
        self.max_responses = max_responses
        self.max_bytes = max_bytes
        self.entries: OrderedDict[str, StoredResponse] = OrderedDict()
        self.bytes = 0
        self.secret = secrets.token_bytes(32)

    def owner(self, authorization: str | None) -> str:
        """Who may read what a request stores: a keyed hash of its Authorization header (none: anyone
        without one)."""
        return hashlib.blake2b((authorization or "").encode(), key=self.secret, digest_size=16).hexdigest()

    def put(self, key: str, owner: str, items: list[dict[str, Any]], response: dict[str, Any]) -> bool:
        """Keep a response, dropping the least recently used ones beyond the bounds; False (nothing
        kept) for one larger than the whole store."""
        size = len(json.dumps(items, ensure_ascii=False)) + len(json.dumps(response, ensure_ascii=False))
        if size > self.max_bytes:
            return False
        self.delete(key)
        self.entries[key] = StoredResponse(owner, items, response, size)
        self.bytes += size
        while len(self.entries) > self.max_responses or self.bytes > self.max_bytes:
            self.bytes -= self.entries.popitem(last=False)[1].size
        return True

    def get(self, key: str, owner: str) -> StoredResponse | None:
        """The response (now the most recently used), or None when it is unknown, dropped or another's."""
        entry = self.entries.get(key)
        if entry is None or not secrets.compare_digest(entry.owner, owner):
            return None
        self.entries.move_to_end(key)
        return entry

    def delete(self, key: str) -> bool:
        entry = self.entries.pop(key, None)
        if entry is not None:
            self.bytes -= entry.size
        return entry is not None
