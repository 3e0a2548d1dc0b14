"""The asyncio engine: `generate` streams in, one step loop driving the workers, and `connect`.

Requests enter the scheduler's queue; one task, the step loop, sends each step the scheduler builds
to every worker (the same command to each rank) and delivers the replies to the requests' streams.
Workers keep all sequence state — the pending token and the MTP drafts — so a step command carries
only sequence ids, and the loop keeps the next step on the wire before the current step's reply is
read (pipelining): a worker finishing step N finds step N+1 already queued on its socket.

When a worker is lost, the loop fails every request with the cause and the worker group reconnects
(group.py) before the loop runs again.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import itertools
import logging
import time
from collections import deque
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from shardspec.constraints import added_tokens
from shardspec.orchestrator import request_values as values
from shardspec.orchestrator.blocks import BlockPool
from shardspec.orchestrator.config import EngineConfig
from shardspec.orchestrator.grammars import GrammarCompiler, Grammars
from shardspec.orchestrator.group import WorkerGroup
from shardspec.orchestrator.prefix import PrefixCache
from shardspec.orchestrator.requests import Chunk, EngineError, Request, StepObserver, deliver
from shardspec.orchestrator.scheduler import ScheduledStep, Scheduler
from shardspec.orchestrator.tokenizer import Detokenizer, Tokenizer
from shardspec.orchestrator.workers import WorkerLost
from shardspec.protocol.errors import ErrorCode, RemoteError
from shardspec.protocol.messages import (
    LoadProgress,
    LoadReply,
    LoadRequest,
    ReleaseRequest,
    StatsRequest,
    StepReply,
)

__all__ = ["Chunk", "Engine", "EngineConfig", "EngineError", "connect"]

log = logging.getLogger("shardspec.orchestrator")

# errors of one request that leave the workers' group consistent; any other error of a step means
# the ranks may no longer agree, so the engine rebuilds the group
REQUEST_ERRORS = frozenset({ErrorCode.BAD_REQUEST, ErrorCode.NOT_FOUND, ErrorCode.CAPACITY})
# what starting the engine or a generation raises when the workers fail (not a caller's bad input)
ENGINE_ERRORS = (EngineError, WorkerLost, RemoteError)




@dataclass
class _Step:
    """A step on the wire: its batch, and one future per rank."""

    batch: ScheduledStep
    futures: list[asyncio.Future]
    requests: list[Request]  # of its sequences, as they were when it was sent


class Engine:
    """Use `connect(...)`; the constructor checks the model folder and sets up, `start` connects."""

    def __init__(self, config: EngineConfig) -> None:
        config.check_model_folder()
        self.config = config
        model_dir = Path(config.model)
        self.tokenizer = Tokenizer.from_folder(model_dir) if model_dir.is_dir() else None
        self.wakeup = asyncio.Event()
        self.group = WorkerGroup(config, on_failure=self.wakeup.set)
        self.scheduler = Scheduler(config.max_seqs, config.micro_batches)
        self.seq_ids = itertools.count(1)
        self.pipeline_depth = 2 if config.pipeline else 1  # steps in flight per micro-batch
        self.next_group = 0  # the micro-batch whose step is built next, round robin
        self.refused: set[int] = set()  # sequences of steps the workers refused, while later steps are in flight
        self.observer: StepObserver | None = None
        self.loop_task: asyncio.Task | None = None
        self.closed = False
        self.lost: str | None = None  # why the workers are being (or cannot be) reconnected
        self.stopping: str | None = None  # why the engine takes no more requests (stop)

    @property
    def load_info(self) -> LoadReply:
        """Rank 0's LoadReply: vocabulary, context, dtype, MTP drafts, stop ids."""
        assert self.group.load_info is not None, "the engine has not loaded the model"
        return self.group.load_info

    @functools.cached_property
    def grammars(self) -> Grammars | None:
        """Structured output: constraints compiled against the model's tokenizer, then built on the last
        stage (orchestrator.grammars); None without tokenizer.json."""
        tokenizer = Path(self.config.model) / "tokenizer.json"
        if not tokenizer.is_file():
            return None
        config, info = self.config, self.load_info
        compiler = GrammarCompiler(tokenizer, info.vocab_size, list(info.eos_token_ids), added_tokens(tokenizer),
                                   processes=config.grammar_compilers, timeout_s=config.grammar_timeout,
                                   memory_bytes=config.grammar_memory, mask_budget_s=config.grammar_budget / 4)
        return Grammars(compiler, self.group.call_last_stage)

    @property
    def draft_tokens(self) -> int:
        """MTP drafts per step; 0 when MTP is off."""
        return self.load_info.draft_tokens

    @property
    def forced_acceptance(self) -> float | None:
        """Benchmarks only: the rate at which the workers accept drafts whatever the model says; None: off."""
        rate = self.group.load_request.forced_acceptance
        return rate if rate >= 0 else None

    @property
    def failure(self) -> str | None:
        """Why the engine cannot serve requests now, or None when it can."""
        if self.closed or self.loop_task is None:
            return "the engine is not running"
        if self.stopping is not None:
            return self.stopping
        if self.lost is not None:
            if self.loop_task.done():
                return self.lost
            paused = self.group.local.note if self.group.local is not None else None
            return f"{self.lost}; reconnecting to the workers" + (f" ({paused})" if paused else "")
        if self.loop_task.done():
            return "the engine's step loop stopped"
        return self.group.failure

    @property
    def healthy(self) -> bool:
        return self.failure is None

    # --- start and stop ----------------------------------------------------------------------------

    async def start(self) -> None:
        await self.group.start()
        self._use_blocks()
        if (context := self.load_info.max_seq_len) < (self.config.max_seq_len or 0):
            log.warning("max_seq_len %d is above the model's maximum of %d tokens (max_position_embeddings): "
                        "sequences get %d", self.config.max_seq_len, context, context)
        self.loop_task = asyncio.create_task(self._run())

    async def close(self) -> None:
        """Say goodbye to the workers, stop spawned ones, fail what is still running."""
        if self.closed:
            return
        self.closed = True
        if self.loop_task is not None:  # let the steps in flight finish, then stop the loop
            self.wakeup.set()
            if self.lost is not None:  # reconnecting: nothing in flight to wait for
                self.loop_task.cancel()
            with contextlib.suppress(TimeoutError, asyncio.CancelledError):
                await asyncio.wait_for(self.loop_task, 30)
        if (grammars := self.__dict__.get("grammars")) is not None:
            await grammars.compiler.close()
        for request in self.scheduler.take_all():
            request.fail(EngineError("the engine was closed"))
        await self.group.close()

    def stop(self, reason: str) -> None:
        """Take no more requests, and end those in flight now (a server that shuts down): each one's
        generate() raises EngineError(reason), and its sequence is freed as a cancelled one's."""
        self.stopping = reason
        for request in [*self.scheduler.running.values(), *self.scheduler.waiting]:
            if not request.finished:
                request.queue.put_nowait(EngineError(reason))

    # --- the API -----------------------------------------------------------------------------------

    async def generate(
        self,
        prompt: str | list[int],
        max_tokens: int = 128,
        temperature: float = 0.0,
        top_k: int = 0,
        top_p: float = 1.0,
        seed: int | None = None,
        stop_at_eos: bool = True,
        logprobs: int | None = None,
        prompt_logprobs: int | None = None,
        presence_penalty: float = 0.0,
        frequency_penalty: float = 0.0,
        repetition_penalty: float = 1.0,
        structured_output: dict[str, Any] | None = None,
        stop_token_ids: list[int] | None = None,
        skip_special_tokens: bool = True,
        logit_bias: dict[int, float] | None = None,
        min_tokens: int = 0,
        cache_salt: str | None = None,
        prefix_points: list[int] | None = None,
        arrived: float | None = None,
    ) -> AsyncIterator[Chunk]:
        """Stream the completion of `prompt` (text, or token ids) as Chunks. `logprobs=N` adds each
        token's log-probability under the target model (raw logits: before temperature, top-k and
        top-p) and the N most likely tokens there (N = 0: none); `prompt_logprobs=N` the same for the
        prompt's tokens after the first, in the first chunk. The penalties are vLLM's (presence and
        frequency in [-2, 2] over the output, repetition > 0 over prompt and output; applied to the
        target's logits on the workers, so MTP stays exact). `structured_output` constrains the output
        to one of {"json": schema}, {"json_object": True}, {"regex": str}, {"choice": [str, ...]},
        {"grammar": Lark or GBNF text} (vLLM's structured_outputs): the workers mask the target's and
        the drafts' logits, so MTP stays exact; a constraint that does not compile raises ValueError.
        `stop_token_ids` end the output as the end-of-text ids do; `skip_special_tokens` (default)
        leaves special tokens' text out of the chunks' text. `logit_bias` {token id: bias in [-100, 100]}
        is added to the target's (and the drafts') logits before sampling; `min_tokens` keeps the stop
        ids from ending the output before it has that many tokens. `cache_salt` (vLLM's) isolates the
        prefix cache: the request shares cached blocks and saved states only with requests of the same
        salt (None: with every request without one), so no other tenant can tell its prompt was seen.
        `prefix_points`: positions in the prompt where other prompts are likely to part from it (the end
        of a system prompt, of a message): the prefix cache saves a recurrent state at the block boundary
        at or before each, so the next prompt that shares that prefix starts there. `arrived`: when the
        request arrived (time.perf_counter(); a server's, default now), from which its first chunk's
        `timeline` and its stats' time to first token count."""
        if (failure := self.failure) is not None:
            raise EngineError(failure)
        request = values.new_request(
            next(self.seq_ids), self.load_info, self.tokenizer, self.forced_acceptance, prompt, max_tokens,
            values.sampling(temperature, top_k, top_p, seed), stop_at_eos,
            penalties=(presence_penalty, frequency_penalty, repetition_penalty), stop_token_ids=stop_token_ids,
            logit_bias=logit_bias, min_tokens=min_tokens, logprobs=logprobs, prompt_logprobs=prompt_logprobs,
            cache_salt=cache_salt, prefix_points=prefix_points)
        if arrived is not None:
            request.started = min(arrived, request.started)
        detok = Detokenizer(self.tokenizer, skip_special_tokens) if self.tokenizer else None
        if structured_output is not None:  # (last: the key it holds is released below)
            request.grammar = await self._grammar(structured_output)
            if (failure := self.failure) is not None:  # (while it compiled)
                self.grammars.release(request.grammar)
                raise EngineError(failure)
        request.queued_at = time.perf_counter()
        self.scheduler.add(request)
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
            if request.grammar:
                self.grammars.release(request.grammar)

    async def stats(self, timeline: bool = False) -> list[Any]:
        """Every worker's StatsReply, in rank order; `timeline`: with its last steps' events
        (protocol.messages.TimelineEvent: when each step's messages left and came)."""
        return [reply for reply, _ in await self.group.call_all(StatsRequest(timeline), timeout=30)]

    async def _grammar(self, constraint: dict[str, Any]) -> str:
        """The key of a structured-output constraint's grammar, compiled and built on the last stage
        (the caller releases it); ValueError (ConstraintError) when the constraint is refused."""
        if self.grammars is None:
            raise ValueError("structured output needs the model folder's tokenizer.json")
        return await self.grammars.acquire(constraint, self.group.loads)

    # --- the step loop -----------------------------------------------------------------------------

    async def _run(self) -> None:
        """The step loop; after losing a worker, reconnect and run it again. A bug that ends it fails
        every request, waiting or running, with what it was (none is left waiting for ever)."""
        try:
            while True:
                await self._step_loop()
                if self.closed or not await self._recover():
                    return
                self._use_blocks()
        except Exception as exc:
            log.exception("the engine's step loop failed")
            self.lost = f"the engine's step loop failed: {type(exc).__name__}: {exc}"
            for request in self.scheduler.take_all():
                request.fail(EngineError(self.lost))

    async def reload(self, request: LoadRequest) -> None:
        """Load again on every worker with other caches or settings (the workers keep weights they
        hold), and grant from the new pools; only while no request runs or waits."""
        if self.scheduler.running or self.scheduler.waiting:
            raise EngineError("reload needs an idle engine: requests are running or waiting")
        await self.group.load(request)
        self._use_blocks()

    def _use_blocks(self) -> None:
        """Grant the blocks of the workers' pools as loaded (again)."""
        paging = self.group.paging
        pool = BlockPool(paging)
        cache = PrefixCache(pool, paging.states, self.draft_tokens > 0, paging.keeps_finished_state,
                            self.config.prefix_cache, paging.one_pass_tokens)
        self.scheduler.use(pool, cache, self.draft_tokens, self.seq_ids)
        log.info("K/V cache: %d positions (%d blocks of %d) for up to %d sequences at once; prefix cache: %s",
                 paging.positions, paging.blocks, paging.block_tokens, self.config.max_seqs,
                 f"{paging.states} saved states" if cache.enabled else "off")

    async def _step_loop(self) -> None:
        """Run steps until the engine closes, or a worker is lost (self.lost then says which)."""
        inflight: deque[_Step] = deque()
        while not self.closed or inflight:
            self.lost = self.lost or self.group.lost_connection
            if self.lost is not None:
                self._fail_all(inflight, EngineError(self.lost))
                return
            self._release(self.scheduler.drop_cancelled())
            while not self.closed and (batch := self._next_batch(inflight)) is not None:
                inflight.append(self._send(batch))
            if not inflight:
                self.wakeup.clear()
                if not self.closed:
                    await self.wakeup.wait()
                continue
            step = inflight.popleft()
            try:
                try:
                    replies = await self.group.gather_step(step)  # within the step watchdog's bound
                finally:
                    for request in step.requests:
                        request.inflight -= 1
                self._deliver(step, replies)
            except Exception as exc:
                if _breaks_group(exc):
                    self.lost = str(exc)
                    self._fail_all(inflight, EngineError(self.lost))
                    return
                if isinstance(exc, RemoteError) and (step.batch.prefill or self.refused & set(step.batch.decode)):
                    self._refused(step.batch, exc)
                else:  # the ranks disagreed, or refused the running sequences: they cannot go on
                    for later in inflight:  # steps built on the failed one: drop them too
                        await asyncio.gather(*later.futures, return_exceptions=True)
                    inflight.clear()
                    await self._fail_running(exc)
            if not inflight:
                self.refused.clear()

    def _refused(self, batch: ScheduledStep, exc: RemoteError) -> None:
        """Every rank refused a step before running any of it (a request error): only its new
        requests are at fault. A step refused because it names a sequence an earlier refusal
        dropped is retried; of the step at fault, a lone new request fails, several are each
        retried alone, so that one bad request fails no other."""
        collateral = bool(self.refused & set(batch.decode))
        self.refused.update(r.seq for r in batch.prefill)
        self.scheduler.release(batch.prefill)
        if not collateral and len(batch.prefill) == 1:
            batch.prefill[0].fail(EngineError(str(exc)))
            return
        for request in batch.prefill:  # with a fresh sequence id: the workers never started the old one
            request.seq, request.solo = next(self.seq_ids), request.solo or not collateral
        self.scheduler.retry(batch.prefill)

    def _next_batch(self, inflight: deque[_Step]) -> ScheduledStep | None:
        """The next step to send: of the next micro-batch, in turn, that has work and fewer than
        pipeline_depth steps on the wire."""
        groups = self.scheduler.groups
        for turn in range(groups):
            group = (self.next_group + turn) % groups
            if sum(step.batch.group == group for step in inflight) >= self.pipeline_depth:
                continue
            if (batch := self.scheduler.schedule(group)) is not None:
                self.next_group = (group + 1) % groups
                return batch
        return None

    def _send(self, batch: ScheduledStep) -> _Step:
        if batch.preempted:  # their slots free on every rank before this step admits others
            self._release(ReleaseRequest(batch.preempted))
        requests = self._requests_of(batch)
        for request in requests:
            request.inflight += 1
        step, tensors = batch.command()
        now = time.perf_counter()
        for request in batch.prefill:
            request.sent_at = request.sent_at or now
        return _Step(batch, self.group.submit_all(step, tensors), requests)

    def _requests_of(self, batch: ScheduledStep) -> list[Request]:
        return [*batch.prefill, *(self.scheduler.running[seq] for seq in batch.decode)]

    def _deliver(self, step: _Step, replies: list[tuple]) -> None:
        reply = _agreed(replies[-self.config.tp_size :])  # the last stage's ranks decide the step
        if self.observer is not None:
            self.observer.on_step(max(r.step_s for r, _ in replies), reply.accepted)
        tensors = replies[-self.config.tp_size][1]  # the reply _agreed returns: the deciding stage's first rank
        for request in step.batch.prefill:
            request.first_step_s = request.first_step_s or max(r.step_s for r, _ in replies)
        finished = deliver(reply, self.scheduler.running, tensors)
        self.scheduler.replied(reply)
        self._release(self.scheduler.release(finished))

    def _release(self, release: ReleaseRequest | None) -> None:
        """Free the slots: the release goes on the wire behind the steps already sent. Its errors are
        gathered and logged (a broken worker fails the next step); the states it was to save are
        forgotten."""
        if release is None:
            return
        done = asyncio.gather(*self.group.submit_all(release), return_exceptions=True)
        if release.saves:
            done.add_done_callback(functools.partial(self._released, self.scheduler.cache, release))

    @staticmethod
    def _released(cache: PrefixCache, release: ReleaseRequest, done: asyncio.Future) -> None:
        errors = [r for r in done.result() if isinstance(r, BaseException)] if not done.cancelled() else [None]
        if errors:
            log.error("a release that saves prefix-cache states failed (%s); forgetting them", errors[0])
            cache.forget([save.state for save in release.saves])

    async def _fail_running(self, exc: Exception) -> None:
        log.error("step failed: %s", exc)
        failed = list(self.scheduler.running.values())
        release = self.scheduler.release(failed)
        for request in failed:
            request.fail(EngineError(str(exc)))
        if release is not None and self.group.lost_connection is None:
            with contextlib.suppress(Exception):
                await self.group.call_all(release, timeout=30)

    def _fail_all(self, inflight: deque[_Step], exc: Exception) -> None:
        """Fail every request, running or waiting, and forget the steps on the wire."""
        requests = self.scheduler.take_all()
        log.error("%s: failing %d requests", exc, len(requests))
        for step in inflight:
            for future in step.futures:
                future.cancel()
        inflight.clear()
        for request in requests:
            request.fail(exc)

    async def _recover(self) -> bool:
        """Reconnect to the workers until they all answer and load again; False if the engine closed first."""
        recovered = await self.group.recover(self.lost or "", lambda: self.closed)
        if recovered:
            self.lost = None
        return recovered


