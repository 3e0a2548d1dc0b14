"""Links between pipeline stages: each pass's hidden states go from a stage to the next, and each
step's acceptance record goes from the last stage back to every earlier one.

The messages are the protocol's frames — a msgpack header, the hidden states as one raw tensor
frame — validated on arrival like any other. Links are FIFO per sender, and every stage runs the
same passes in the same order, so each message is checked against the step and pass its receiver
expects. Two ways to carry them:

- `DirectLinks` (the default): worker to worker. A worker binds one PULL socket (its link address)
  and connects a PUSH socket to each rank it sends to, at its own TP place in the other stage: the
  next stage's rank (hidden states) and, on the last stage, the earlier stages' ranks (records).
  With CURVE keys, the PULL socket takes messages only from the ranks that send to it.
- `RelayedLinks`: through the orchestrator, for hosts that reach the orchestrator but not each
  other. A worker sends link messages to its orchestrator on its own connection; the orchestrator
  reads their headers and forwards the frames unchanged to the ranks they are for.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
import zmq
from zmq.utils.monitor import recv_monitor_message

from shardspec.protocol import codec, transport
from shardspec.protocol.codec import Message
from shardspec.protocol.errors import ErrorCode, ProtocolError
from shardspec.protocol.messages import (
    LINKS,
    AcceptRecord,
    Guesses,
    HiddenStates,
    InitRequest,
    StepReply,
    parse,
    to_meta,
)
from shardspec.security import AllowList, KeyPair, ipc_socket_file, make_client, make_server, private_umask
from shardspec.shard_worker.profiling import Timeline, mark

POLL_S = 0.1  # how often a wait on a link looks at what could end it
# a GPU worker's wait on a link spins (polls without sleeping) this long before it blocks: a 16 KB
# round trip over ipc:// between two processes on an H200 machine is 72 µs spinning, 95 µs blocked
# (bench/host_latency.py), and a pipeline step waits on two messages; a CPU worker does not spin (it
# would take the cores its peers compute on)
SPIN_S = 0.02
LINK_DOMAIN = "shardspec-links"  # the ZAP domain of the stage links' CURVE check
LINK_UP_S = 5.0  # at init: how long a stage link may take to connect before the worker says it cannot


def bind_address(link: str, listen: str) -> str:
    """Where a worker listening on `listen` binds the link its peers reach at `link`: the link's
    port on the worker's own listen host (peers may know the host by another name)."""
    if link.startswith("tcp://") and listen.startswith("tcp://"):
        return f"{listen.rsplit(':', 1)[0]}:{link.rsplit(':', 1)[1]}"
    return link


