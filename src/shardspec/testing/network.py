"""Waiting for a local process to listen (tests and benchmarks that start workers)."""

from __future__ import annotations

import socket
import time


def wait_listening(port: int, host: str = "127.0.0.1", timeout: float = 90.0, poll: float = 0.1) -> None:
    """Block until something accepts TCP connections on host:port; OSError after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            socket.create_connection((host, port), timeout=1).close()
            return
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(poll)
