"""The asyncio engine: connects to the workers, loads the model and runs the step loop.

Requests enter a queue; one scheduler task admits them into free cache slots and sends `step`
commands to every worker (the same command to each rank). Workers keep all sequence state — the
pending token and the MTP drafts — so a step command carries only sequence ids, and the loop keeps
the next step on the wire before the current step's reply is read (pipelining): a worker finishing
step N finds step N+1 already queued on its socket.

Failures: a worker that exits or stops answering heartbeats fails the requests in flight with an
error naming it; the engine then says goodbye to the others and reconnects until every worker
answers again (a supervisor restarted it), joins them in a new process group, loads the model and
serves again.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import os
import random
import time
from collections import deque
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import torch
import zmq.asyncio

from shardspec import security
from shardspec.orchestrator.tokenizer import Detokenizer, Tokenizer
from shardspec.orchestrator.workers import (
    LocalWorkers,
    WorkerClient,
    WorkerLost,
    free_port,
    wait_ready,
)
from shardspec.protocol import transport
from shardspec.protocol.errors import ErrorCode, RemoteError
from shardspec.protocol.messages import (
    MAX_DRAFT_TOKENS,
    InitRequest,
    LoadRequest,
    PrefillSpec,
    ReleaseRequest,
    SamplingParams,
    ShutdownRequest,
    StatsRequest,
    StepRequest,
)
from shardspec.utils import DTYPE_CHOICES, check_address

log = logging.getLogger("shardspec.orchestrator")

FORCED_ACCEPTANCE_ENV = "SHARDSPEC_BENCHMARK_FORCED_ACCEPTANCE"
DEFAULT_DRAFT_TOKENS = 3
DEFAULT_DIST_TIMEOUT_S = 60.0  # a collective waiting longer for a peer fails, and its worker goes back to idle
RECONNECT_HELLO_S = 10.0  # per attempt at reaching every worker again after a failure
RECONNECT_PAUSE_S = 1.0
GOODBYE_TIMEOUT_S = 5.0
# errors of one request that leave the workers' group consistent; any other error of a step means
# the ranks may no longer agree, so the engine rebuilds the group
REQUEST_ERRORS = frozenset({ErrorCode.BAD_REQUEST, ErrorCode.NOT_FOUND, ErrorCode.CAPACITY})


class EngineError(RuntimeError):
    """Generation failed on the workers; the message says which and why."""


@dataclass
class Chunk:
    """New tokens of one request; the last chunk has finish_reason and stats."""

    token_ids: list[int]
    text: str = ""
    finish_reason: str | None = None
    stats: dict[str, Any] | None = None


class StepObserver(Protocol):
    """Told about every step's reply (e.g. serving metrics); must not block."""

    def on_step(self, step_s: float, accepted: list[int]) -> None:
        """step_s: the slowest rank's step time; accepted: drafts accepted per sequence (-1: prefill)."""


@dataclass
class _Request:
    seq: int
    prompt: list[int]
    max_tokens: int
    sampling: SamplingParams
    stop_ids: list[int]
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)
    generated: int = 0
    cancelled: bool = False
    finished: bool = False
    started: float = field(default_factory=time.perf_counter)
    first_token_at: float | None = None
    drafts: int = 0  # verify steps with drafts
    accepted_tokens: int = 0
    accepted_per_position: list[int] = field(default_factory=list)


@dataclass
class _Step:
    """A step on the wire: one future per worker."""

    futures: list[asyncio.Future]