def _agreed(replies: list[tuple]) -> StepReply:
    """The step's reply, once every rank that decides it (the last stage's) is seen to have sampled
    the same tokens."""
    first = replies[0][0]
    for reply, _ in replies[1:]:
        if reply.tokens != first.tokens or reply.accepted != first.accepted:
            raise EngineError("workers disagree on the sampled tokens; the group is inconsistent")
    return first


def _breaks_group(exc: Exception) -> bool:
    """After this error of a step, can the ranks still be trusted to agree?"""
    if isinstance(exc, RemoteError):
        return exc.code not in REQUEST_ERRORS
    return not isinstance(exc, EngineError)  # EngineError: the ranks disagreed; their sequences are failed


@asynccontextmanager
async def connect(model: str | None = None, *, config: EngineConfig | None = None,
                  on_progress: Callable[[list[LoadProgress | None]], None] | None = None,
                  **options: Any) -> AsyncIterator[Engine]:
    """Connect to (or spawn) workers, load the model on them, and yield a ready Engine.

    Give the model folder and any EngineConfig field as keywords (`connect(model=DIR, local=2)`; no
    model: the bundled one), or a whole `config=EngineConfig(...)`; the fields are documented there.
    `on_progress` is called while the workers load, with each rank's last LoadProgress (None before
    its first), a few times a second at most per worker."""
    if config is None:
        config = EngineConfig(**options) if model is None else EngineConfig(model=model, **options)
    elif model is not None or options:
        raise ValueError("give either config, or model and its options, not both")
    engine = Engine(config)
    engine.group.on_progress = on_progress
    try:
        await engine.start()
        yield engine
    finally:
        await engine.close()
