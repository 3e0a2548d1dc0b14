"""What the tests of the chat-shaped APIs (Responses, Messages, tokenize) share: the chat-template
test model served on one local CPU worker, and a client that leaves a stream."""

from __future__ import annotations

import time
from pathlib import Path

import httpx
import pytest
from test_server import Server, start_server, worker_stats

from shardspec.testing.chat_model import write_chat_model


def serve_chat_model(folder: Path, context: int = 1024) -> Server:
    """The chat model (MTP on) served from `folder`; `server.model` is its checkpoint's folder."""
    write_chat_model(folder / "model")
    server = start_server(folder, "--model", str(folder / "model"), "--local", "1", "--max-seq-len", str(context))
    server.model = folder / "model"
    return server


def served(context: int = 1024):
    """A module-scoped fixture of the module's served chat model (serve_chat_model), stopped cleanly
    after its tests: `chat_server = served()` in a test module."""
    @pytest.fixture(scope="module")
    def chat_server(tmp_path_factory) -> Server:
        started = serve_chat_model(tmp_path_factory.mktemp("chat"), context)
        yield started
        assert started.stop() == 0, started.log.read_text(errors="replace")

    return chat_server


def leave_a_stream(server: Server, url: str, body: dict, streaming: str) -> tuple[dict, float]:
    """Read a streamed response until a line holds `streaming`, close the connection, and wait (30 s at
    most) for the worker to drop the sequence: (the worker's stats, the requests counted cancelled on
    the route)."""
    route = url.removeprefix(server.root)
    before = _cancelled(server, route)
    with httpx.Client(timeout=60) as http, http.stream("POST", url, json=body) as reply:
        lines = reply.iter_lines()
        while streaming not in next(lines):
            pass
    deadline = time.monotonic() + 30
    while (stats := worker_stats(server)[0])["live_sequences"] and time.monotonic() < deadline:
        time.sleep(0.05)
    return stats, _cancelled(server, route) - before


def _cancelled(server: Server, route: str) -> float:
    row = f'shardspec_requests_total{{endpoint="{route}",outcome="cancelled"}} '
    metrics = httpx.get(f"{server.root}/metrics", timeout=30).text
    return sum(float(line.removeprefix(row)) for line in metrics.splitlines() if line.startswith(row))