class Engine:
    """Use `connect(...)`; the constructor only stores what `_start` sets up."""

    def __init__(self) -> None:
        self.ctx = zmq.asyncio.Context()
        self.workers: list[WorkerClient] = []
        self.local: LocalWorkers | None = None
        self.tokenizer: Tokenizer | None = None
        self.waiting: deque[_Request] = deque()
        self.running: dict[int, _Request] = {}
        self.wakeup = asyncio.Event()
        self.seq_ids = itertools.count(1)
        self.loop_task: asyncio.Task | None = None
        self.load_info: Any = None
        self.max_slots = 0
        self.pipeline_depth = 2
        self.forced_acceptance: float | None = None
        self.closed = False
        self.observer: StepObserver | None = None
        self.lost: str | None = None  # why the workers are being (or cannot be) reconnected
        # what reconnecting needs, set by _start
        self.addresses: list[str] = []
        self.curve: list[tuple] = []
        self.dist_port: int | None = None
        self.dist_timeout = DEFAULT_DIST_TIMEOUT_S
        self.heartbeat_timeout = transport.DEFAULT_HEARTBEAT_TIMEOUT_S
        self.load_request: LoadRequest | None = None

    @property
    def draft_tokens(self) -> int:
        """MTP drafts per step; 0 when MTP is off."""
        return self.load_info.draft_tokens

    @property
    def failure(self) -> str | None:
        """Why the engine cannot serve requests now, or None when it can."""
        if self.closed or self.loop_task is None:
            return "the engine is not running"
        if self.lost is not None:
            return self.lost if self.loop_task.done() else f"{self.lost}; reconnecting to the workers"
        if self.loop_task.done():
            return "the engine's step loop stopped"
        if (lost := self._worker_failure()) is not None:
            return lost
        try:
            if self.local is not None:
                self.local.check_alive()
        except WorkerLost as exc:
            return str(exc)
        return None

    @property
    def healthy(self) -> bool:
        return self.failure is None

    # --- start and stop -------------------------------------------------------------------------

    async def _start(self, model: str, workers: list[str] | None, local: int | None, device: str, tp: int | None,
                     dtype: str, max_slots: int, max_seq_len: int, prefill_chunk: int, mtp: bool | None,
                     draft_tokens: int, pipeline: bool, forced_acceptance: float | None, dist_port: int | None,
                     connect_timeout: float, keys: str | None = None, server_keys: str | None = None,
                     heartbeat_timeout: float = transport.DEFAULT_HEARTBEAT_TIMEOUT_S,
                     dist_timeout: float = DEFAULT_DIST_TIMEOUT_S) -> None:
        addresses = _worker_addresses(workers, local, tp)
        curve = _curve_keys(keys, server_keys, addresses)
        self.heartbeat_timeout = transport.check_heartbeat_timeout(heartbeat_timeout)
        self.dist_timeout = _check_dist_timeout(dist_timeout)
        if dtype not in DTYPE_CHOICES:
            raise ValueError(f"dtype must be one of {DTYPE_CHOICES}, got {dtype!r}")
        if type(draft_tokens) is not int or not 1 <= draft_tokens <= MAX_DRAFT_TOKENS:
            raise ValueError(f"draft_tokens must be an integer in [1, {MAX_DRAFT_TOKENS}], got {draft_tokens!r}")
        _check_forced_acceptance(forced_acceptance, mtp)
        model_dir = Path(model)
        if workers is None and not (model_dir / "config.json").is_file():
            raise ValueError(f"{model} is not a model folder (no config.json)")
        if mtp and model_dir.is_dir() and not _has_mtp(model_dir):
            raise ValueError(f"MTP asked for, but {model} has no MTP weights (mtp.*); use mtp=False / --no-mtp")
        self.tokenizer = Tokenizer.from_folder(model_dir) if model_dir.is_dir() else None
        self.pipeline_depth = 2 if pipeline else 1
        self.forced_acceptance = forced_acceptance
        if addresses is None:
            self.local = LocalWorkers(local or tp or 1, device, self.heartbeat_timeout)
            addresses = self.local.addresses
        self.addresses, self.curve = addresses, curve or [(None, None)] * len(addresses)
        self.dist_port = dist_port
        self.load_request = LoadRequest(
            model=str(model_dir.resolve()) if model_dir.exists() else model,
            dtype=dtype,
            max_slots=max_slots,
            max_seq_len=max_seq_len,
            prefill_chunk=prefill_chunk,
            mtp={None: "auto", True: "on", False: "off"}[mtp],
            draft_tokens=draft_tokens,
            forced_acceptance=-1.0 if forced_acceptance is None else forced_acceptance,
        )
        await self._connect(connect_timeout)
        self.max_slots = max_slots
        self.loop_task = asyncio.create_task(self._run())

    async def _connect(self, hello_timeout: float) -> None:
        """Fresh connections to every worker: hello, a new process group, load."""
        self.workers = [WorkerClient(self.ctx, address, *link, heartbeat_timeout=self.heartbeat_timeout,
                                     on_failure=self.wakeup.set) for address, link in zip(self.addresses, self.curve)]
        hellos = await asyncio.gather(*(wait_ready(w, self.local, hello_timeout) for w in self.workers),
                                      return_exceptions=True)
        if errors := [hello for hello in hellos if isinstance(hello, BaseException)]:
            raise errors[0]
        for worker, hello in zip(self.workers, hellos):
            log.info("worker %s: pid %d on %s, device %s", worker.address, hello.pid, hello.hostname, hello.device)
        dist_addr = _rendezvous(self.addresses[0], self.dist_port)
        await self._all(lambda rank: InitRequest(rank=rank, world_size=len(self.workers), dist_addr=dist_addr,
                                                 timeout_s=self.dist_timeout))
        self.load_info = (await self._all(lambda rank: self.load_request))[0][0]

    async def _disconnect(self) -> None:
        """Goodbye to the workers still connected (each leaves the group and goes idle); close all."""
        live = [w for w in self.workers if w.failure is None]
        await asyncio.gather(*(w.call(ShutdownRequest(), timeout=GOODBYE_TIMEOUT_S) for w in live),
                             return_exceptions=True)
        await asyncio.gather(*(w.close() for w in self.workers))

    async def close(self) -> None:
        """Say goodbye to the workers, stop spawned ones, fail what is still running."""
        if self.closed:
            return
        self.closed = True
        if self.loop_task is not None:  # let the steps in flight finish, then stop the loop
            self.wakeup.set()
            if self.lost is not None:  # reconnecting: nothing in flight to wait for
                self.loop_task.cancel()
            try:
                await asyncio.wait_for(self.loop_task, 30)
            except (TimeoutError, asyncio.CancelledError):
                pass
        for request in [*self.waiting, *self.running.values()]:
            request.queue.put_nowait(EngineError("the engine was closed"))
        await self._disconnect()
        if self.local is not None:
            self.local.stop()
        self.ctx.term()

    # --- the API --------------------------------------------------------------------------------

    async def generate(
        self,
        prompt: str | list[int],
        max_tokens: int = 128,
        temperature: float = 0.0,
        top_k: int = 0,
        top_p: float = 1.0,
        seed: int | None = None,
        stop_at_eos: bool = True,
    ) -> AsyncIterator[Chunk]:
        """Stream the completion of `prompt` (text, or token ids) as Chunks."""
        request = self._new_request(prompt, max_tokens, temperature, top_k, top_p, seed, stop_at_eos)
        detok = Detokenizer(self.tokenizer) if self.tokenizer else None
        self.waiting.append(request)
        self.wakeup.set()
        try:
            while True:
                item = await request.queue.get()
                if isinstance(item, Exception):
                    raise item
                if detok is not None:
                    item.text = detok.add(item.token_ids, final=item.finish_reason is not None)
                yield item
                if item.finish_reason is not None:
                    return
        finally:
            if not request.finished:
                request.cancelled = True
                self.wakeup.set()

    async def stats(self) -> list[Any]:
        """Every worker's StatsReply, in rank order."""
        return [reply for reply, _ in await self._all(lambda rank: StatsRequest(), timeout=30)]

    # --- requests -------------------------------------------------------------------------------

    def _new_request(self, prompt, max_tokens, temperature, top_k, top_p, seed, stop_at_eos) -> _Request:
        if (failure := self.failure) is not None:
            raise EngineError(failure)
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("this model folder has no tokenizer.json: pass token ids instead of text")
            ids = self.tokenizer.encode(prompt)
        else:
            ids = list(prompt)
        vocab = self.load_info.vocab_size
        if not ids:
            raise ValueError("the prompt is empty")
        if not all(type(t) is int and 0 <= t < vocab for t in ids):
            raise ValueError(f"prompt token ids must be integers in [0, {vocab})")
        if type(max_tokens) is not int or max_tokens < 1:
            raise ValueError(f"max_tokens must be a positive integer, got {max_tokens!r}")
        if len(ids) + max_tokens > self.load_info.max_seq_len:
            raise ValueError(
                f"prompt ({len(ids)} tokens) + max_tokens ({max_tokens}) exceeds the context of "
                f"{self.load_info.max_seq_len} tokens"
            )
        if seed is None:
            seed = random.getrandbits(63)
        try:
            sampling = SamplingParams(float(temperature), int(top_k), float(top_p), int(seed))
        except (TypeError, ValueError) as exc:
            raise ValueError(f"bad sampling parameters: {exc}") from None
        if not 0 <= sampling.temperature <= 100 or sampling.top_k < 0 or not 0 <= sampling.seed < 2**63:
            raise ValueError("temperature must be in [0, 100], top_k >= 0, seed in [0, 2**63)")
        stop_ids = list(self.load_info.eos_token_ids) if stop_at_eos else []
        return _Request(next(self.seq_ids), ids, max_tokens, sampling, stop_ids,
                        accepted_per_position=[0] * self.draft_tokens)

    # --- the step loop --------------------------------------------------------------------------

    async def _run(self) -> None:
        """The step loop; after losing a worker, reconnect and run it again."""
        while True:
            await self._step_loop()
            if self.closed or not await self._recover():
                return

    async def _step_loop(self) -> None:
        """Run steps until the engine closes, or a worker is lost (self.lost then says which)."""
        inflight: deque[_Step] = deque()
        while not self.closed or inflight:
            self.lost = self.lost or self._worker_failure()
            if self.lost is not None:
                self._fail_all(inflight, EngineError(self.lost))
                return
            self._drop_cancelled()
            while not self.closed and len(inflight) < self.pipeline_depth and self._has_work():
                inflight.append(self._send_step())
            if not inflight:
                self.wakeup.clear()
                if not self.closed:
                    await self.wakeup.wait()
                continue
            try:
                replies = await self._step_replies(inflight.popleft())
                self._deliver(replies)
            except Exception as exc:
                if _breaks_group(exc):
                    self.lost = str(exc)
                    self._fail_all(inflight, EngineError(self.lost))
                    return
                for step in inflight:  # later steps built on the failed one: drop them too
                    await asyncio.gather(*step.futures, return_exceptions=True)
                inflight.clear()
                await self._fail_running(exc)

    async def _step_replies(self, step: _Step) -> list[tuple]:
        """The step's replies from every rank; on an error, the most telling one. A rank that dies
        makes its peers' collectives fail too, often before its own connection is seen to drop:
        give that a heartbeat timeout to show, and report the lost worker rather than its peers."""
        futures = step.futures
        try:
            await asyncio.wait(futures, return_when=asyncio.FIRST_EXCEPTION)
            if not _errors(futures):
                return [future.result() for future in futures]
            if not any(isinstance(e, WorkerLost) for e in _errors(futures)):
                await asyncio.wait(futures, timeout=self.heartbeat_timeout)
            errors = _errors(futures)
            raise next((e for e in errors if isinstance(e, WorkerLost)), errors[0])
        finally:
            for future in futures:
                future.cancel()

    def _worker_failure(self) -> str | None:
        return next((str(w.failure) for w in self.workers if w.failure is not None), None)

    def _fail_all(self, inflight: deque[_Step], exc: Exception) -> None:
        """Fail every request, running or waiting, and forget the steps on the wire."""
        log.error("%s: failing %d requests", exc, len(self.running) + len(self.waiting))
        for step in inflight:
            for future in step.futures:
                future.cancel()
        inflight.clear()
        for request in [*self.running.values(), *self.waiting]:
            request.finished = True
            request.queue.put_nowait(exc)
        self.running.clear()
        self.waiting.clear()

    async def _recover(self) -> bool:
        """Reconnect to the workers until they all answer and load again; False if that cannot be."""
        cause = self.lost
        while not self.closed:
            await self._disconnect()
            if self.local is not None:  # this engine is the supervisor of the workers it spawned
                try:
                    self.local.restart_exited()
                except WorkerLost as exc:
                    self.lost = str(exc)
                    return False
            try:
                await self._connect(RECONNECT_HELLO_S)
            except (WorkerLost, RemoteError, EngineError) as exc:
                log.warning("reconnecting after %r: %s; trying again", cause, exc)
                await asyncio.sleep(RECONNECT_PAUSE_S)
                continue
            log.warning("the workers are back after %r; serving again", cause)
            self.lost = None
            return True
        return False

    def _has_work(self) -> bool:
        return bool(self.running) or (bool(self.waiting) and len(self.running) < self.max_slots)

    def _send_step(self) -> _Step:
        decode = list(self.running)
        admitted = []
        while self.waiting and len(self.running) < self.max_slots:
            request = self.waiting.popleft()
            self.running[request.seq] = request
            admitted.append(request)
        step = StepRequest(
            prefill=[PrefillSpec(r.seq, len(r.prompt), r.sampling, r.max_tokens, r.stop_ids) for r in admitted],
            decode=decode,
        )
        tensors = {"prompt_ids": torch.tensor([t for r in admitted for t in r.prompt], dtype=torch.int64)}
        return _Step([w.submit(step, tensors) for w in self.workers])

    def _deliver(self, replies: list[tuple]) -> None:
        first = replies[0][0]
        for reply, _ in replies[1:]:
            if reply.tokens != first.tokens or reply.accepted != first.accepted:
                raise EngineError("workers disagree on the sampled tokens; the group is inconsistent")
        if self.observer is not None:
            self.observer.on_step(max(reply.step_s for reply, _ in replies), first.accepted)
        now = time.perf_counter()
        finished = []
        for seq, tokens, accepted, finish in zip(first.seqs, first.tokens, first.accepted, first.finished):
            request = self.running.get(seq)
            if request is None:  # cancelled while this step was in flight
                continue
            request.first_token_at = request.first_token_at or now
            request.generated += len(tokens)
            if accepted >= 0 and self.draft_tokens:
                request.drafts += 1
                request.accepted_tokens += accepted
                for j in range(accepted):
                    request.accepted_per_position[j] += 1
            chunk = Chunk(tokens)
            if finish:
                chunk.finish_reason, chunk.stats = finish, self._request_stats(request, now)
                request.finished = True
                finished.append(request)
            request.queue.put_nowait(chunk)
        self._release(finished)

    def _drop_cancelled(self) -> None:
        self.waiting = deque(r for r in self.waiting if not r.cancelled)
        self._release([r for r in self.running.values() if r.cancelled])

    def _release(self, requests: list[_Request]) -> None:
        """Free the slots: the release goes on the wire behind the steps already sent."""
        if not requests:
            return
        for request in requests:
            self.running.pop(request.seq, None)
        release = ReleaseRequest([r.seq for r in requests])
        futures = [w.submit(release) for w in self.workers]
        asyncio.ensure_future(asyncio.gather(*futures, return_exceptions=True))  # failures surface in the next step

    async def _fail_running(self, exc: Exception) -> None:
        log.error("step failed: %s", exc)
        failed = list(self.running.values())
        self.running.clear()
        for request in failed:
            request.finished = True
            request.queue.put_nowait(EngineError(str(exc)))
        if failed and all(w.failure is None for w in self.workers):
            await asyncio.gather(
                *(w.call(ReleaseRequest([r.seq for r in failed]), timeout=30) for w in self.workers),
                return_exceptions=True,
            )

    def _request_stats(self, request: _Request, now: float) -> dict[str, Any]:
        elapsed = now - request.started
        first = request.first_token_at or now
        stats = {
            "prompt_tokens": len(request.prompt),
            "generated_tokens": request.generated,
            "tokens_per_s": request.generated / elapsed if elapsed > 0 else 0.0,
            "decode_tokens_per_s": (request.generated - 1) / (now - first) if now > first else 0.0,
            "time_to_first_token_s": first - request.started,
        }
        if self.draft_tokens:
            stats |= spec_decode_metrics(request.drafts, self.draft_tokens, request.accepted_tokens,
                                         request.accepted_per_position)
        if self.forced_acceptance is not None:
            stats["forced_acceptance"] = self.forced_acceptance
        return stats

    # --- talking to all workers -----------------------------------------------------------------

    async def _all(self, make_request: Callable[[int], Any], tensors: dict | None = None,
                   timeout: float | None = None) -> list[tuple]:
        """Send one request to every worker (rank order) and wait for all replies."""
        return await self._gather([w.submit(make_request(rank), tensors) for rank, w in enumerate(self.workers)],
                                  timeout)

    async def _gather(self, futures: list[asyncio.Future], timeout: float | None = None) -> list[tuple]:
        """All replies, in order; the first error raises and the remaining futures are cancelled."""
        try:
            done, pending = await asyncio.wait(futures, timeout=timeout, return_when=asyncio.FIRST_EXCEPTION)
            for future in futures:
                if future in done and future.exception() is not None:
                    raise future.exception()
            if pending:
                raise WorkerLost(f"the workers did not answer within {timeout:.0f}s")
            return [future.result() for future in futures]
        finally:
            for future in futures:
                future.cancel()