class StageLinks:
    """What both carriers share: the queues of arrived messages, the waits, the checks.

    `abort` is asked, while a receive waits, whether to give up and why (the worker's orchestrator
    left); a carrier may end a wait sooner (a peer's connection dropped)."""

    def __init__(self, timeout_s: float, abort: Callable[[], str | None]):
        self.timeout_s = timeout_s
        self.abort = abort
        self.spin_s = 0.0  # how long a wait spins before it blocks (SPIN_S on GPU workers)
        self.pending: dict[str, deque[Message]] = {op: deque() for op in LINKS}
        self.waited_s = 0.0  # in receives: the time this stage had nothing to do but wait
        self.staging = PinnedStaging()
        self.timeline = Timeline()  # the worker's (the daemon sets its own): when messages leave and come

    # --- what the runner calls --------------------------------------------------------------------

    def send_hidden(self, step: int, index: int, hidden: torch.Tensor, kind: str = "pass") -> None:
        meta = to_meta(HiddenStates(step, index, kind))
        self.timeline.add(step, "send hidden")
        with mark("link send"):
            tensor = self.staging.host_copy(hidden)
            self.staging.sent(self._send_next(Message(HiddenStates.OP, 0, meta, {"hidden": tensor})))

    def recv_hidden(self, step: int, index: int, tokens: tuple[int, ...],
                    guess_row: int | None = None) -> tuple[torch.Tensor, str]:
        """The hidden states of pass `index` of step `step` over `tokens` [B, T], as [B, T, H] (on the
        host), and the message's kind. The last stage says which row of this pass's lookahead held
        (`guess_row`; a tree's lookahead has a row per branch): a lookahead message is then taken only
        when one did (>= 0) and the message is this pass's, that row of it, and otherwise dropped (a
        redo follows it, or its sequence finished) and the next one read. None (a stage before the
        last): the next message, whatever its kind."""
        self.timeline.add(step, "wait hidden")
        while True:
            msg = self._take(HiddenStates.OP, "hidden states from the stage before")
            body = parse(HiddenStates, msg.meta)
            ours = guess_row is not None and guess_row >= 0 and (body.step, body.index) == (step, index)
            if guess_row is None or body.kind != "lookahead" or ours:
                break
        hidden = msg.tensors.get("hidden")
        if hidden is not None and body.kind == "lookahead" and guess_row is not None:
            if hidden.dim() != 3 or not (hidden.shape[0] == 1 or 0 <= guess_row < hidden.shape[0]):
                raise ProtocolError(ErrorCode.BAD_MESSAGE, f"a lookahead of {list(hidden.shape)} has no row "
                                    f"{guess_row}")
            hidden = hidden[guess_row : guess_row + 1] if hidden.shape[0] > 1 else hidden  # (cut before: one row)
        if (body.step, body.index) != (step, index):
            raise ProtocolError(ErrorCode.INTERNAL, f"stage link out of step: expected pass {index} of step {step}, "
                                f"got pass {body.index} of step {body.step}")
        if hidden is None or list(hidden.shape[:-1]) != list(tokens):
            shape = None if hidden is None else list(hidden.shape)
            raise ProtocolError(ErrorCode.BAD_MESSAGE, f"hidden states of shape {shape} for a pass over "
                                f"{list(tokens)} tokens")
        self.timeline.add(step, "got hidden")
        return hidden, body.kind

    def send_record(self, step: int, reply: StepReply, guessed: bool = False) -> None:
        record = AcceptRecord(step, reply, guessed)
        self.timeline.add(step, "send record")
        with mark("link send"):
            self._send_earlier(Message(AcceptRecord.OP, 0, to_meta(record)))

    def recv_record(self, step: int) -> AcceptRecord:
        self.timeline.add(step, "wait record")
        body = parse(AcceptRecord, self._take(AcceptRecord.OP, "the last stage's acceptance record").meta)
        self.timeline.add(step, "got record")
        if body.step != step:
            raise ProtocolError(ErrorCode.INTERNAL, f"stage link out of step: expected the record of step {step}, "
                                f"got step {body.step}'s")
        return body

    def has_record(self, step: int) -> bool:
        """Whether the last stage's record of `step` has come (what arrived is read, without waiting)."""
        try:
            for _ in range(64):  # (a carrier's poll reads a message or so at a time)
                before = sum(map(len, self.pending.values()))
                self._poll(0)
                if sum(map(len, self.pending.values())) == before:
                    break
        except LinkDropped:
            return False  # (the wait that follows says so)
        return any(parse(AcceptRecord, m.meta).step == step for m in self.pending[AcceptRecord.OP])

    def send_guesses(self, step: int, guesses: dict[int, list[int]]) -> None:
        meta = to_meta(Guesses(step, list(guesses), list(guesses.values())))
        self.timeline.add(step, "send guesses")
        with mark("link send"):
            self._send_earlier(Message(Guesses.OP, 0, meta))

    def recv_guesses(self, step: int) -> dict[int, list[int]]:
        """The guesses of step `step` by sequence (its record said they follow); those of earlier
        steps, which no lookahead took, are dropped on the way."""
        while True:
            body = parse(Guesses, self._take(Guesses.OP, "the last stage's guesses").meta)
            if body.step >= step:
                break
        if body.step != step:
            raise ProtocolError(ErrorCode.INTERNAL, f"stage link out of step: expected the guesses of step {step}, "
                                f"got step {body.step}'s")
        return dict(zip(body.seqs, body.guesses))

    def drop_guesses(self, before: int) -> None:
        """Drop the guesses of steps before `before` that have come and that no lookahead took."""
        queue = self.pending[Guesses.OP]
        while queue and parse(Guesses, queue[0].meta).step < before:
            queue.popleft()

    def arrived(self, frames: Sequence[Any]) -> None:
        """Queue a link message that came in (validated here; a bad one raises ProtocolError)."""
        self.queue(codec.decode(frames))

    def queue(self, msg: Message) -> None:
        if msg.op not in LINKS:
            raise ProtocolError(ErrorCode.BAD_MESSAGE, f"{msg.op!r} is not a stage-link message")
        self.pending[msg.op].append(msg)

    # --- the carrier's part -----------------------------------------------------------------------

    def _send_next(self, msg: Message) -> Any:
        raise NotImplementedError

    def _send_earlier(self, msg: Message) -> None:
        raise NotImplementedError

    def _poll(self, seconds: float) -> None:
        """Wait up to `seconds` for messages to arrive (into `pending`); raise if the wait must end."""
        raise NotImplementedError

    def close(self) -> None:
        self.staging.close()

    # --- waiting ----------------------------------------------------------------------------------

    def _take(self, op: str, what: str) -> Message:
        """The next `op` message, keeping the other kind for later (two senders share the inbox)."""
        started = time.monotonic()
        deadline, spin_until = started + self.timeout_s, started + self.spin_s
        with mark("link wait"):
            try:
                while not self.pending[op]:
                    if (why := self.abort()) is not None:
                        raise ProtocolError(ErrorCode.BAD_STATE, f"gave up waiting for {what}: {why}")
                    left = deadline - time.monotonic()
                    if left <= 0:
                        raise ProtocolError(ErrorCode.BAD_STATE, f"no {what} within {self.timeout_s:g}s")
                    try:
                        self._poll(0 if time.monotonic() < spin_until else min(left, POLL_S))
                    except LinkDropped as exc:
                        raise ProtocolError(ErrorCode.BAD_STATE, f"waiting for {what}: {exc}") from None
                return self.pending[op].popleft()
            finally:
                self.waited_s += time.monotonic() - started


