"""HTTP plumbing of a response: server-sent events, and a client's disconnect noticed while its
response is being generated."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Awaitable
from typing import Any, TypeVar

from fastapi import Request
from fastapi.responses import StreamingResponse

T = TypeVar("T")


class ClientGone(Exception):
    """The HTTP client disconnected before its response was ready."""


class EventStream(StreamingResponse):
    """Server-sent events whose source is closed however the response ends (a disconnect included),
    so that the engine frees the sequence at once, not whenever the generator is collected."""

    def __init__(self, events: AsyncIterator[bytes]):
        super().__init__(events, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self.events = events

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self.events.aclose()  # type: ignore[attr-defined]


def sse(data: dict[str, Any] | str, event: str | None = None) -> bytes:
    """One server-sent event; `event` names its type (as the Responses and Messages APIs do)."""
    head = f"event: {event}\n" if event else ""
    return f"{head}data: {data if isinstance(data, str) else json.dumps(data, ensure_ascii=False)}\n\n".encode()


async def until_disconnected(request: Request, work: Awaitable[T]) -> T:
    """Await `work`; if the client disconnects first, cancel it (closing its engine stream)."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_disconnect(request))
    try:
        await asyncio.wait([task, watcher], return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
    if task.cancelled():
        raise ClientGone()
    return task.result()


async def _disconnect(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass

