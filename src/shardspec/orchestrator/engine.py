"""The asyncio engine: connects to the workers, loads the model and runs the step loop.

Requests enter a queue; one scheduler task admits them into free cache slots, sends one `step`
to every worker (the same command to each rank), and routes the new tokens back to each request's
stream. Workers keep all sequence state, so a step command carries only ids.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import random
import time
from collections import deque
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import zmq.asyncio

from shardspec.orchestrator.tokenizer import Detokenizer, Tokenizer
from shardspec.orchestrator.workers import LocalWorkers, WorkerClient, WorkerLost, free_port, wait_ready
from shardspec.protocol.messages import (
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


class EngineError(RuntimeError):
    """Generation failed on the workers; the message says which and why."""


@dataclass
class Chunk:
    """New tokens of one request; the last chunk has finish_reason and stats."""

    token_ids: list[int]
    text: str = ""
    finish_reason: str | None = None
    stats: dict[str, Any] | None = None


@dataclass
class _Request:
    seq: int
    prompt: list[int]
    max_tokens: int
    sampling: SamplingParams
    stop_ids: frozenset[int]
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)
    generated: int = 0
    cancelled: bool = False
    finished: bool = False
    started: float = field(default_factory=time.perf_counter)
    first_token_at: float | None = None


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
        self.closed = False

    # --- start and stop -------------------------------------------------------------------------

    async def _start(
        self,
        model: str,
        workers: list[str] | None,
        local: int | None,
        device: str,
        tp: int | None,
        dtype: str,
        max_slots: int,
        max_seq_len: int,
        prefill_chunk: int,
        dist_port: int | None,
        connect_timeout: float,
    ) -> None:
        addresses = _worker_addresses(workers, local, tp)
        if dtype not in DTYPE_CHOICES:
            raise ValueError(f"dtype must be one of {DTYPE_CHOICES}, got {dtype!r}")
        model_dir = Path(model)
        if workers is None and not (model_dir / "config.json").is_file():
            raise ValueError(f"{model} is not a model folder (no config.json)")
        self.tokenizer = Tokenizer.from_folder(model_dir) if model_dir.is_dir() else None
        if addresses is None:
            self.local = LocalWorkers(local or tp or 1, device)
            addresses = self.local.addresses
        self.workers = [WorkerClient(self.ctx, address) for address in addresses]
        hellos = await asyncio.gather(*(wait_ready(w, self.local, connect_timeout) for w in self.workers))
        for worker, hello in zip(self.workers, hellos):
            log.info("worker %s: pid %d on %s, device %s", worker.address, hello.pid, hello.hostname, hello.device)

        dist_addr = _rendezvous(addresses[0], dist_port)
        await self._all(
            lambda rank: InitRequest(rank=rank, world_size=len(addresses), dist_addr=dist_addr), timeout=None
        )
        replies = await self._all(
            lambda rank: LoadRequest(str(model_dir.resolve()) if model_dir.exists() else model, dtype,
                                     max_slots, max_seq_len, prefill_chunk),
            timeout=None,
        )
        self.load_info = replies[0][0]
        self.max_slots = max_slots
        self.loop_task = asyncio.create_task(self._step_loop())

    async def close(self) -> None:
        """Say goodbye to the workers, stop spawned ones, fail what is still running."""
        if self.closed:
            return
        self.closed = True
        if self.loop_task is not None:  # let a step or release in flight finish, then stop the loop
            self.wakeup.set()
            try:
                await asyncio.wait_for(self.loop_task, 30)
            except (TimeoutError, asyncio.CancelledError):
                pass
        for request in [*self.waiting, *self.running.values()]:
            request.queue.put_nowait(EngineError("the engine was closed"))
        live = [w for w in self.workers if w.failure is None]
        await asyncio.gather(*(w.call(ShutdownRequest(), timeout=5) for w in live), return_exceptions=True)
        await asyncio.gather(*(w.close() for w in self.workers))
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

    # --- the step loop --------------------------------------------------------------------------

    def _new_request(self, prompt, max_tokens, temperature, top_k, top_p, seed, stop_at_eos) -> _Request:
        if self.closed or self.loop_task is None:
            raise EngineError("the engine is not running")
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
        stop_ids = frozenset(self.load_info.eos_token_ids) if stop_at_eos else frozenset()
        return _Request(next(self.seq_ids), ids, max_tokens, sampling, stop_ids)

    async def _step_loop(self) -> None:
        while not self.closed:
            await self._release([r for r in self.running.values() if r.cancelled])
            self.waiting = deque(r for r in self.waiting if not r.cancelled)
            if not self.waiting and not self.running:
                self.wakeup.clear()
                await self.wakeup.wait()
                continue
            admitted = []
            while self.waiting and len(self.running) + len(admitted) < self.max_slots:
                admitted.append(self.waiting.popleft())
            decoding = list(self.running.values())
            for request in admitted:
                self.running[request.seq] = request
            try:
                results = await self._step(admitted, decoding)
            except Exception as exc:
                await self._fail_running(exc)
                continue
            await self._deliver(results)

    async def _step(self, admitted: list[_Request], decoding: list[_Request]) -> dict[int, list[int]]:
        step = StepRequest(
            prefill=[PrefillSpec(r.seq, len(r.prompt), r.sampling) for r in admitted],
            decode=[r.seq for r in decoding],
        )
        tensors = {"prompt_ids": torch.tensor([t for r in admitted for t in r.prompt], dtype=torch.int64)}
        replies = await self._all(lambda rank: step, tensors=tensors)
        first = replies[0][0]
        for reply, _ in replies[1:]:
            if reply.tokens != first.tokens:  # ranks sampled differently: never go on from that
                raise EngineError("workers disagree on the sampled tokens; the group is inconsistent")
        return dict(zip(first.seqs, first.tokens))

    async def _deliver(self, results: dict[int, list[int]]) -> None:
        done = []
        now = time.perf_counter()
        for seq, tokens in results.items():
            request = self.running[seq]
            if request.cancelled:
                continue
            request.first_token_at = request.first_token_at or now
            tokens = tokens[: request.max_tokens - request.generated]
            finish = None
            for i, token in enumerate(tokens):
                if token in request.stop_ids:
                    tokens, finish = tokens[: i + 1], "stop"
                    break
            request.generated += len(tokens)
            if finish is None and request.generated >= request.max_tokens:
                finish = "length"
            chunk = Chunk(tokens)
            if finish is not None:
                chunk.finish_reason, chunk.stats = finish, _request_stats(request, now)
                request.finished = True
                done.append(request)
            request.queue.put_nowait(chunk)
        await self._release(done)

    async def _release(self, requests: list[_Request]) -> None:
        if not requests:
            return
        for request in requests:
            self.running.pop(request.seq, None)
        try:
            await self._all(lambda rank: ReleaseRequest([r.seq for r in requests]), timeout=60)
        except Exception as exc:
            await self._fail_running(exc)

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

    async def _all(self, make_request, tensors: dict | None = None, timeout: float | None = None) -> list[tuple]:
        """Send one request to every worker (rank order) and wait for all replies; the first error raises."""
        futures = [w.submit(make_request(rank), tensors) for rank, w in enumerate(self.workers)]
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


def _request_stats(request: _Request, now: float) -> dict[str, Any]:
    elapsed = now - request.started
    return {
        "prompt_tokens": len(request.prompt),
        "generated_tokens": request.generated,
        "tokens_per_s": request.generated / elapsed if elapsed > 0 else 0.0,
        "time_to_first_token_s": (request.first_token_at or now) - request.started,
    }


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
    prefill_chunk: int = 512,
    dist_port: int | None = None,
    connect_timeout: float = 120.0,
) -> AsyncIterator[Engine]:
    """Connect to (or spawn) workers, load `model` on them, and yield a ready Engine."""
    engine = Engine()
    try:
        await engine._start(model, workers, local, device, tp, dtype, max_slots, max_seq_len, prefill_chunk,
                            dist_port, connect_timeout)
        yield engine
    finally:
        await engine.close()