def spec_decode_metrics(drafts: int, k: int, accepted: int, per_position: list[int]) -> dict[str, Any]:
    """The speculative-decoding figures of a request or a worker, from its counters."""
    return {
        "drafts": drafts,
        "draft_tokens": drafts * k,
        "accepted_tokens": accepted,
        "acceptance_per_position": [n / drafts if drafts else 0.0 for n in per_position],
        "mean_acceptance_length": 1 + accepted / drafts if drafts else 1.0,
    }


def _errors(futures: list[asyncio.Future]) -> list[BaseException]:
    return [f.exception() for f in futures if f.done() and not f.cancelled() and f.exception() is not None]


def _breaks_group(exc: Exception) -> bool:
    """After this error of a step, can the ranks still be trusted to agree?"""
    if isinstance(exc, RemoteError):
        return exc.code not in REQUEST_ERRORS
    return not isinstance(exc, EngineError)  # EngineError: the ranks disagreed; their sequences are failed


def _check_dist_timeout(seconds: Any) -> float:
    if type(seconds) not in (int, float) or not 1 <= seconds <= 3600:
        raise ValueError(f"dist_timeout must be a number of seconds in [1, 3600], got {seconds!r}")
    return float(seconds)


def _check_forced_acceptance(rate: float | None, mtp: bool | None) -> None:
    if rate is None:
        return
    if os.environ.get(FORCED_ACCEPTANCE_ENV) != "1":
        raise ValueError(
            f"forced acceptance is a benchmarking switch that changes the output; set {FORCED_ACCEPTANCE_ENV}=1 "
            "to enable it"
        )
    if not 0.0 <= rate <= 1.0:
        raise ValueError(f"forced acceptance must be a probability in [0, 1], got {rate}")
    if mtp is False:
        raise ValueError("forced acceptance needs MTP on")


