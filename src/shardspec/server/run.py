"""`shardspec serve`: load the model on its workers, then serve HTTP until SIGINT/SIGTERM.

The listening socket is bound before the model loads, so a taken port fails at once and port 0
gets a free port that the ready line names. HTTP is served from the start: while the model loads,
`/health` answers 503 with the share of the weights read, and every other route 503. Signals are
handled here rather than by uvicorn: the first stops a model load in progress or starts uvicorn's
graceful shutdown, a second forces it; in every case the engine then says goodbye to the workers
and stops the ones it spawned. A graceful shutdown lets the requests in flight run for
`--shutdown-timeout`, then ends the rest with an error a client can read (a stream's error event, a
503), before uvicorn would cancel them mid-response.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import signal
import socket
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import uvicorn

from shardspec.orchestrator.config import EngineConfig
from shardspec.orchestrator.engine import Engine, connect
from shardspec.protocol.messages import LoadProgress
from shardspec.server.app import create_app
from shardspec.server.chat import ChatTemplate
from shardspec.server.guard import uvicorn_config
from shardspec.server.limits import HttpLimits

BUNDLED_NAME = "shardspec-tiny-stdlib"
ENDING_S = 2  # after requests were ended at a shutdown, how long uvicorn waits for their responses to go out


@dataclass
class ServeOptions:
    """The engine to serve, and where and as what the server answers."""

    engine: EngineConfig
    host: str
    port: int
    model_name: str  # the model id clients send
    log_level: str = "info"
    limits: HttpLimits = field(default_factory=HttpLimits)
    cache_salt: str = "optional"  # which requests share the prefix cache (server.cache_salts)


def bind(host: str, port: int) -> socket.socket:
    """A listening TCP socket on host:port (port 0: any free port). Made as a TCP socket by name
    (IPPROTO_TCP), as asyncio's own are: asyncio turns Nagle's algorithm off only on those, and with
    it on a stream's first event, written right after its headers on a kept-alive connection, waited
    for the client's delayed ACK (~40 ms on Linux)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen(2048)
    except OSError:
        sock.close()
        raise
    return sock


class _Server(uvicorn.Server):
    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        # serve() installs the handlers instead: they must also stop a model load, and uvicorn's
        # would re-raise the signal after shutdown, before the workers are shut down
        yield


class LoadingGate:
    """The server's ASGI app: until the model has loaded, `/health` answers 503 {"status": "loading",
    "progress": the share of the weights the workers have read} and any other route a 503 error
    object; then every request goes to `app`."""

    def __init__(self) -> None:
        self.app: Any = None
        self.fraction = 0.0

    def on_progress(self, progress: list[LoadProgress | None]) -> None:
        self.fraction = sum(p.bytes_done / p.bytes_total for p in progress if p and p.bytes_total) / len(progress)

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if self.app is not None:
            return await self.app(scope, receive, send)
        if scope["type"] != "http":
            return None
        if scope["path"] == "/health":
            body = {"status": "loading", "progress": round(self.fraction, 3)}
        else:
            body = {"error": {"message": f"the model is loading ({self.fraction:.0%} of its weights read); try "
                              "again shortly", "type": "service_unavailable", "param": None, "code": None}}
        await send({"type": "http.response.start", "status": 503,
                    "headers": [(b"content-type", b"application/json"), (b"retry-after", b"1")]})
        await send({"type": "http.response.body", "body": json.dumps(body).encode()})
        return None


async def serve(options: ServeOptions, sock: socket.socket, ready: Callable[[str, Engine], None],
                on_progress: Callable[[list[LoadProgress | None]], None] | None = None) -> None:
    """Serve until a signal; `ready` gets the base URL and the engine once requests can be answered,
    `on_progress` each worker's load progress while they load."""
    gate = LoadingGate()
    config = uvicorn_config(gate, options.limits, lifespan="off", log_level=options.log_level, access_log=False,
                            timeout_graceful_shutdown=options.limits.shutdown_timeout_s + ENDING_S)
    server = _Server(config)
    main = asyncio.current_task()
    assert main is not None
    served: list[Engine] = []

    def stop_requests() -> None:
        for engine in served:
            engine.stop("the server is shutting down")

    def on_signal() -> None:
        if gate.app is None:
            main.cancel()  # still loading: stop the load, the engine cleans up
        elif server.should_exit:
            server.force_exit = True
            stop_requests()
        else:
            server.should_exit = True
            loop.call_later(options.limits.shutdown_timeout_s, stop_requests)

    def progressed(progress: list[LoadProgress | None]) -> None:
        gate.on_progress(progress)
        if on_progress is not None:
            on_progress(progress)

    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, on_signal)
    serving = asyncio.create_task(server.serve(sockets=[sock]))
    try:
        async with connect(config=options.engine, on_progress=progressed) as engine:
            model_dir = Path(options.engine.model)
            chat = ChatTemplate.from_folder(model_dir) if model_dir.is_dir() else None
            gate.app = create_app(engine, options.model_name, chat, limits=options.limits,
                                  cache_salt=options.cache_salt)
            served.append(engine)
            host, port = sock.getsockname()[:2]
            ready(f"http://{f'[{host}]' if ':' in host else host}:{port}/v1", engine)
            await asyncio.shield(serving)
    finally:
        if not serving.done():  # (the load failed or was stopped)
            server.should_exit = True
            with contextlib.suppress(asyncio.CancelledError):
                await serving


def default_model_name(model: str, bundled: Path) -> str:
    path = Path(model)
    if path.resolve() == bundled.resolve():
        return BUNDLED_NAME
    return path.name or model
