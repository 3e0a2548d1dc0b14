"""The HTTP limits enforced: body size and type, read deadlines, connections (see limits.py).

`RequestGuard` (ASGI) reads a request's whole body before the application sees it: JSON only (415),
at most `max_body_bytes` (413, from Content-Length or while the body streams in), within
`read_timeout_s` (408). `DeadlineH11Protocol` (uvicorn's h11 protocol) closes a connection whose
request headers have not all arrived `read_timeout_s` after its first byte (or after the connection
opened), which uvicorn alone never does: any byte resets its keep-alive timer; and one whose
response the client has not read for `write_timeout_s` (its send buffer full all that time), which
cancels the generation behind it: a stream nobody reads frees its sequence.
"""

from __future__ import annotations

import asyncio
import functools
import json
import logging
import socket
from typing import Any

import h11
import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

from shardspec.server.api import ApiError
from shardspec.server.limits import KEEP_ALIVE_S, MAX_HEADER_BYTES, SEND_BUFFER_BYTES, HttpLimits
from shardspec.server.messages import anthropic_error

log = logging.getLogger("shardspec.server")

BODILESS_METHODS = frozenset({"GET", "HEAD", "OPTIONS", "DELETE"})  # (unless they declare a body)
JSON = b"application/json"


def uvicorn_config(app: Any, limits: HttpLimits, **options: Any) -> uvicorn.Config:
    """uvicorn's config for `app` behind the guard, with the connection limits of `limits`."""
    http = functools.partial(DeadlineH11Protocol, limits.read_timeout_s, limits.write_timeout_s)
    return uvicorn.Config(RequestGuard(app, limits), http=http,
                          timeout_keep_alive=KEEP_ALIVE_S, h11_max_incomplete_event_size=MAX_HEADER_BYTES,
                          limit_concurrency=limits.max_connections, **options)


class DeadlineH11Protocol(H11Protocol):
    """uvicorn's h11 protocol, closing a connection whose request headers arrive too slowly (slowloris)
    or whose response is not read (its writes paused: the transport's buffer over its high-water mark)."""

    def __init__(self, read_timeout_s: float, write_timeout_s: float, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.read_timeout_s = read_timeout_s
        self.write_timeout_s = write_timeout_s
        self.headers_deadline: asyncio.TimerHandle | None = None
        self.write_deadline: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        if (sock := transport.get_extra_info("socket")) is not None:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SEND_BUFFER_BYTES)
        self._arm()

    def data_received(self, data: bytes) -> None:
        if self.headers_deadline is None and self.conn.their_state is h11.IDLE:
            self._arm()  # the first byte of a request on a kept-alive connection
        super().data_received(data)
        if self.conn.their_state is not h11.IDLE:  # its headers are in: the body has its own deadline
            self._disarm()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        self._disarm_write()
        super().connection_lost(exc)

    def pause_writing(self) -> None:
        super().pause_writing()
        if self.write_deadline is None:
            self.write_deadline = self.loop.call_later(self.write_timeout_s, self._unread)

    def resume_writing(self) -> None:
        super().resume_writing()
        self._disarm_write()

    def _unread(self) -> None:
        """Drop the connection (abort: close would wait for a flush that never comes); the response's
        app sees the disconnect, and a stream's generation is cancelled."""
        self.write_deadline = None
        client = f"{self.client[0]}:{self.client[1]}" if self.client else "a client"
        log.warning("closed the connection of %s: it did not read its response for %g s (--write-timeout)", client,
                    self.write_timeout_s)
        self.transport.abort()

    def _arm(self) -> None:
        self._disarm()
        self.headers_deadline = self.loop.call_later(self.read_timeout_s, self._expired)

    def _disarm(self) -> None:
        if self.headers_deadline is not None:
            self.headers_deadline.cancel()
            self.headers_deadline = None

    def _disarm_write(self) -> None:
        if self.write_deadline is not None:
            self.write_deadline.cancel()
            self.write_deadline = None

    def _expired(self) -> None:
        self.headers_deadline = None
        if not self.transport.is_closing():
            self.transport.close()

    def send_400_response(self, msg: str) -> None:
        """What h11 could not parse, as an error object like every other refusal: 431 where the headers
        came in pieces past MAX_HEADER_BYTES (h11 stops buffering them), else 400."""
        if len(self.conn.trailing_data[0]) > MAX_HEADER_BYTES:
            error = _headers_too_large()
        else:
            error = ApiError(400, "the request is not valid HTTP/1.1")
        payload = json.dumps(error.body()).encode()
        headers = [(b"content-type", JSON), (b"content-length", str(len(payload)).encode()), (b"connection", b"close")]
        for event in (h11.Response(status_code=error.status, headers=headers), h11.Data(data=payload),
                      h11.EndOfMessage()):
            self.transport.write(self.conn.send(event))
        self.transport.close()


