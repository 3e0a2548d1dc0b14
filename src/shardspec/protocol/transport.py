"""The one place that puts messages on ZeroMQ sockets and takes them off."""

from __future__ import annotations

from typing import Any

import zmq

from shardspec.protocol.codec import Message, encode

# ZMTP heartbeats let a dead TCP peer surface as a disconnect instead of a silent hang.
HEARTBEAT_IVL_MS = 1000
HEARTBEAT_TIMEOUT_MS = 3000


def configure(sock: zmq.Socket) -> None:
    """Socket options every shardspec socket shares."""
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.HEARTBEAT_IVL, HEARTBEAT_IVL_MS)
    sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, HEARTBEAT_TIMEOUT_MS)
    sock.setsockopt(zmq.HEARTBEAT_TTL, HEARTBEAT_TIMEOUT_MS)


def send(sock: zmq.Socket, msg: Message, envelope: list[Any] | None = None) -> Any:
    """Send `msg` without copying its tensor buffers; returns ZeroMQ's tracker (a future on asyncio
    sockets). pyzmq holds a reference to each buffer until libzmq is done with it; the caller must
    not write into those tensors before `tracker.done`."""
    frames = [*(envelope or []), *encode(msg)]
    return sock.send_multipart(frames, copy=False, track=True)
