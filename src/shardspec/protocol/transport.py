"""The one place that puts messages on ZeroMQ sockets and takes them off."""

from __future__ import annotations

import math
from typing import Any

import zmq

from shardspec.protocol.codec import MAX_HEADER_BYTES, Message, encode
from shardspec.protocol.messages import MAX_STEP_PROMPT_TOKENS

# ZMTP heartbeats both ways: a peer that dies or stops answering (a dead host, a cut cable, a
# stopped process) surfaces as a disconnect within the heartbeat timeout instead of a silent hang.
DEFAULT_HEARTBEAT_TIMEOUT_S = 2.0
HEARTBEAT_TIMEOUT_RANGE = (0.1, 3600.0)

# The largest frame a worker takes: a step's prompt ids (int64) at the most tokens a step may carry;
# a peer that sends a larger one is disconnected by libzmq before it is read into memory.
DEFAULT_MAX_MESSAGE_BYTES = MAX_HEADER_BYTES + 8 * MAX_STEP_PROMPT_TOKENS
MAX_MESSAGE_BYTES_RANGE = (MAX_HEADER_BYTES, 1 << 40)
# Requests a worker queues per peer while it is busy: an orchestrator has a few in flight at most.
WORKER_QUEUED_REQUESTS = 32

# Ownership lease: a worker drops an owner that sent nothing for the lease; an orchestrator with
# nothing else to send says hello every KEEPALIVE_S to keep it.
DEFAULT_LEASE_S = 30.0
LEASE_RANGE = (2.0, 86400.0)
KEEPALIVE_S = 0.5

# An orchestrator gives up on a worker address that refused every connection for this long (a worker
# just started may need a few seconds to listen).
REFUSED_GRACE_S = 10.0


def check_heartbeat_timeout(seconds: Any) -> float:
    """A heartbeat timeout in seconds, or ValueError naming the allowed range."""
    lo, hi = HEARTBEAT_TIMEOUT_RANGE
    if type(seconds) not in (int, float) or not math.isfinite(seconds) or not lo <= seconds <= hi:
        raise ValueError(f"heartbeat timeout must be a number of seconds in [{lo}, {hi}], got {seconds!r}")
    return float(seconds)


def check_range(name: str, value: Any, lo: float, hi: float) -> float:
    """A finite number in [lo, hi], or ValueError naming `name` and the range."""
    if type(value) not in (int, float) or not math.isfinite(value) or not lo <= value <= hi:
        raise ValueError(f"{name} must be a number in [{lo:.12g}, {hi:.12g}], got {value!r}")
    return value


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


def configure_worker(sock: zmq.Socket, max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES) -> None:
    """Options of a worker's ROUTER socket, which any peer that reaches it may talk to.

    It sends no PINGs of its own: libzmq 4.3.5 aborts the process (`!_io_error`,
    stream_engine_base.cpp:310) when its ping timer fires on a connection whose peer hung up while
    the worker was not reading from it (a client that floods requests, never reads and leaves).
    It still answers the orchestrator's PINGs, and drops an orchestrator that goes silent for the
    time-to-live those carry (the orchestrator's heartbeat timeout). Replies go out with NOBLOCK and
    ROUTER_MANDATORY (see `send_reply`); each frame and the queue per peer are bounded.
    """
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.HEARTBEAT_IVL, 0)
    sock.setsockopt(zmq.MAXMSGSIZE, int(check_range("max message bytes", max_message_bytes,
                                                    *MAX_MESSAGE_BYTES_RANGE)))
    sock.setsockopt(zmq.RCVHWM, WORKER_QUEUED_REQUESTS)
    sock.setsockopt(zmq.SNDHWM, WORKER_QUEUED_REQUESTS)
    sock.setsockopt(zmq.ROUTER_MANDATORY, 1)


def send(sock: zmq.Socket, msg: Message, envelope: list[Any] | None = None) -> Any:
    """Send `msg` without copying its tensor buffers; returns ZeroMQ's tracker (a future on asyncio
    sockets). pyzmq holds a reference to each buffer until libzmq is done with it; the caller must
    not write into those tensors before `tracker.done`."""
    frames = [*(envelope or []), *encode(msg)]
    return sock.send_multipart(frames, copy=False, track=True)


def forward(sock: zmq.Socket, frames: list[Any]) -> None:
    """Send received frames on unchanged (a relay): no decoding, no copy."""
    sock.send_multipart(frames, copy=False)


PEER_GONE = "it disconnected"
PEER_NOT_READING = "it does not read its replies"


def send_reply(sock: zmq.Socket, peer: bytes, msg: Message) -> str | None:
    """Send a reply on a ROUTER socket without ever blocking; None when it went out, else why it
    was dropped: PEER_GONE, or PEER_NOT_READING (the peer's queue is full)."""
    try:
        sock.send_multipart([peer, *encode(msg)], flags=zmq.NOBLOCK, copy=False)
    except zmq.Again:
        return PEER_NOT_READING
    except zmq.ZMQError as exc:
        if exc.errno == zmq.EHOSTUNREACH:
            return PEER_GONE
        raise
    return None


def send_tracked(sock: zmq.Socket, peer: bytes, msg: Message) -> Any:
    """Send on a ROUTER socket without blocking and without copying tensor buffers; returns the
    tracker (see `send`). Raises zmq.Again when the peer's queue is full, or EHOSTUNREACH when it left."""
    return sock.send_multipart([peer, *encode(msg)], flags=zmq.NOBLOCK, copy=False, track=True)