class RequestGuard:
    """ASGI middleware: a request's body is JSON, bounded, and read in time, before the app runs."""

    def __init__(self, app: Any, limits: HttpLimits):
        self.app = app
        self.limits = limits

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        headers = dict(scope["headers"]) if scope["type"] == "http" else {}
        # (h11 bounds headers that arrive in pieces: DeadlineH11Protocol.send_400_response; those of one read
        # come whole, so they are counted here)
        if sum(len(name) + len(value) + 4 for name, value in scope.get("headers", ())) > MAX_HEADER_BYTES:
            await _refuse(send, _headers_too_large(), scope["path"])
            return
        if scope["type"] != "http" or (scope["method"] in BODILESS_METHODS and not _declares_body(headers)):
            await self.app(scope, receive, send)
            return
        try:
            self._check_headers(headers)
            async with asyncio.timeout(self.limits.read_timeout_s):
                body = await self._read_body(receive)
        except ApiError as exc:
            await _refuse(send, exc, scope["path"])
            return
        except TimeoutError:
            timeout = self.limits.read_timeout_s
            await _refuse(send, ApiError(408, f"the request body did not arrive within {timeout:g} s"), scope["path"])
            return
        if body is None:
            return  # the client left
        await self.app(scope, _replay(body, receive), send)

    def _check_headers(self, headers: dict[bytes, bytes]) -> None:
        media_type = headers.get(b"content-type", b"").split(b";")[0].strip().lower()
        if media_type != JSON:
            raise ApiError(415, f"the request body must be JSON sent as Content-Type: application/json, not "
                           f"{media_type.decode('latin-1') or 'none'}")
        length = headers.get(b"content-length", b"")
        if length.isdigit() and int(length) > self.limits.max_body_bytes:
            raise self._too_large()

    async def _read_body(self, receive: Any) -> bytes | None:
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return None
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.limits.max_body_bytes:
                raise self._too_large()
            chunks.append(chunk)
            if not message.get("more_body", False):
                return b"".join(chunks)

    def _too_large(self) -> ApiError:
        return ApiError(413, f"the request body exceeds the server's limit of {self.limits.max_body_bytes} bytes "
                        "(shardspec serve --max-body-bytes)")


def _headers_too_large() -> ApiError:
    return ApiError(431, f"the request's headers exceed {MAX_HEADER_BYTES} bytes")


def _declares_body(headers: dict[bytes, bytes]) -> bool:
    """A GET with a body is read under the same rules: left unread, it would hold the connection."""
    return b"transfer-encoding" in headers or headers.get(b"content-length", b"0") != b"0"


def _replay(body: bytes, receive: Any) -> Any:
    """A receive that gives the app the body read, then what the client sends next (its disconnect)."""
    pending = [{"type": "http.request", "body": body, "more_body": False}]

    async def replayed() -> dict[str, Any]:
        return pending.pop() if pending else await receive()

    return replayed


async def _refuse(send: Any, error: ApiError, path: str) -> None:
    """The error object (in Anthropic's shape on its API's routes), and the connection closed: the rest
    of the body is not read."""
    if path.startswith("/v1/messages"):
        error = anthropic_error(error)
    payload = json.dumps(error.body()).encode()
    await send({"type": "http.response.start", "status": error.status,
                "headers": [(b"content-type", JSON), (b"content-length", str(len(payload)).encode()),
                            (b"connection", b"close")]})
    await send({"type": "http.response.body", "body": payload})
