"""Links between pipeline stages, worker to worker: each pass's hidden states go from a stage to the
next, and each step's acceptance record goes from the last stage back to every earlier one.

A worker of a group of several stages binds one PULL socket (its link address) and connects a PUSH
socket to each rank it sends to, at its own TP place in the other stage: the next stage's rank
(hidden states) and, on the last stage, the earlier stages' ranks (records). The messages are the
protocol's frames — a msgpack header, the hidden states as one raw tensor frame — validated on
arrival like any other; nothing goes through the orchestrator. Links are FIFO per sender, and every
stage runs the same passes in the same order, so each message is checked against the step and pass
its receiver expects.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from pathlib import Path

import torch
import zmq

from shardspec.protocol import codec, transport
from shardspec.protocol.codec import Message
from shardspec.protocol.errors import ErrorCode, ProtocolError
from shardspec.protocol.messages import LINKS, AcceptRecord, HiddenStates, StepReply, parse, to_meta

POLL_S = 0.1  # how often a wait on a link looks at what could end it


def bind_address(link: str, listen: str) -> str:
    """Where a worker listening on `listen` binds the link its peers reach at `link`: the link's
    port on the worker's own listen host (peers may know the host by another name)."""
    if link.startswith("tcp://") and listen.startswith("tcp://"):
        return f"{listen.rsplit(':', 1)[0]}:{link.rsplit(':', 1)[1]}"
    return link


class StageLinks:
    """`abort` is asked, while a receive waits, whether to give up and why (the worker's orchestrator
    left); a peer stage's link that drops (its worker died, or stopped answering heartbeats) ends the
    wait too, so that a lost stage surfaces within the heartbeat timeout, not the link timeout."""

    def __init__(self, ctx: zmq.Context, bind: str, next_stage: str | None, earlier_stages: list[str],
                 timeout_s: float, heartbeat_timeout: float, abort: Callable[[], str | None] = lambda: None):
        self.timeout_s = timeout_s
        self.abort = abort
        self.bound = bind
        self.inbox = ctx.socket(zmq.PULL)
        transport.configure(self.inbox, heartbeat_timeout)
        self.inbox.bind(bind)
        self.dropped = self.inbox.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        self.next_stage = self._push(ctx, next_stage, heartbeat_timeout) if next_stage else None
        self.earlier_stages = [self._push(ctx, address, heartbeat_timeout) for address in earlier_stages]
        self.pending: dict[str, deque[Message]] = {op: deque() for op in LINKS}

    @staticmethod
    def _push(ctx: zmq.Context, address: str, heartbeat_timeout: float) -> zmq.Socket:
        sock = ctx.socket(zmq.PUSH)
        transport.configure(sock, heartbeat_timeout)
        sock.connect(address)
        return sock

    def send_hidden(self, step: int, index: int, hidden: torch.Tensor) -> None:
        meta = to_meta(HiddenStates(step, index))
        transport.send(self.next_stage, Message(HiddenStates.OP, 0, meta, {"hidden": hidden.contiguous()}))

    def recv_hidden(self, step: int, index: int, like: torch.Tensor) -> torch.Tensor:
        """The hidden states of pass `index` of step `step`, as [*like.shape, H] of the model's dtype on its device."""
        msg = self._take(HiddenStates.OP, "hidden states from the stage before")
        body = parse(HiddenStates, msg.meta)
        hidden = msg.tensors.get("hidden")
        if (body.step, body.index) != (step, index):
            raise ProtocolError(ErrorCode.INTERNAL, f"stage link out of step: expected pass {index} of step {step}, "
                                f"got pass {body.index} of step {body.step}")
        if hidden is None or hidden.dim() != like.dim() + 1 or list(hidden.shape[:-1]) != list(like.shape):
            shape = None if hidden is None else list(hidden.shape)
            raise ProtocolError(ErrorCode.BAD_MESSAGE, f"hidden states of shape {shape} for a pass over "
                                f"{list(like.shape)} tokens")
        return hidden

    def send_record(self, step: int, reply: StepReply) -> None:
        msg = Message(AcceptRecord.OP, 0, to_meta(AcceptRecord(step, reply)))
        for sock in self.earlier_stages:
            transport.send(sock, msg)

    def recv_record(self, step: int) -> StepReply:
        body = parse(AcceptRecord, self._take(AcceptRecord.OP, "the last stage's acceptance record").meta)
        if body.step != step:
            raise ProtocolError(ErrorCode.INTERNAL, f"stage link out of step: expected the record of step {step}, "
                                f"got step {body.step}'s")
        return body.reply

    def _take(self, op: str, what: str) -> Message:
        """The next `op` message, keeping the other kind for later (two senders share the inbox)."""
        deadline = time.monotonic() + self.timeout_s
        while not self.pending[op]:
            if self.dropped.poll(0):
                raise ProtocolError(ErrorCode.BAD_STATE, f"waiting for {what}: a stage link dropped (a peer stage's "
                                    "worker exited or stopped answering)")
            if (why := self.abort()) is not None:
                raise ProtocolError(ErrorCode.BAD_STATE, f"gave up waiting for {what}: {why}")
            left = deadline - time.monotonic()
            if left <= 0:
                raise ProtocolError(ErrorCode.BAD_STATE, f"no {what} within {self.timeout_s:g}s")
            if not self.inbox.poll(min(left, POLL_S) * 1000):
                continue
            msg = codec.decode(self.inbox.recv_multipart(copy=False))
            if msg.op not in LINKS:
                raise ProtocolError(ErrorCode.BAD_MESSAGE, f"{msg.op!r} is not a stage-link message")
            self.pending[msg.op].append(msg)
        return self.pending[op].popleft()

    def close(self) -> None:
        self.inbox.disable_monitor()
        self.dropped.close(linger=0)
        for sock in [self.inbox, *([self.next_stage] if self.next_stage else []), *self.earlier_stages]:
            sock.close(linger=0)
        if self.bound.startswith("ipc://"):
            Path(self.bound[len("ipc://") :]).unlink(missing_ok=True)