def _has_mtp(model_dir: Path) -> bool:
    from shardspec.models.loader import has_mtp  # safetensors headers only

    try:
        return has_mtp(model_dir)
    except Exception:
        return True  # unreadable here: let the workers say what is wrong


def _worker_addresses(workers: list[str] | None, local: int | None, tp: int | None) -> list[str] | None:
    if workers is not None and local is not None:
        raise ValueError("give either workers (addresses) or local (a count), not both")
    if workers is not None:
        if not workers:
            raise ValueError("workers is an empty list")
        for address in workers:
            check_address(address)
        if tp is not None and tp != len(workers):
            raise ValueError(f"tp={tp} but {len(workers)} worker addresses given; tp must equal the worker count")
        return list(workers)
    count = local or tp or 1
    if type(count) is not int or count < 1:
        raise ValueError(f"local must be a positive worker count, got {count!r}")
    if tp is not None and local is not None and tp != local:
        raise ValueError(f"tp={tp} but local={local}; tp must equal the worker count")
    return None


def _curve_keys(keys: str | None, server_keys: str | None, addresses: list[str] | None) -> list[tuple]:
    """Per worker: (this side's key pair, that worker's public key); [] without CURVE."""
    if keys is None and server_keys is None:
        return []
    if keys is None or server_keys is None:
        raise ValueError("CURVE needs both keys (this side's pair) and server_keys (the workers' public keys)")
    if addresses is None:
        raise ValueError("keys apply to workers given by address (tcp://); spawned local workers use ipc://")
    count = len(addresses)
    try:
        pair, publics = security.load_pair(keys), security.load_public_keys(server_keys)
    except security.KeyFileError as exc:
        raise ValueError(str(exc)) from None
    if len(publics) not in (1, count):
        raise ValueError(f"server_keys holds {len(publics)} public keys for {count} workers: give one, or one per worker")
    return [(pair, publics[i % len(publics)]) for i in range(count)]


