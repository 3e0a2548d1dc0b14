"""The orchestrator's side of a worker connection, and spawning workers on this machine."""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import errno
import logging
import os
import shutil
import signal
import socket
import stat
import subprocess
import sys
import tempfile
import time
import weakref
from collections import deque
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import zmq
import zmq.asyncio
from zmq.utils.monitor import parse_monitor_message

from shardspec import security
from shardspec.protocol import codec, transport
from shardspec.protocol.codec import Message
from shardspec.protocol.errors import ErrorCode, ProtocolError, RemoteError
from shardspec.protocol.messages import (
    LINKS,
    REPLIES,
    HelloRequest,
    LoadProgress,
    StatusReply,
    StatusRequest,
    parse,
    to_meta,
)
from shardspec.security import KeyPair

log = logging.getLogger("shardspec.orchestrator")


class WorkerLost(ConnectionError):
    """The connection to a worker broke, or its process exited."""


HANDSHAKE_S = 10.0  # a connection whose peer has not completed the ZeroMQ handshake by then is dropped
PEER_LOG_S = 1.0  # at most one log line per connection this often about what its peer sent


class WorkerClient:
    """One DEALER socket to one worker; requests are matched to replies by id."""

    def __init__(self, ctx: zmq.asyncio.Context, address: str, keys: KeyPair | None = None,
                 server_key: bytes | None = None, heartbeat_timeout: float = transport.DEFAULT_HEARTBEAT_TIMEOUT_S,
                 on_failure: Callable[[], None] | None = None,
                 on_link: Callable[[WorkerClient, str, list], None] | None = None,
                 on_progress: Callable[[WorkerClient, LoadProgress], None] | None = None, lease: bool = True,
                 max_reply_bytes: int | None = None):
        self.address = address
        self.on_progress = on_progress  # given the worker's load progress as it comes
        self.loading: LoadProgress | None = None  # the last progress of its load
        self.last_heard = 0.0  # loop time of its last message (an idle orchestrator says hello every KEEPALIVE_S)
        self.on_link = on_link  # given stage-link messages to relay: (this client, op, frames)
        self.heartbeat_timeout = heartbeat_timeout
        self.on_failure = on_failure  # told once, when the connection fails
        self.sock = ctx.socket(zmq.DEALER)
        transport.configure(self.sock, heartbeat_timeout)
        self.sock.setsockopt(zmq.HANDSHAKE_IVL, int(HANDSHAKE_S * 1000))
        self.max_reply_bytes = max_reply_bytes
        if max_reply_bytes is not None:  # a larger frame drops the connection before it is read into memory
            self.sock.setsockopt(zmq.MAXMSGSIZE, max_reply_bytes)
        self.curve = keys is not None and server_key is not None
        if self.curve:
            security.make_client(self.sock, keys, server_key)
        self.monitor = self.sock.get_monitor_socket(
            zmq.EVENT_CONNECTED | zmq.EVENT_DISCONNECTED | zmq.EVENT_CONNECT_RETRIED | zmq.EVENT_HANDSHAKE_FAILED_AUTH
            | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL | zmq.EVENT_HANDSHAKE_SUCCEEDED
        )
        self.sock.connect(address)
        self.pending: dict[int, asyncio.Future] = {}
        self.next_id = 1
        self.connected = False
        self.refused_since: float | None = None  # loop time of the first refused attempt since the last connection
        self.answered = False  # a reply came: the connection (and any CURVE handshake) works
        self.handshaken = False  # the connection's ZeroMQ handshake (CURVE's too) completed
        self.peer_logged_at, self.peer_unlogged = -PEER_LOG_S, 0  # _log_peer's rate limit
        self.last_sent = 0.0  # loop time of the last request: the worker's lease runs from its last one
        self.failure: Exception | None = None
        self.closed = False
        self.tasks = [asyncio.create_task(self._read()), asyncio.create_task(self._watch())]
        if lease:  # (an orchestrator's: it owns the worker; `shardspec status` only asks)
            self.tasks.append(asyncio.create_task(self._keep_lease()))

    def submit(self, request: Any, tensors: dict[str, torch.Tensor] | None = None) -> asyncio.Future:
        """Send a request now; the future resolves to (reply, tensors) or raises."""
        future = asyncio.get_running_loop().create_future()
        if self.failure is not None:
            future.set_exception(self.failure)
            return future
        request_id, self.next_id = self.next_id, self.next_id + 1
        self.pending[request_id] = future
        transport.send(self.sock, Message(request.OP, request_id, to_meta(request), tensors or {}))
        self.last_sent = asyncio.get_running_loop().time()
        return future

    async def call(self, request: Any, tensors: dict | None = None, timeout: float | None = None) -> tuple:
        future = self.submit(request, tensors)
        try:
            return await asyncio.wait_for(future, timeout)
        except TimeoutError:
            raise WorkerLost(f"worker {self.address} did not answer {request.OP!r} within {timeout:.0f}s") from None

    def fail(self, exc: Exception) -> None:
        """Fail every pending and future request with `exc`."""
        first = self.failure is None
        self.failure = exc
        for future in self.pending.values():
            if not future.done():
                future.set_exception(exc)
                future.exception()  # marked seen: a caller that still waits gets it; one that left logs nothing
        self.pending.clear()
        if first and self.on_failure is not None:
            self.on_failure()

    async def _read(self) -> None:
        while True:
            frames = await self.sock.recv_multipart(copy=False)
            if (op := _link_op(frames)) is not None:
                if self.on_link is None:
                    self._log_peer(f"dropped a stage-link message from {self.address}: this engine relays none")
                else:
                    self.on_link(self, op, frames)
                continue
            try:
                reply = codec.decode(frames)
                body = parse(REPLIES[reply.op], reply.meta)
            except Exception as exc:  # e.g. a worker of another protocol version: fail that request
                self._log_peer(f"undecodable reply from {self.address}: {exc}", logging.ERROR)
                future = self.pending.pop(codec.peek_id(frames), None)
                if future is not None and not future.done():
                    future.set_exception(WorkerLost(f"worker {self.address}: {exc}"))
                continue
            self.answered = True
            self.last_heard = asyncio.get_running_loop().time()
            if reply.op == LoadProgress.OP:  # not a reply: how far the load it runs has come
                self.loading = body
                if self.on_progress is not None:
                    self.on_progress(self, body)
                continue
            future = self.pending.pop(reply.id, None)
            if future is None:
                self._log_peer(f"reply {reply.id} from {self.address} matches no request")
            elif future.done():  # the caller gave up waiting (cancelled)
                continue
            elif reply.op == "error":
                future.set_exception(RemoteError(self.address, body.code, body.message))
            else:
                future.set_result((body, reply.tensors))

    async def _watch(self) -> None:
        while True:
            event = parse_monitor_message(await self.monitor.recv_multipart())
            if event["event"] == zmq.EVENT_CONNECTED:
                self.connected, self.refused_since, self.handshaken = True, None, False
            elif event["event"] == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                self.handshaken = True
            elif event["event"] == zmq.EVENT_CONNECT_RETRIED and self.refused_since is None:
                self.refused_since = asyncio.get_running_loop().time()
            elif event["event"] == zmq.EVENT_DISCONNECTED and self.connected:
                self.connected = False
                if self.answered:
                    self.fail(WorkerLost(f"lost the connection to worker {self.address}: it exited, or stopped "
                                         f"answering heartbeats for {self.heartbeat_timeout:g}s"))
                elif self.handshaken:  # (its keys were taken: not a security mismatch)
                    bound = (f", or sent a reply over {self.max_reply_bytes} bytes (is it a shardspec worker?)"
                             if self.max_reply_bytes is not None else "")
                    self.fail(WorkerLost(f"the connection to {self.address} dropped before it answered: the worker "
                                         f"exited{bound}"))
                else:  # dropped before any reply: a security mismatch
                    self.fail(WorkerLost(self._handshake_dropped()))
            elif event["event"] == zmq.EVENT_HANDSHAKE_FAILED_AUTH:
                self.fail(WorkerLost(f"worker {self.address} refused this orchestrator's key: add its public key "
                                     "to the worker's --allow"))
            elif event["event"] == zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL and event["value"] == errno.EAGAIN:
                # (libzmq's handshake timer: the peer never answered the greeting)
                self.fail(WorkerLost(f"what listens at {self.address} did not complete a ZeroMQ handshake in "
                                     f"{HANDSHAKE_S:g}s: it is not a shardspec worker"))
            elif event["event"] & (zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL):
                self.fail(WorkerLost(
                    f"security handshake with worker {self.address} failed: check --keys and --server-keys (CURVE "
                    "on one side only, or the wrong server key)" if self.curve else
                    f"the ZeroMQ handshake with {self.address} failed: it is not a shardspec worker, or it asks for "
                    "CURVE keys (--keys and --server-keys)"))

    def _handshake_dropped(self) -> str:
        """Why a worker most likely dropped the connection before its first reply. A worker that refuses
        a CURVE key sends an ERROR command and closes; when the close overtakes it on the wire (libzmq
        does not wait for it), this side sees only the disconnect, so the message names both causes."""
        if self.curve:
            return (f"worker {self.address} closed the connection during the CURVE handshake: either it "
                    "refused this orchestrator's key (add its public key to the worker's --allow) or "
                    "--server-keys does not hold the worker's public key")
        return (f"worker {self.address} closed the connection during the handshake: the worker may require "
                "CURVE keys (give --keys and --server-keys)")

    def _log_peer(self, message: str, level: int = logging.WARNING) -> None:
        """A line about what the peer sent, at most one each PEER_LOG_S (a peer that floods bogus
        replies must not fill the log), its control characters escaped (the text may be the peer's)."""
        now = time.monotonic()
        if now - self.peer_logged_at < PEER_LOG_S:
            self.peer_unlogged += 1
            return
        more = f" ({self.peer_unlogged} more such lines left out)" if self.peer_unlogged else ""
        log.log(level, "%s%s", printable(message), more)
        self.peer_logged_at, self.peer_unlogged = now, 0

    async def _keep_lease(self) -> None:
        """Once the worker has answered, say hello whenever nothing else went out for KEEPALIVE_S and
        no request is waiting for its reply: a worker drops an orchestrator that sends nothing for its
        lease, and counts its answer to a request as contact. Hellos sent while the worker is busy
        would pile up in its bounded queue; once that is full, libzmq stops reading the connection,
        heartbeats included, and the connection drops."""
        loop = asyncio.get_running_loop()
        while True:
            wait = self.last_sent + transport.KEEPALIVE_S - loop.time()
            if wait > 0 or self.pending or not self.answered or self.failure is not None:
                await asyncio.sleep(wait if wait > 0 else transport.KEEPALIVE_S / 5)
                continue
            future = self.submit(HelloRequest(client=f"shardspec-orchestrator pid {os.getpid()} (lease)"))
            future.add_done_callback(self._on_keepalive)

    def _on_keepalive(self, future: asyncio.Future) -> None:
        """A worker that no longer takes this orchestrator fails the connection (the engine recovers)."""
        if future.cancelled() or future.exception() is None:
            return
        exc = future.exception()
        if isinstance(exc, RemoteError) and exc.code in (ErrorCode.BUSY, ErrorCode.BAD_STATE):
            self.fail(WorkerLost(f"worker {self.address} dropped this orchestrator ({exc.message}): its lease "
                                 "lapsed, or another orchestrator took it"))

    async def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        for task in self.tasks:
            task.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)
        if self.failure is None:
            self.fail(WorkerLost(f"connection to {self.address} closed"))
        if self.peer_unlogged:
            log.warning("%d more lines about what %s sent were left out", self.peer_unlogged, self.address)
        self.sock.disable_monitor()
        self.monitor.close(linger=0)
        self.sock.close(linger=0)


