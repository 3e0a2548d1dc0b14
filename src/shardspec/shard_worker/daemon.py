"""The shard worker daemon: one process per device, serving one orchestrator at a time.

States: idle -> (init) initialized -> (load) loaded; `shutdown` from the orchestrator, losing
its connection, or its lease lapsing (it sent nothing for the lease time) frees everything and
returns to idle. Only SIGINT/SIGTERM end the process.

This module is the socket loop: ownership and lease, relayed stage links, replies that never
block. What each op does is ops.py's (OpHandlers).
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import time
import traceback
from collections import deque
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import zmq
from zmq.auth.thread import ThreadAuthenticator
from zmq.utils.monitor import recv_monitor_message

from shardspec import security
from shardspec.layers.parallel import TPGroup
from shardspec.layers.shm import CollectiveFailed
from shardspec.protocol import codec, transport
from shardspec.protocol.codec import Message
from shardspec.protocol.errors import ErrorCode, ProtocolError
from shardspec.protocol.messages import (
    LINKS,
    REQUESTS,
    GrammarRequest,
    LoadProgress,
    StatusRequest,
    StepRequest,
    parse,
    to_meta,
)
from shardspec.security import AllowList, KeyPair
from shardspec.shard_worker import group
from shardspec.shard_worker.links import LinkDropped, RelayedLinks, StageLinks
from shardspec.shard_worker.loading import HeldModel, free_memory
from shardspec.shard_worker.ops import OpHandlers, error_message
from shardspec.shard_worker.profiling import StepProfiler, Timeline, mark
from shardspec.shard_worker.runner import ModelRunner
from shardspec.shard_worker.shard_cache import ShardCache
from shardspec.shard_worker.shard_receiver import ShardReceiver
from shardspec.utils import parse_device

log = logging.getLogger("shardspec.worker")

GRAMMAR_POLL_S = 0.005  # while grammars are being built: how often the worker looks whether one is done
# launch ahead: while the device runs a step's pass, how often the worker looks for the next request
PEEK_POLL_S = 50e-6


class ShardWorker(OpHandlers):
    def __init__(self, listen: str, device: str, keys: KeyPair | None = None, allow: list[bytes] | None = None,
                 heartbeat_timeout: float = transport.DEFAULT_HEARTBEAT_TIMEOUT_S,
                 lease: float = transport.DEFAULT_LEASE_S,
                 max_message_bytes: int = transport.DEFAULT_MAX_MESSAGE_BYTES, threads: int | None = None,
                 cache: ShardCache | None = None, model_root: Path | None = None):
        if keys is not None and not allow:
            raise ValueError("a worker with CURVE keys needs at least one allowed client key (--allow)")
        self.listen = listen
        self.heartbeat_timeout = transport.check_heartbeat_timeout(heartbeat_timeout)
        self.lease = transport.check_range("lease", lease, *transport.LEASE_RANGE)
        self.max_message_bytes = max_message_bytes
        self.threads = threads  # CPU threads for torch; None: this host's cores shared among the group's ranks on it
        self.keys = keys
        self.allow = allow or []
        self.device = parse_device(device)
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
            # cuDNN attention plans each new shape on the host (~50 ms); decode shapes change every step
            torch.backends.cuda.enable_cudnn_sdp(False)
        else:
            torch.set_flush_denormal(True)  # subnormal floats slow CPU kernels ~10x; they carry no signal here
        self.state = "idle"
        self.owner: bytes | None = None
        self.owner_fd: int | None = None
        self.owner_gone = False  # its connection dropped (seen while a step waited on a stage link, say)
        self.dropping = False  # the owner's last reply was dropped
        self.owner_seen = 0.0  # when the owner last sent a request, or was last answered (monotonic)
        self.lapsed: bytes | None = None  # the last owner whose lease lapsed: its next request is told so
        self.closed_fds: set[int] = set()  # connections seen to close (and not reused since): departed peers
        self.monitor: zmq.Socket | None = None
        self.sock: zmq.Socket | None = None  # the ROUTER socket orchestrators talk to
        self.authenticator: ThreadAuthenticator | None = None
        self.deferred: deque[list] = deque()  # requests that came while a step waited on relayed links
        self.tp: TPGroup | None = None
        self.stage, self.stages = 0, 1  # this rank's pipeline stage, of how many
        self.rank, self.world_size = 0, 1  # its place in the group (the last init's)
        self.links: StageLinks | None = None  # to the other stages, with more than one
        self.ctx: zmq.Context | None = None
        self.runner: ModelRunner | None = None
        self.held = HeldModel(self.device, cache, model_root)
        self.receiver = ShardReceiver(self.held.cache, model_root)  # models an orchestrator sends (shards, chunk)
        self.steps = 0
        self.errors = 0
        self.gap_count, self.gap_total = 0, 0.0  # idle time between a step's reply and the next step
        self.step_total_s = 0.0  # time in steps (waits on stage links included)
        self.last_step_sent: float | None = None
        self.stopping = False
        self.profiler = StepProfiler()  # SHARDSPEC_PROFILE: steps under PyTorch's profiler
        self.timeline = Timeline()  # its steps' requests and replies (the stage links keep theirs)
        self.rejected_logged_at, self.rejected_unlogged = -1.0, 0  # _log_rejected's rate limit
        self.started = time.monotonic()
        self.owner_address = ""  # where the owner's hello came from, as the worker sees it
        self.model_name = ""  # the loaded model folder's name (StatusReply)
        self.layers: list[int] = []
        self.loading: LoadProgress | None = None  # while a load reads weights: how far
        self.load_reported = 0.0  # when the owner was last told (LoadProgress)
        self.load_tells = False  # the load asked for LoadProgress messages
        self.handlers = {op: getattr(self, f"_{op}") for op in REQUESTS}  # an op's handler: _<op>

    # --- lifecycle ----------------------------------------------------------------------------

    def serve_forever(self) -> None:
        ctx = self.ctx = zmq.Context()
        authenticator = None
        if self.keys is not None:  # ZAP handler: only the allowed client keys get in
            authenticator = self.authenticator = ThreadAuthenticator(ctx)
            authenticator.start()
            authenticator.configure_curve_callback(domain="*", credentials_provider=AllowList(self.allow))
        sock = self.sock = ctx.socket(zmq.ROUTER)
        transport.configure_worker(sock, self.max_message_bytes)
        if self.keys is not None:
            security.make_server(sock, self.keys)
        monitor = self.monitor = sock.get_monitor_socket(zmq.EVENT_ACCEPTED | zmq.EVENT_DISCONNECTED)
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, self._on_signal)
        # a signal also writes a byte here, which ends the poll at once (zmq's poll resumes after one)
        woken, waker = socket.socketpair()
        woken.setblocking(False)
        waker.setblocking(False)
        previous_wakeup = signal.set_wakeup_fd(waker.fileno(), warn_on_full_buffer=False)
        socket_file = security.ipc_socket_file(self.listen)
        bound = False
        try:
            security.check_ipc_free(self.listen)
            with security.private_umask():  # the ipc socket file: owner only, whatever the umask
                sock.bind(self.listen)
            bound = True
            if socket_file is not None:
                socket_file.chmod(0o600)
            log.info("listening on %s (%s), device %s, pid %d", self.listen,
                     f"CURVE, {len(self.allow)} allowed client keys" if self.keys else "no encryption",
                     self.device, os.getpid())
            poller = zmq.Poller()
            poller.register(sock, zmq.POLLIN)
            poller.register(monitor, zmq.POLLIN)
            poller.register(woken, zmq.POLLIN)
            while not self.stopping:
                self._answer_grammars()
                if self.deferred:
                    self._serve_one(sock, monitor, self.deferred.popleft())
                    continue
                events = dict(poller.poll(GRAMMAR_POLL_S * 1000 if self._building() else 200))
                if woken.fileno() in events:
                    woken.recv(64)  # (the signal's handler has run: the loop's test sees it)
                if monitor in events:
                    self._drain_monitor(monitor)
                if sock in events:
                    self._serve_one(sock, monitor, sock.recv_multipart(copy=False))
                if self.owner is not None and time.monotonic() - self.owner_seen > self.lease:
                    self.lapsed = self.owner
                    self._reset(f"the orchestrator sent nothing for {self.lease:g}s (its lease lapsed)")
        finally:
            signal.set_wakeup_fd(previous_wakeup)
            woken.close()
            waker.close()
            self._reset("worker stopping")
            sock.disable_monitor()
            monitor.close(linger=0)
            sock.close(linger=0)
            if authenticator is not None:
                authenticator.stop()
            ctx.term()
            if bound and socket_file is not None:
                socket_file.unlink(missing_ok=True)
            log.info("stopped")

    def _on_signal(self, signum: int, _frame: Any) -> None:
        if self.stopping:  # a second signal: the user means it
            os._exit(128 + signum)
        log.info("signal %d: stopping", signum)
        self.stopping = True

    def _drain_monitor(self, monitor: zmq.Socket) -> None:
        if self._owner_left(monitor):
            self._reset("orchestrator disconnected")

    def _owner_left(self, monitor: zmq.Socket) -> bool:
        while monitor.poll(0):
            event = recv_monitor_message(monitor)
            if event["event"] == zmq.EVENT_ACCEPTED:
                self.closed_fds.discard(event["value"])
            elif event["event"] == zmq.EVENT_DISCONNECTED:
                self.closed_fds.add(event["value"])
                if event["value"] == self.owner_fd:
                    self.owner_gone = True
        return self.owner_gone

    def _reset(self, why: str) -> None:
        """Free the model, the caches and the process group; back to idle."""
        if self.state == "idle" and self.owner is None:
            return
        log.info("%s: releasing model and group, back to idle", why)
        self._drop_runner()
        self.held.drop()
        self._close_links()
        group.leave_process_group()
        self.tp = None
        free_memory(self.device)
        self.state, self.owner, self.owner_fd, self.owner_gone = "idle", None, None, False

    # --- one request ----------------------------------------------------------------------------

    def _serve_one(self, sock: zmq.Socket, monitor: zmq.Socket, parts: list) -> None:
        received = time.perf_counter()
        peer, frames = parts[0], parts[1:]
        self._drain_monitor(monitor)  # a stale disconnect must not outlive a new hello
        try:
            request = codec.decode(frames)
            if self._relayed(peer.bytes, request):
                return
            if request.op == "step" and self.last_step_sent is not None:
                self.gap_count, self.gap_total = self.gap_count + 1, self.gap_total + received - self.last_step_sent
            self.last_step_sent = None
            reply = self._dispatch(peer.bytes, _source_fd(frames), request, _peer_address(frames))
            if reply is None:  # answered later (a grammar being built: _answer_grammars)
                return
        except ProtocolError as exc:
            self.errors += 1
            self._log_rejected(exc)
            reply = error_message(codec.peek_id(frames), exc.code, exc.message)
        except CollectiveFailed as exc:  # a peer of the group went away: its story, told in one line
            self.errors += 1
            log.warning("%s", exc)
            reply = error_message(codec.peek_id(frames), ErrorCode.INTERNAL, str(exc))
        except Exception as exc:  # a bug or a device failure: report it, keep serving
            self.errors += 1
            log.error("internal error: %s", traceback.format_exc())
            reply = error_message(codec.peek_id(frames), ErrorCode.INTERNAL, f"{type(exc).__name__}: {exc}")
        with mark("reply"):
            self._reply(sock, peer.bytes, reply)
        if reply.op == "step":
            self.last_step_sent = time.perf_counter()

    def _relayed(self, peer: bytes, msg: Message) -> bool:
        """Queue a stage-link message the orchestrator relayed (no reply); False for anything else."""
        if msg.op not in LINKS:
            return False
        if not isinstance(self.links, RelayedLinks) or peer != self.owner:
            raise ProtocolError(ErrorCode.BAD_REQUEST, f"{msg.op!r} is a stage-link message; this worker takes "
                                "none on this socket")
        self.owner_seen = time.monotonic()
        self.links.queue(msg)
        return True

    def _relay_out(self, msg: Message) -> Any:
        """A stage-link message to the orchestrator, which relays it; never blocks on it."""
        try:
            return transport.send_tracked(self.sock, self.owner, msg)
        except zmq.ZMQError as exc:
            raise ProtocolError(ErrorCode.BAD_STATE, f"cannot relay a {msg.op!r} message through the "
                                f"orchestrator: {exc}") from None

    def _pump(self, seconds: float) -> None:
        """While a step waits on relayed links, or a load reads weights: read this worker's socket for
        up to `seconds`; answer status requests (anyone's) and other peers' requests (busy) now, queue
        the link messages, and keep the owner's other requests for after."""
        if not self.sock.poll(seconds * 1000):
            return
        parts = self.sock.recv_multipart(copy=False)
        peer = parts[0].bytes
        try:
            msg = codec.decode(parts[1:])
        except ProtocolError:
            msg = None  # (the owner's: answered with its error after the step)
        if msg is not None and msg.op == StatusRequest.OP:
            try:
                reply = self._dispatch(peer, None, msg)
            except ProtocolError as exc:
                reply = error_message(msg.id, exc.code, exc.message)
            self._reply(self.sock, peer, reply)
            return
        if peer != self.owner:
            busy = error_message(codec.peek_id(parts[1:]), ErrorCode.BUSY, "this worker serves another orchestrator")
            self._reply(self.sock, peer, busy)
            return
        self.owner_seen = time.monotonic()
        if msg is not None and msg.op in LINKS and self.links is not None:
            self.links.queue(msg)
            return
        self.deferred.append(parts)
        if msg is not None and msg.op == "shutdown":
            raise LinkDropped("the orchestrator said goodbye")

    def _peek_step(self, until: Callable[[], bool]) -> StepRequest | None:
        """The next request, for the runner to launch its pass ahead (runner.py), as soon as it comes
        (None once until() is true, or if another request is queued first), if it is the owner's and
        a step the runner will take as it is: no prompt tensor to check. It stays queued, to be
        served next as usual."""
        if self.deferred:
            return None
        while not self.sock.poll(0):
            if until():
                return None
            time.sleep(PEEK_POLL_S)
        parts = self.sock.recv_multipart(copy=False)
        self.deferred.append(parts)
        if parts[0].bytes != self.owner:
            return None
        try:
            msg = codec.decode(parts[1:])
            ids = msg.tensors.get("prompt_ids", torch.empty(0, dtype=torch.int64))
            if msg.op != "step" or set(msg.tensors) - {"prompt_ids"} or ids.shape != (0,) or ids.dtype != torch.int64:
                return None
            return parse(StepRequest, msg.meta)
        except ProtocolError:
            return None  # its error goes back when it is served

    def _log_rejected(self, exc: ProtocolError) -> None:
        """A rejected request in the log, at most one line a second (a peer that floods bad or
        refused requests must not fill the disk, nor spend the worker's time writing)."""
        now = time.monotonic()
        if now - self.rejected_logged_at < 1.0:
            self.rejected_unlogged += 1
            return
        more = f" ({self.rejected_unlogged} more rejected in the second before)" if self.rejected_unlogged else ""
        log.warning("rejected request: %s%s", exc, more)
        self.rejected_logged_at, self.rejected_unlogged = now, 0

    def _reply(self, sock: zmq.Socket, peer: bytes, reply: Message) -> None:
        """Send without blocking: a peer that does not read loses its replies, never this worker."""
        why_not = transport.send_reply(sock, peer, reply)
        if peer != self.owner:
            return  # a refused peer that does not read, or left: nothing to do
        self.owner_seen = time.monotonic()  # it may have waited for this reply all along
        if why_not is not None and not self.dropping:  # once per run of drops, not per reply
            log.warning("dropping replies to the orchestrator (%r first): %s", reply.op, why_not)
        self.dropping = why_not is not None
        if why_not == transport.PEER_GONE and self.state == "idle":  # its hello was queued before it left
            self._reset("the orchestrator left before its hello was answered")

    def _dispatch(self, peer: bytes, fd: int | None, request: Message, address: str = "") -> Message | None:
        if request.op not in REQUESTS:
            raise ProtocolError(ErrorCode.BAD_MESSAGE, f"{request.op!r} is not a request op")
        body = parse(REQUESTS[request.op], request.meta)
        if request.op == "status":  # anyone's, and no contact with the owner
            return Message(op="status", id=request.id, meta=to_meta(self._status(body, {})[0]))
        if request.op == "hello":
            if self.owner not in (None, peer):
                raise ProtocolError(ErrorCode.BUSY, "this worker serves another orchestrator")
            if self.owner is None and fd in self.closed_fds:  # queued by a client that already left
                raise ProtocolError(ErrorCode.BAD_STATE, "hello from a connection that is closed")
            self.owner, self.owner_fd, self.lapsed = peer, fd, None
            self.owner_address = address
        elif self.owner is None and peer == self.lapsed:
            raise ProtocolError(ErrorCode.BAD_STATE, f"this worker let this orchestrator go: it sent nothing for "
                                f"{self.lease:g} s (the worker's --lease); its model and state are freed, connect "
                                "again")
        elif self.owner is None:
            raise ProtocolError(ErrorCode.BAD_STATE, f"say hello before {request.op!r}")
        elif peer != self.owner:
            raise ProtocolError(ErrorCode.BUSY, "this worker serves another orchestrator")
        self.owner_seen = time.monotonic()
        if request.op == GrammarRequest.OP:
            return self._grammar(body, request.id)
        meta, tensors = self.handlers[request.op](body, request.tensors)
        return Message(op=request.op, id=request.id, meta=to_meta(meta), tensors=tensors or {})

    def _why_abort(self) -> str | None:
        """Why a step waiting on a stage link should give up: its orchestrator left, or a signal."""
        if self.stopping:
            return "the worker is stopping"
        if self.monitor is not None and self._owner_left(self.monitor):
            return "the orchestrator disconnected"
        return None


def _peer_address(frames: list) -> str:
    """Where a message's connection comes from as this worker sees it: an IP address, or over ipc://
    "local pid N" (libzmq gives the peer's credentials there as localhost:UID:GID:PID)."""
    try:
        address = (frames[0].get("Peer-Address") if frames else "") or ""
    except zmq.ZMQError:
        address = ""
    parts = address.split(":")
    if len(parts) == 4 and parts[0] == "localhost":
        return f"local pid {parts[3]}"
    return address or "local"


def _source_fd(frames: list) -> int | None:
    """The file descriptor of the connection a message came on (libzmq's SRCFD), if any."""
    return frames[0].get(zmq.SRCFD) if frames else None