def _rendezvous(rank0_address: str, port: int | None) -> str:
    """Where rank 0 hosts the torch.distributed store: its own host, next port up by default."""
    if rank0_address.startswith("tcp://"):
        host, rank0_port = rank0_address[len("tcp://") :].rsplit(":", 1)
        return f"tcp://{host}:{port or int(rank0_port) + 1}"
    return f"tcp://127.0.0.1:{port or free_port()}"


@asynccontextmanager
async def connect(
    model: str,
    workers: list[str] | None = None,
    local: int | None = None,
    device: str = "cpu",
    tp: int | None = None,
    dtype: str = "auto",
    max_slots: int = 8,
    max_seq_len: int = 4096,
    prefill_chunk: int = 2048,
    mtp: bool | None = None,
    draft_tokens: int = DEFAULT_DRAFT_TOKENS,
    pipeline: bool = True,
    forced_acceptance: float | None = None,
    dist_port: int | None = None,
    connect_timeout: float = 120.0,
    keys: str | None = None,
    server_keys: str | None = None,
    heartbeat_timeout: float = transport.DEFAULT_HEARTBEAT_TIMEOUT_S,
    dist_timeout: float = DEFAULT_DIST_TIMEOUT_S,
) -> AsyncIterator[Engine]:
    """Connect to (or spawn) workers, load `model` on them, and yield a ready Engine.

    mtp: None = speculative decoding with the checkpoint's MTP head when it has one; True = require
    it; False = plain decoding. prefill_chunk: the most prompt tokens one prefill pass takes (prompts
    prefilled together share it, at least 64 tokens each). draft_tokens: MTP drafts per step.
    pipeline: keep the next step on the wire while the current one runs. forced_acceptance: benchmarks only (see FORCED_ACCEPTANCE_ENV).
    keys / server_keys: CURVE for tcp:// workers — this side's key pair (a folder or .key_secret file)
    and the workers' public keys (one .key file for all, or a folder with one per worker, rank order).
    heartbeat_timeout: seconds after which a worker that exited or stopped answering is declared
    lost; its requests fail, and the engine reconnects until the worker is back (engine.healthy).
    dist_timeout: how long a worker's collective waits for a stuck peer before it gives up.
    """
    engine = Engine()
    try:
        await engine._start(model, workers, local, device, tp, dtype, max_slots, max_seq_len, prefill_chunk, mtp,
                            draft_tokens, pipeline, forced_acceptance, dist_port, connect_timeout, keys, server_keys,
                            heartbeat_timeout, dist_timeout)
        yield engine
    finally:
        await engine.close()