def _link_op(frames: list) -> str | None:
    """The op of a stage-link message (read from its header alone), None for anything else."""
    try:
        op = codec.header_op(frames)
    except ProtocolError:
        return None
    return op if op in LINKS else None


def _die_with_parent() -> None:
    """In the child: get SIGTERM when the orchestrator dies, however it dies (Linux)."""
    with contextlib.suppress(OSError):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


class LocalWorkers:
    """Worker daemons spawned on this machine on ipc:// sockets; they die with this process, and
    this process restarts one that exits: at once up to MAX_RESTARTS times in RESTART_WINDOW_S, then
    (a crash loop) after a pause that starts at BACKOFF_S and doubles up to MAX_BACKOFF_S, so that a
    long-running service comes back once the cause is gone, without restarting in a tight loop."""

    MAX_RESTARTS = 3
    RESTART_WINDOW_S = 600.0
    BACKOFF_S = 5.0
    MAX_BACKOFF_S = 300.0

    def __init__(self, count: int, device: str, heartbeat_timeout: float = transport.DEFAULT_HEARTBEAT_TIMEOUT_S):
        self.dir = Path(tempfile.mkdtemp(prefix=f"{DIR_PREFIX}{os.getpid()}-"))
        self.addresses = [f"ipc://{self.dir}/worker{i}.sock" for i in range(count)]
        self.logs = [self.dir / f"worker{i}.log" for i in range(count)]
        devices = [f"cuda:{i}" for i in range(count)] if device == "cuda" else [device] * count
        threads = max(1, (os.cpu_count() or 1) // count) if device == "cpu" else 1
        self.commands = [
            [sys.executable, "-m", "shardspec", "worker", "--listen", address, "--device", dev,
             "--threads", str(threads), "--heartbeat-timeout", str(heartbeat_timeout)]
            for address, dev in zip(self.addresses, devices, strict=True)
        ]
        self.restarts = [0] * count
        self.recent_restarts: list[deque[float]] = [deque() for _ in range(count)]  # monotonic times, in the window
        self.pauses = [0] * count  # a crash loop's pauses so far (0: none since its restarts left the window)
        self.next_start: list[float | None] = [None] * count  # a paused worker's next start (monotonic)
        self.note: str | None = None  # why a worker is not started yet (a crash loop's pause), for the failure
        self.procs: list[subprocess.Popen] = [self._spawn(i, "wb") for i in range(count)]
        _SPAWNED.add(self)

    def _spawn(self, i: int, mode: str) -> subprocess.Popen:
        with open(self.logs[i], mode) as log_file:
            return subprocess.Popen(self.commands[i], stdin=subprocess.DEVNULL, stdout=log_file,
                                    stderr=subprocess.STDOUT, preexec_fn=_die_with_parent)

    def check_alive(self) -> None:
        for i, proc in enumerate(self.procs):
            if proc.poll() is not None:
                raise WorkerLost(f"local worker {i} exited with code {proc.returncode}:\n{self.log_tail(i)}")

    def restart_exited(self) -> float:
        """Start again the workers that exited and may start now; -> 0, or the seconds until the
        next one in a crash loop may (its pause)."""
        wait, notes = 0.0, []
        for i, proc in enumerate(self.procs):
            if proc.poll() is None:
                continue
            if (pause := self._pause(i, proc.returncode)) > 0:
                wait = max(wait, pause)
                notes.append(f"local worker {i} keeps exiting (code {proc.returncode}): starting it again in "
                             f"{pause:.0f}s")
            else:
                self.restarts[i] += 1
                self.recent_restarts[i].append(time.monotonic())
                log.warning("local worker %d exited with code %s; starting it again (restart %d)", i, proc.returncode,
                            self.restarts[i])
                self.procs[i] = self._spawn(i, "ab")
        self.note = "; ".join(notes) or None
        return wait

    def _pause(self, i: int, code: int) -> float:
        """The seconds before worker i may start again: 0 within its quick restarts, else what is
        left of its pause (the pause set, and logged, when it begins)."""
        recent, now = self.recent_restarts[i], time.monotonic()
        while recent and recent[0] <= now - self.RESTART_WINDOW_S:
            recent.popleft()
        if not recent:
            self.pauses[i] = 0
        if len(recent) < self.MAX_RESTARTS:
            return 0.0
        if self.next_start[i] is None:
            pause = min(self.BACKOFF_S * 2 ** self.pauses[i], self.MAX_BACKOFF_S)
            self.pauses[i] += 1
            self.next_start[i] = now + pause
            log.error("local worker %d exited with code %s after %d restarts in %gs; starting it again in %.0fs:\n%s",
                      i, code, len(recent), self.RESTART_WINDOW_S, pause, self.log_tail(i))
        if now < self.next_start[i]:
            return self.next_start[i] - now
        self.next_start[i] = None
        return 0.0

    def log_tail(self, i: int, lines: int = 15) -> str:
        try:
            return "\n".join(self.logs[i].read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""

    def stop(self, timeout: float = 10.0) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                proc.terminate()
        for proc in self.procs:
            try:
                proc.wait(timeout)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        shutil.rmtree(self.dir, ignore_errors=True)


DIR_PREFIX = "shardspec-"  # LocalWorkers' folders: shardspec-PID-RANDOM in the temporary folder
_SPAWNED: weakref.WeakSet[LocalWorkers] = weakref.WeakSet()


def kill_spawned() -> None:
    """SIGKILL every worker this process spawned (a second Ctrl-C: the shutdown under way then finds
    them gone at once, and still removes their folders)."""
    for local in list(_SPAWNED):
        for proc in local.procs:
            if proc.poll() is None:
                proc.kill()


def remove_stale_dirs() -> list[Path]:
    """Remove this user's LocalWorkers folders whose orchestrator's process is gone (killed with
    SIGKILL, it could not remove its own); -> the folders removed."""
    removed = []
    for path in Path(tempfile.gettempdir()).glob(f"{DIR_PREFIX}*-*"):
        pid = path.name[len(DIR_PREFIX) :].split("-", 1)[0]
        try:
            info = path.lstat()
        except OSError:
            continue
        if pid.isdigit() and stat.S_ISDIR(info.st_mode) and info.st_uid == os.getuid() and not _alive(int(pid)):
            shutil.rmtree(path, ignore_errors=True)
            removed.append(path)
    return removed


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)  # signal 0: only asks whether it exists
    except (ProcessLookupError, OverflowError):
        return False
    except PermissionError:  # another user's process
        return True
    return True


async def worker_status(address: str, keys: KeyPair | None = None, server_key: bytes | None = None,
                        timeout: float = 10.0) -> StatusReply:
    """What the worker at `address` is doing (its StatusReply), without taking it over; WorkerLost
    when nothing answers (refused, a peer that is not a worker, keys refused) within `timeout`."""
    ctx = zmq.asyncio.Context()
    client = WorkerClient(ctx, address, keys, server_key, lease=False, max_reply_bytes=codec.MAX_HEADER_BYTES)
    try:
        reply, _ = await _answer(client, StatusRequest(), None, asyncio.get_running_loop().time() + timeout, timeout,
                                 "status")
        return reply
    finally:
        await client.close()
        ctx.term()


def printable(text: str) -> str:
    """`text` with its control and format characters escaped (`\\x1b`, `\\r`, `\\u202e`): a peer's
    text printed to a terminal cannot move the cursor, recolour, or hide what follows it."""
    if text.isprintable():
        return text
    return "".join(c if c.isprintable() else c.encode("unicode_escape").decode("ascii") for c in text)


async def wait_ready(client: WorkerClient, local: LocalWorkers | None, timeout: float) -> Any:
    """Say hello until the worker answers (it may still be starting); returns its HelloReply.

    A worker still owned by an orchestrator that just went away answers `busy` until it notices
    (within its heartbeat timeout): ask again for a while before giving up."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    busy_until = loop.time() + client.heartbeat_timeout + 1.0
    while True:
        try:
            hello, _ = await _answer(client, HelloRequest(client=f"shardspec-orchestrator pid {os.getpid()}"), local,
                                     deadline, timeout, "hello", "--connect-timeout")
            return hello
        except RemoteError as exc:
            if exc.code != ErrorCode.BUSY or loop.time() > min(busy_until, deadline):
                raise
        await asyncio.sleep(0.2)


async def _answer(client: WorkerClient, request: Any, local: LocalWorkers | None, deadline: float, timeout: float,
                  what: str, flag: str = "") -> tuple:
    """The worker's answer to `request`, while it may still be starting: WorkerLost past `deadline`,
    or once its address has refused connections for REFUSED_GRACE_S (or a spawned worker exited)."""
    loop = asyncio.get_running_loop()
    future = client.submit(request)
    while not future.done():
        if local is not None:
            local.check_alive()
        elif client.refused_since is not None and loop.time() - client.refused_since > transport.REFUSED_GRACE_S:
            future.cancel()
            raise WorkerLost(f"connection refused: is a worker listening on {client.address}? (refused for "
                             f"{transport.REFUSED_GRACE_S:g}s)")
        if loop.time() > deadline:
            future.cancel()
            if local is not None and not client.answered:  # (spawned here: still starting, not missing)
                raise WorkerLost(f"local worker {client.address} did not start within {timeout:g}s"
                                 + (f" ({flag})" if flag else ""))
            if client.refused_since is not None:
                raise WorkerLost(f"connection refused: is a worker listening on {client.address}? (refused for "
                                 f"{loop.time() - client.refused_since:.0f}s)")
            raise WorkerLost(f"worker {client.address} did not answer {what} within {timeout:.0f}s"
                             + (f" ({flag})" if flag else ""))
        await asyncio.wait([future], timeout=0.1)
    return future.result()


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]