class LinkDropped(Exception):
    """A wait on a link cannot succeed any more (a peer's connection dropped, the orchestrator said goodbye)."""


class DirectLinks(StageLinks):
    """Worker to worker over ZeroMQ PUSH -> PULL. With `keys`, every link is CURVE: the inbox is a
    server that lets in only `senders` (the public keys of the ranks that send to it, checked by the
    worker's ZAP handler under LINK_DOMAIN), and each outgoing socket checks its peer's key."""

    def __init__(self, ctx: zmq.Context, bind: str, next_stage: str | None, earlier_stages: list[str],
                 timeout_s: float, heartbeat_timeout: float, abort: Callable[[], str | None] = lambda: None,
                 keys: KeyPair | None = None, peer_keys: dict[str, bytes] | None = None, max_bytes: int = 0):
        super().__init__(timeout_s, abort)
        self.bound: str | None = None
        self.inbox = ctx.socket(zmq.PULL)
        transport.configure(self.inbox, heartbeat_timeout)
        if max_bytes:
            self.inbox.setsockopt(zmq.MAXMSGSIZE, max_bytes)
        if keys is not None:
            make_server(self.inbox, keys)
            self.inbox.zap_domain = LINK_DOMAIN.encode()
        self.outgoing: dict[str, zmq.Socket] = {}
        self.handshakes: dict[str, zmq.Socket] = {}  # monitors of the outgoing links, until they are up
        try:
            with private_umask():  # an ipc:// inbox: owner only, as the worker's own socket
                self.inbox.bind(bind)
            if (socket_file := ipc_socket_file(bind)) is not None:
                socket_file.chmod(0o600)
            self.bound = bind
            self.dropped = self.inbox.get_monitor_socket(zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_DISCONNECTED)
            self.peers: set[int] = set()  # descriptors of the connections through the handshake (CURVE: peers)
            for address in [*([next_stage] if next_stage else []), *earlier_stages]:
                self._push(ctx, address, heartbeat_timeout, keys, (peer_keys or {}).get(address))
        except BaseException:
            self.close()
            raise
        self.next_stage = next_stage
        self.earlier_stages = earlier_stages

    def _push(self, ctx: zmq.Context, address: str, heartbeat_timeout: float, keys: KeyPair | None,
              server_key: bytes | None) -> None:
        sock = self.outgoing[address] = ctx.socket(zmq.PUSH)
        transport.configure(sock, heartbeat_timeout)
        if keys is not None:
            make_client(sock, keys, server_key)
        self.handshakes[address] = sock.get_monitor_socket(zmq.EVENT_HANDSHAKE_SUCCEEDED)  # before connecting
        sock.connect(address)

    def unreachable(self, timeout_s: float) -> list[str]:
        """The peers whose link is not up within `timeout_s` (connected, and through the handshake)."""
        waiting = set(self.handshakes)
        deadline = time.monotonic() + timeout_s
        while waiting and (left := deadline - time.monotonic()) > 0:
            poller = zmq.Poller()
            for address in waiting:
                poller.register(self.handshakes[address], zmq.POLLIN)
            for monitor, _ in poller.poll(left * 1000):
                monitor.recv_multipart()
                waiting -= {a for a, m in self.handshakes.items() if m is monitor}
        self._stop_watching_handshakes()
        return sorted(waiting)

    def _stop_watching_handshakes(self) -> None:
        for address, monitor in self.handshakes.items():
            self.outgoing[address].disable_monitor()
            monitor.close(linger=0)
        self.handshakes.clear()

    def _send_next(self, msg: Message) -> Any:
        return transport.send(self.outgoing[self.next_stage], msg)

    def _send_earlier(self, msg: Message) -> None:
        for address in self.earlier_stages:
            transport.send(self.outgoing[address], msg)

    def _poll(self, seconds: float) -> None:
        while self.dropped.poll(0):  # a connection refused by CURVE never got through: its drop is no peer's
            event = recv_monitor_message(self.dropped)
            if event["event"] == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                self.peers.add(event["value"])
            elif event["value"] in self.peers:
                raise LinkDropped("a stage link dropped (a peer stage's worker exited or stopped answering)")
        if self.inbox.poll(seconds * 1000):
            self.arrived(self.inbox.recv_multipart(copy=False))

    def close(self) -> None:
        super().close()
        self._stop_watching_handshakes()
        if hasattr(self, "dropped"):
            self.inbox.disable_monitor()
            self.dropped.close(linger=0)
        for sock in [self.inbox, *self.outgoing.values()]:
            sock.close(linger=0)
        if self.bound is not None and self.bound.startswith("ipc://"):
            Path(self.bound[len("ipc://") :]).unlink(missing_ok=True)


