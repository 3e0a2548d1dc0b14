"""The shard worker daemon: one process per device, serving one orchestrator at a time.

States: idle -> (init) initialized -> (load) loaded; `shutdown` from the orchestrator, losing
its connection, or its lease lapsing (it sent nothing for the lease time) frees everything and
returns to idle. Only SIGINT/SIGTERM end the process.
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
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch
import zmq
from zmq.auth.thread import ThreadAuthenticator
from zmq.utils.monitor import recv_monitor_message

from shardspec import __version__, kernels, security
from shardspec.layers.parallel import TPGroup
from shardspec.protocol import codec, transport
from shardspec.protocol.codec import Message
from shardspec.protocol.errors import ErrorCode, ProtocolError
from shardspec.protocol.messages import (
    LINKS,
    REQUESTS,
    ChunkReply,
    ChunkRequest,
    ErrorReply,
    GrammarReply,
    GrammarRequest,
    HelloReply,
    InitReply,
    InitRequest,
    LoadProgress,
    LoadReply,
    LoadRequest,
    ReleaseReply,
    ReleaseRequest,
    ShardsReply,
    ShardsRequest,
    ShutdownReply,
    StatsReply,
    StatsRequest,
    StatusReply,
    StatusRequest,
    StepReply,
    StepRequest,
    TimelineEvent,
    parse,
    to_meta,
)
from shardspec.security import AllowList, KeyPair
from shardspec.shard_worker import group
from shardspec.shard_worker.links import SPIN_S, LinkDropped, RelayedLinks, StageLinks, open_direct
from shardspec.shard_worker.loading import HeldModel, free_memory, make_runner
from shardspec.shard_worker.profiling import StepProfiler, Timeline, hang_for_test, mark
from shardspec.shard_worker.runner import ModelRunner, RunnerStats
from shardspec.shard_worker.shard_cache import ShardCache
from shardspec.shard_worker.shard_receiver import ShardReceiver
from shardspec.utils import memory_stats, parse_device

log = logging.getLogger("shardspec.worker")

LOAD_REPORT_S = 0.25  # while loading: how often the owner is told how far (LoadProgress), and status answered
GRAMMAR_POLL_S = 0.005  # while grammars are being built: how often the worker looks whether one is done
# launch ahead: while the device runs a step's pass, how often the worker looks for the next request
PEEK_POLL_S = 50e-6


class ShardWorker:
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
            while not self.stopping:
                self._answer_grammars()
                if self.deferred:
                    self._serve_one(sock, monitor, self.deferred.popleft())
                    continue
                events = dict(poller.poll(GRAMMAR_POLL_S * 1000 if self._building() else 200))
                if monitor in events:
                    self._drain_monitor(monitor)
                if sock in events:
                    self._serve_one(sock, monitor, sock.recv_multipart(copy=False))
                if self.owner is not None and time.monotonic() - self.owner_seen > self.lease:
                    self._reset(f"the orchestrator sent nothing for {self.lease:g}s (its lease lapsed)")
        finally:
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
            reply = _error(codec.peek_id(frames), exc.code, exc.message)
        except Exception as exc:  # a bug or a device failure: report it, keep serving
            self.errors += 1
            log.error("internal error: %s", traceback.format_exc())
            reply = _error(codec.peek_id(frames), ErrorCode.INTERNAL, f"{type(exc).__name__}: {exc}")
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
                reply = _error(msg.id, exc.code, exc.message)
            self._reply(self.sock, peer, reply)
            return
        if peer != self.owner:
            busy = _error(codec.peek_id(parts[1:]), ErrorCode.BUSY, "this worker serves another orchestrator")
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
            self.owner, self.owner_fd = peer, fd
            self.owner_address = address
        elif self.owner is None:
            raise ProtocolError(ErrorCode.BAD_STATE, f"say hello before {request.op!r}")
        elif peer != self.owner:
            raise ProtocolError(ErrorCode.BUSY, "this worker serves another orchestrator")
        self.owner_seen = time.monotonic()
        if request.op == GrammarRequest.OP:
            return self._grammar(body, request.id)
        meta, tensors = self.handlers[request.op](body, request.tensors)
        return Message(op=request.op, id=request.id, meta=to_meta(meta), tensors=tensors or {})

    # --- grammars: built off the steps, answered when built ----------------------------------------

    def _grammar(self, body: GrammarRequest, request_id: int) -> Message | None:
        """Start building a grammar on the last stage (None: answered when built); a stage before
        the last holds none and answers at once."""
        store = getattr(self._loaded(), "grammars", None)
        if store is not None and not store.build(request_id, body.key, body.grammar, body.drop):
            return None
        return Message(op=GrammarRequest.OP, id=request_id, meta=to_meta(GrammarReply(body.key, 0.0)))

    def _building(self) -> bool:
        store = getattr(self.runner, "grammars", None)
        return store is not None and bool(store.waiting)

    def _answer_grammars(self, error: str = "") -> None:
        """Answer the grammar requests whose build is done (`error`: every one still waiting, with it)."""
        store = getattr(self.runner, "grammars", None)
        if store is None or not store.waiting:
            return
        for built in store.abandon(error) if error else store.done():
            if built.error:
                reply = _error(built.request_id, ErrorCode.BAD_REQUEST, built.error)
            else:
                reply = Message(op=GrammarRequest.OP, id=built.request_id,
                                meta=to_meta(GrammarReply(built.key, built.seconds)))
            if self.owner is not None:
                self._reply(self.sock, self.owner, reply)

    # --- ops ----------------------------------------------------------------------------------

    def _load_progress(self, progress: LoadProgress) -> None:
        """After each tensor a load reads: tell the owner (at most every LOAD_REPORT_S, and at the
        end), answer the status requests that came meanwhile, and stop if the owner left or said
        goodbye."""
        self.loading = progress
        now = time.monotonic()
        if now - self.load_reported >= LOAD_REPORT_S or progress.tensors_done == progress.tensors_total:
            self.load_reported = now
            if self.owner is not None and self.load_tells:
                transport.send_reply(self.sock, self.owner, Message(LoadProgress.OP, 0, to_meta(progress)))
            try:
                self._pump(0)
            except LinkDropped as exc:  # (its goodbye stays queued: served after the load's error)
                raise ProtocolError(ErrorCode.BAD_STATE, f"load stopped: {exc}") from None
            if (why := self._why_abort()) is not None:
                raise ProtocolError(ErrorCode.BAD_STATE, f"load stopped: {why}")

    def _status(self, _body: StatusRequest, _tensors: dict) -> tuple[StatusReply, None]:
        mem = memory_stats()
        state = "loading" if self.loading is not None else self.state
        return StatusReply(state=state, owner=self.owner_address if self.owner is not None else "",
                           version=__version__, device=str(self.device), hostname=socket.gethostname(),
                           pid=os.getpid(), uptime_s=time.monotonic() - self.started, rss_bytes=mem["rss_bytes"],
                           device_bytes=torch.cuda.memory_allocated(self.device) if self.device.type == "cuda" else 0,
                           model=self.model_name if self.runner is not None or self.loading else "",
                           rank=self.rank, world_size=self.world_size if self.tp else 0,
                           stage=self.stage, stages=self.stages, layers=list(self.layers) if self.runner else [],
                           loading=self.loading), None

    def _hello(self, body: Any, _tensors: dict) -> tuple[HelloReply, None]:
        reply = HelloReply(
            protocol=codec.PROTOCOL_VERSION,
            version=__version__,
            device=str(self.device),
            pid=os.getpid(),
            hostname=socket.gethostname(),
            state=self.state,
        )
        return reply, None

    def _init(self, body: InitRequest, _tensors: dict) -> tuple[InitReply, None]:
        if self.state != "idle":
            raise ProtocolError(ErrorCode.BAD_STATE, f"worker is {self.state}; send shutdown before init")
        if self.device.type == "cpu" and self.threads is None:
            group.share_cores(body.host_ranks)
        kernels.use(body.options)  # the whole process's, before the group's all-reduce choice and the model
        self.tp, backend = group.join(body, self.device, self._why_abort, local=self.listen.startswith("ipc://"))
        if self.tp.shm is not None:
            self.tp.shm.abort = self._why_abort
        try:
            self.stage, self.stages = body.stage, body.stages
            self.rank, self.world_size = body.rank, body.world_size
            if body.stages > 1:
                self.links = self._open_links(body)
        except BaseException:
            self.tp = None
            group.leave_process_group()  # back to idle as it was
            raise
        self.state = "initialized"
        return InitReply(rank=body.rank, world_size=body.world_size, backend=backend, stage=body.stage,
                         tp_rank=self.tp.rank, tp_size=self.tp.size, collectives=self.tp.path), None

    def _open_links(self, body: InitRequest) -> StageLinks:
        if body.relay:
            log.info("stage %d of %d; stage links relayed through the orchestrator", body.stage, body.stages)
            links: StageLinks = RelayedLinks(self._relay_out, self._pump, body.timeout_s, abort=self._why_abort)
        else:
            links = open_direct(self.ctx, body, self.listen, self.heartbeat_timeout, self._why_abort, self.keys,
                                self.authenticator)
            log.info("stage %d of %d; stage link at %s%s", body.stage, body.stages, body.links[body.rank],
                     " (CURVE)" if body.link_keys else "")
        if self.device.type == "cuda":
            links.spin_s = SPIN_S
        return links

    def _why_abort(self) -> str | None:
        """Why a step waiting on a stage link should give up: its orchestrator left, or a signal."""
        if self.stopping:
            return "the worker is stopping"
        if self.monitor is not None and self._owner_left(self.monitor):
            return "the orchestrator disconnected"
        return None

    def _close_links(self) -> None:
        links, self.links = self.links, None
        if links is not None:
            links.close()

    def _load(self, body: LoadRequest, _tensors: dict) -> tuple[LoadReply, None]:
        """Load the model (or keep the one loaded, if it is the same) and build fresh caches."""
        if self.state == "idle":
            raise ProtocolError(ErrorCode.BAD_STATE, "worker is idle; load needs an initialized worker")
        self.receiver.finished()
        plan = self.held.plan(body, self.stage, self.stages)
        started = time.perf_counter()
        self._drop_runner()  # a load replaces every sequence and cache
        self.state = "initialized"
        free_memory(self.device)
        self.loading, self.load_reported, self.load_tells = LoadProgress(), 0.0, body.progress
        try:
            model = self.held.load(body, plan, self.tp, self._load_progress)
        finally:
            self.loading = None
        draft_len = body.draft_tokens if plan.mtp else 0
        # with more ranks, each would decide alone when its next request is here: no launch ahead
        peek = self._peek_step if self.tp.size == 1 else None
        self.runner = make_runner(model, self.device, body, draft_len, self.links, peek, plan.checkpoint.folder)
        self.state = "loaded"
        self.gap_count, self.gap_total, self.steps, self.step_total_s = 0, 0.0, 0, 0.0
        load_s = time.perf_counter() - started
        weight_bytes = self.held.weight_bytes
        log.info("loaded %.1f MB of weights, %.1f MB of cache in %.1fs; MTP drafts per step: %d",
                 weight_bytes / 1e6, self.runner.cache_bytes / 1e6, load_s, draft_len)
        config, stage = model.config, model.stage
        self.model_name, self.layers = Path(body.model).name, [stage.start, stage.end]
        reply = LoadReply(
            weight_bytes=weight_bytes,
            cache_bytes=self.runner.cache_bytes,
            dtype=str(plan.dtype).removeprefix("torch."),
            vocab_size=config.vocab_size,
            num_layers=config.num_hidden_layers,
            layers=[stage.start, stage.end],
            has_mtp=plan.mtp,
            draft_tokens=draft_len,
            max_seq_len=self.runner.max_seq_len,
            eos_token_ids=config.eos_token_ids,
            load_s=load_s,
            rss_bytes=memory_stats()["rss_bytes"],
            kv_blocks=self.runner.paging.kv_blocks,
            block_tokens=self.runner.paging.block_tokens,
            step_span=self.runner.paging.span,
            prefix_states=self.runner.prefix_states,
            keeps_finished_state=self.runner.keeps_finished_state,
        )
        return reply, None

    def _shards(self, body: ShardsRequest, tensors: dict) -> tuple[ShardsReply, None]:
        if self.state == "idle":
            raise ProtocolError(ErrorCode.BAD_STATE, "worker is idle; shards needs an initialized worker")
        return self.receiver.offer(body, tensors, self.stage, self.stages), None

    def _chunk(self, body: ChunkRequest, tensors: dict) -> tuple[ChunkReply, None]:
        return self.receiver.chunk(body, tensors), None

    def _drop_runner(self) -> None:
        self.profiler.close()
        self._answer_grammars(error="the model was unloaded before the grammar was built")
        runner, self.runner = self.runner, None
        if runner is not None:
            runner.close()

    def _step(self, body: StepRequest, tensors: dict) -> tuple[StepReply, dict]:
        runner = self._loaded()
        if set(tensors) - {"prompt_ids"}:
            raise ProtocolError(ErrorCode.BAD_REQUEST, f"step takes one tensor 'prompt_ids', got {sorted(tensors)}")
        prompt_ids = tensors.get("prompt_ids", torch.empty(0, dtype=torch.int64))
        self.timeline.add(self.steps + 1, "request")  # (the step's number on the links)
        started = time.perf_counter()
        hang_for_test()
        self.profiler.before(self.steps)
        with mark("step"):
            result = runner.step(body, prompt_ids)
        self.profiler.after(self.steps, self.device)
        self.steps += 1
        step_s = time.perf_counter() - started
        self.step_total_s += step_s
        reply = result.reply(step_s=step_s)
        self.timeline.add(self.steps, "reply")
        return reply, result.tensors()

    def _release(self, body: ReleaseRequest, _tensors: dict) -> tuple[ReleaseReply, None]:
        runner = self._loaded()
        released = runner.release(body.seqs, body.saves)
        return ReleaseReply(released=released, free_slots=len(runner.table.slots.free)), None

    def _stats(self, body: StatsRequest, _tensors: dict) -> tuple[StatsReply, None]:
        mem = memory_stats()
        link_wait = self.links.waited_s if self.links is not None else 0.0
        runner = self.runner.stats() if self.runner is not None else RunnerStats()
        reply = StatsReply(
            state=self.state,
            device=str(self.device),
            rank=self.tp.rank if self.tp else -1,
            world_size=self.tp.size if self.tp else 0,
            rss_bytes=mem["rss_bytes"],
            rss_anon_bytes=mem["rss_anon_bytes"],
            device_bytes=torch.cuda.memory_allocated(self.device) if self.device.type == "cuda" else 0,
            weight_bytes=self.held.weight_bytes,
            steps=self.steps,
            errors=self.errors,
            step_gaps=self.gap_count,
            step_gap_total_s=self.gap_total,
            busy_s=self.step_total_s - link_wait,
            link_wait_s=link_wait,
            collectives=self.tp.path if self.tp else "",
            **asdict(runner),
            options=kernels.settings,
            timeline=self._timeline() if body.timeline else [],
        )
        return reply, None

    def _timeline(self) -> list[TimelineEvent]:
        """This worker's and its stage links' step events, oldest first."""
        events = [*self.timeline.events, *(self.links.timeline.events if self.links is not None else [])]
        return [TimelineEvent(step, event, at) for step, event, at in sorted(events, key=lambda e: e[2])]

    def _shutdown(self, _body: Any, _tensors: dict) -> tuple[ShutdownReply, None]:
        self._reset("orchestrator said goodbye")
        return ShutdownReply(), None

    def _loaded(self) -> ModelRunner:
        if self.runner is None:
            raise ProtocolError(ErrorCode.BAD_STATE, f"worker is {self.state}; load a model first")
        return self.runner


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
def _error(request_id: int, code: ErrorCode, message: str) -> Message:
    return Message(op="error", id=request_id, meta=to_meta(ErrorReply(code=str(code), message=message)))
