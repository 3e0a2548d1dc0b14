"""The worker's op handlers: what each request does to the worker's state (init, load, step,
release, stats, ...), and the grammars built off the steps. ShardWorker (daemon.py) mixes them in,
holds the state they read and write, and routes each request to `_<op>`."""

from __future__ import annotations

import logging
import os
import socket
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch

from shardspec import __version__, kernels
from shardspec.protocol import codec, transport
from shardspec.protocol.codec import Message
from shardspec.protocol.errors import ErrorCode, ProtocolError
from shardspec.protocol.messages import (
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
    to_meta,
)
from shardspec.shard_worker import group
from shardspec.shard_worker.links import SPIN_S, LinkDropped, RelayedLinks, StageLinks, open_direct
from shardspec.shard_worker.loading import free_memory, make_runner
from shardspec.shard_worker.profiling import hang_for_test, mark
from shardspec.shard_worker.results import RunnerStats
from shardspec.shard_worker.runner import ModelRunner
from shardspec.utils import memory_stats

log = logging.getLogger("shardspec.worker")

LOAD_REPORT_S = 0.25  # while loading: how often the owner is told how far (LoadProgress), and status answered


class OpHandlers:
    """One method `_<op>` per request op, each (body, tensors) -> (reply, reply tensors)."""

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
            one_pass_tokens=self.runner.one_pass_tokens,
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
                reply = error_message(built.request_id, ErrorCode.BAD_REQUEST, built.error)
            else:
                reply = Message(op=GrammarRequest.OP, id=built.request_id,
                                meta=to_meta(GrammarReply(built.key, built.seconds)))
            if self.owner is not None:
                self._reply(self.sock, self.owner, reply)


def error_message(request_id: int, code: ErrorCode, message: str) -> Message:
    return Message(op="error", id=request_id, meta=to_meta(ErrorReply(code=str(code), message=message)))