class RelayedLinks(StageLinks):
    """Through the orchestrator: `send` puts a link message on the worker's own connection (the
    orchestrator forwards it by its op and sender), and `pump` reads that connection for up to the
    given seconds, handing link messages back through `queue` (and keeping other requests for
    after the step; it raises LinkDropped when the orchestrator says goodbye meanwhile)."""

    def __init__(self, send: Callable[[Message], Any], pump: Callable[[float], None], timeout_s: float,
                 abort: Callable[[], str | None] = lambda: None):
        super().__init__(timeout_s, abort)
        self.send, self.pump = send, pump

    def _send_next(self, msg: Message) -> Any:
        return self.send(msg)

    def _send_earlier(self, msg: Message) -> None:
        self.send(msg)  # one message: the orchestrator fans it out to every earlier stage

    def _poll(self, seconds: float) -> None:
        self.pump(seconds)


class PinnedStaging:
    """Host buffers for hidden states leaving a GPU: one explicit device-to-host copy into a pinned
    buffer that is reused once ZeroMQ has let go of it (its send tracker is done)."""

    def __init__(self) -> None:
        self.buffers: list[tuple[torch.Tensor, Any]] = []  # (pinned buffer, tracker of its last send)
        self.last: torch.Tensor | None = None

    def host_copy(self, tensor: torch.Tensor) -> torch.Tensor:
        """`tensor` itself when on the host; else a pinned copy of it (the copy is complete on return)."""
        tensor = tensor.detach().contiguous()
        if tensor.device.type == "cpu":
            self.last = None
            return tensor
        buffer = self._free(tensor.numel() * tensor.element_size())
        host = buffer[: tensor.numel() * tensor.element_size()].view(tensor.dtype).view(tensor.shape)
        host.copy_(tensor)  # synchronous: the bytes are there before ZeroMQ reads them
        self.last = buffer
        return host

    def sent(self, tracker: Any) -> None:
        """The tracker of the send that took the last host copy."""
        if self.last is not None:
            self.buffers = [(b, tracker if b is self.last else t) for b, t in self.buffers]
            self.last = None

    def _free(self, nbytes: int) -> torch.Tensor:
        for i, (buffer, tracker) in enumerate(self.buffers):
            if buffer.numel() >= nbytes and (tracker is None or tracker.done):
                self.buffers[i] = (buffer, None)
                return buffer
        buffer = torch.empty(max(nbytes, 1 << 16), dtype=torch.uint8, pin_memory=True)
        self.buffers.append((buffer, None))
        return buffer

    def close(self) -> None:
        self.buffers.clear()


