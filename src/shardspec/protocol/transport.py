"""The one place that puts messages on ZeroMQ sockets and takes them off."""

from __future__ import annotations

import math
from typing import Any

import zmq

from shardspec.protocol.codec import Message, encode

# ZMTP heartbeats both ways: a peer that dies or stops answering (a dead host, a cut cable, a
# stopped process) surfaces as a disconnect within the heartbeat timeout instead of a silent hang.
DEFAULT_HEARTBEAT_TIMEOUT_S = 2.0
HEARTBEAT_TIMEOUT_RANGE = (0.1, 3600.0)


def check_heartbeat_timeout(seconds: Any) -> float:
    """A heartbeat timeout in seconds, or ValueError naming the allowed range."""
    lo, hi = HEARTBEAT_TIMEOUT_RANGE
    if type(seconds) not in (int, float) or not math.isfinite(seconds) or not lo <= seconds <= hi:
        raise ValueError(f"heartbeat timeout must be a number of seconds in [{lo}, {hi}], got {seconds!r}")
    return float(seconds)


def configure(sock: zmq.Socket, heartbeat_timeout: float = DEFAULT_HEARTBEAT_TIMEOUT_S) -> None:
    """Socket options every shardspec socket shares.

    A PING goes out every quarter of `heartbeat_timeout`; a connection that then stays silent for
    the other three quarters is closed. Any traffic counts as an answer, so a peer busy with a long
    step is not mistaken for a dead one (libzmq answers PINGs on its own I/O thread).
    """
    timeout_ms = round(check_heartbeat_timeout(heartbeat_timeout) * 1000)
    interval_ms = max(1, timeout_ms // 4)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.HEARTBEAT_IVL, interval_ms)
    sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, timeout_ms - interval_ms)
    sock.setsockopt(zmq.HEARTBEAT_TTL, max(100, timeout_ms))  # what the peer should allow us (0.1 s units)


def send(sock: zmq.Socket, msg: Message, envelope: list[Any] | None = None) -> Any:
    """Send `msg` without copying its tensor buffers; returns ZeroMQ's tracker (a future on asyncio
    sockets). pyzmq holds a reference to each buffer until libzmq is done with it; the caller must
    not write into those tensors before `tracker.done`."""
    frames = [*(envelope or []), *encode(msg)]
    return sock.send_multipart(frames, copy=False, track=True)


def forward(sock: zmq.Socket, frames: list[Any]) -> None:
    """Send received frames on unchanged (a relay): no decoding, no copy."""
    sock.send_multipart(frames, copy=False)