def open_direct(ctx: zmq.Context, body: InitRequest, listen: str, heartbeat_timeout: float,
                abort: Callable[[], str | None], keys: KeyPair | None, authenticator: Any) -> DirectLinks:
    """This rank's links worker to worker, up: its inbox bound, its outgoing sockets connected to the
    next stage's rank (or, on the last stage, to the earlier stages' ranks at its TP place). With
    CURVE (`keys`), the inbox lets in the ranks that send to it and no one else."""
    if keys is not None and not body.link_keys:
        raise ProtocolError(ErrorCode.BAD_REQUEST, "this worker has CURVE keys: its stage links need every "
                            "rank's public key (link_keys), or relay")
    last = body.stage == body.stages - 1
    peers = [body.peer(body.stage + 1)] if not last else [body.peer(s) for s in range(body.stage)]
    senders = [body.peer(body.stage - 1)] if body.stage else []
    if not last:
        senders.append(body.peer(body.stages - 1))  # the last stage's records
    peer_keys = {body.links[r]: body.link_keys[r].encode() for r in peers} if body.link_keys else None
    if authenticator is not None:
        allowed = AllowList([body.link_keys[r].encode() for r in senders])
        authenticator.configure_curve_callback(domain=LINK_DOMAIN, credentials_provider=allowed)
    bind = bind_address(body.links[body.rank], listen)
    try:
        links = DirectLinks(ctx, bind, None if last else body.links[peers[0]],
                            [body.links[r] for r in peers] if last else [], body.timeout_s,
                            heartbeat_timeout, abort=abort, keys=keys, peer_keys=peer_keys,
                            max_bytes=body.link_max_bytes)
    except zmq.ZMQError as exc:
        raise ProtocolError(ErrorCode.UNREACHABLE, f"cannot open the stage link at {bind}: {exc}") from None
    if unreachable := links.unreachable(LINK_UP_S):
        links.close()
        raise ProtocolError(ErrorCode.UNREACHABLE, f"stage links to {', '.join(unreachable)} not up within "
                            f"{LINK_UP_S:g}s")
    return links
