"""The workers of one engine: their connections, the processes it spawned, the group they form.

The world is `pp` pipeline stages of tensor-parallel ranks, stage-major in rank order. Connecting
is hello to every worker, `init` into a new torch.distributed group (with several stages, each
rank also learns every rank's stage-link address: the stages send each other hidden states and
acceptance records directly, worker to worker), then `load`.

Failures: a worker that exits or stops answering heartbeats fails the requests in flight with an
error naming it, and so does one whose step reply does not come within the step watchdog's bound
(a worker hung outside a collective still answers heartbeats from libzmq's IO thread); `recover`
then says goodbye to the others and reconnects until every worker answers again (a supervisor
restarted it, or this engine did for a worker it spawned), joins them in a new process group and
loads the model again.
"""

from __future__ import annotations

import asyncio
import logging
import os
import secrets
import shutil
import tempfile
from collections.abc import Callable, Coroutine
from typing import Any

import torch
import zmq.asyncio

from shardspec.orchestrator.blocks import Paging
from shardspec.orchestrator.config import EngineConfig
from shardspec.orchestrator.requests import EngineError
from shardspec.orchestrator.shard_sender import offer_shards
from shardspec.orchestrator.workers import (
    DIR_PREFIX,
    LocalWorkers,
    WorkerClient,
    WorkerLost,
    free_port,
    remove_stale_dirs,
    wait_ready,
)
from shardspec.protocol import transport
from shardspec.protocol.errors import ErrorCode, RemoteError
from shardspec.protocol.messages import (
    AcceptRecord,
    Guesses,
    HiddenStates,
    InitRequest,
    LoadProgress,
    LoadReply,
    LoadRequest,
    ShutdownRequest,
)

log = logging.getLogger("shardspec.orchestrator")

RECONNECT_HELLO_S = 10.0  # per attempt at reaching every worker again after a failure
RECONNECT_PAUSE_S = 1.0
GOODBYE_TIMEOUT_S = 5.0
LATE_READ_S = 1.0  # after a wait's timeout, for replies already on the socket to be read

# the step watchdog's derived bound (step_timeout 0): FLOOR_S + SLACK × the slowest seconds per
# token measured so far × the step's tokens; the first steps after a load may compile kernels and
# capture graphs, so they get at least WARMUP_FLOOR_S, and before any step is measured the rate is
# guessed from the weights as a slow CPU's (2 FLOPs per weight per token at ~40 GFLOP/s)
STEP_FLOOR_S = 30.0
STEP_SLACK = 10.0
WARMUP_STEPS = 8
WARMUP_FLOOR_S = 600.0
GUESSED_S_PER_TOKEN_PER_GB = 0.05


class WorkerGroup:
    """Connections to every rank, in rank order; `start` spawns local workers if the config asks for them."""

    def __init__(self, config: EngineConfig, on_failure: Callable[[], None]) -> None:
        self.config = config
        self.on_failure = on_failure  # told when a connection fails
        self.links = config.curve_links()
        self.ctx = zmq.asyncio.Context()
        self.local: LocalWorkers | None = None
        self.stages: list[list[WorkerClient]] = []
        self.load_request = config.load_request()
        self.load_info: LoadReply | None = None  # rank 0's
        self.paging: Paging | None = None  # the K/V blocks every rank holds (orchestrator.blocks)
        self.relay = config.relay is True  # stage links through this engine (or after a direct one failed)
        self.rank_of: dict[int, int] = {}  # id(WorkerClient) -> its rank, for the relay
        self.watchdog = StepWatchdog(config.step_timeout)
        self.collectives = ""  # how the TP groups' collectives go (InitReply.collectives)
        self.progress_failed: asyncio.Future | None = None  # while a load runs: set by an on_progress that raised
        self.store_dir: str | None = None  # the folder of the groups' file stores (ipc:// workers), until close
        self.hostnames: list[str] = []  # each rank's, from its hello
        self.devices: list[str] = []
        self.load_replies: list[LoadReply] = []  # each rank's, from the last load
        self.on_progress: Callable[[list[LoadProgress | None]], None] | None = None  # told as loads go
        self.loads = 0  # loads done (a new one leaves the workers with no grammar built)

    @property
    def workers(self) -> list[WorkerClient]:
        return [worker for stage in self.stages for worker in stage]

    @property
    def addresses(self) -> list[str]:
        return self.local.addresses if self.local is not None else list(self.config.workers or [])

    @property
    def lost_connection(self) -> str | None:
        """Why a worker's connection failed, or None while all stand."""
        return next((str(w.failure) for w in self.workers if w.failure is not None), None)

    @property
    def failure(self) -> str | None:
        """A lost connection, or a spawned worker that exited; None when every worker is there."""
        if (lost := self.lost_connection) is not None:
            return lost
        try:
            if self.local is not None:
                self.local.check_alive()
        except WorkerLost as exc:
            return str(exc)
        return None

    # --- connecting --------------------------------------------------------------------------------

    async def start(self) -> None:
        remove_stale_dirs()  # (this user's folders of orchestrators killed before: spawned workers', stores)
        if self.config.spawns_workers:
            self.local = LocalWorkers(self.config.world_size, self.config.device, self.config.heartbeat_timeout)
        await self.connect(self.config.connect_timeout)

    async def connect(self, hello_timeout: float) -> None:
        """Fresh connections to every worker: hello, a new process group, load."""
        workers = [WorkerClient(self.ctx, address, *link, heartbeat_timeout=self.config.heartbeat_timeout,
                                on_failure=self.on_failure, on_link=self._relay, on_progress=self.report_progress)
                   for address, link in zip(self.addresses, self.links, strict=True)]
        self.stages = [[workers[rank] for rank in ranks] for ranks in self.config.stage_ranks()]
        self.rank_of = {id(worker): rank for rank, worker in enumerate(workers)}
        await self._hello_all(hello_timeout)
        try:
            await self._init()
        except RemoteError as exc:
            if exc.code != ErrorCode.UNREACHABLE or self.relay or self.config.relay is False:
                raise
            log.warning("%s; relaying the stage links through the orchestrator instead", exc)
            self.relay = True
            await self.call_all(ShutdownRequest(), timeout=GOODBYE_TIMEOUT_S)  # every rank back to idle
            await self._hello_all(hello_timeout)
            await self._init()
        await self._reporting(offer_shards(self))  # workers that lack the model receive it from here
        await self.load(self.load_request)

    async def _hello_all(self, timeout: float) -> None:
        hellos = await asyncio.gather(*(wait_ready(w, self.local, timeout) for w in self.workers),
                                      return_exceptions=True)
        if errors := [hello for hello in hellos if isinstance(hello, BaseException)]:
            raise errors[0]
        for worker, hello in zip(self.workers, hellos, strict=True):
            log.info("worker %s: pid %d on %s, device %s", worker.address, hello.pid, hello.hostname, hello.device)
        self.hostnames = [hello.hostname for hello in hellos]
        self.devices = [hello.device for hello in hellos]

    async def _init(self) -> None:
        """Every rank joins the new group, in its stage at its TP place."""
        staged = len(self.stages) > 1
        links = [link_address(address) for address in self.addresses] if staged else []
        if self.store_dir is None:
            # (0700; named as LocalWorkers' folders, so that remove_stale_dirs takes it when this process died)
            self.store_dir = tempfile.mkdtemp(prefix=f"{DIR_PREFIX}{os.getpid()}-store-")
        secret = secrets.token_hex(16)  # seals the group's keys and values in the rendezvous store (SealedStore)
        dist_addr = rendezvous(self.addresses, self.config.dist_port, links, f"{self.store_dir}/{secret}")
        curve = staged and not self.relay and self.links[0][0] is not None
        link_keys = [public.decode() for _, public in self.links] if curve else []
        inits = [InitRequest(rank=rank, world_size=len(self.workers), dist_addr=dist_addr,
                             timeout_s=self.config.dist_timeout, stages=len(self.stages), links=links,
                             relay=staged and self.relay, link_keys=link_keys,
                             host_ranks=self.hostnames.count(self.hostnames[rank]), dist_secret=secret,
                             link_max_bytes=self.config.link_frame_bytes() if staged else 0,
                             options=self.config.worker_options)
                 for rank in range(len(self.workers))]
        replies = await self.gather([w.submit(init) for w, init in zip(self.workers, inits, strict=True)])
        for worker, init, (reply, _) in zip(self.workers, inits, replies, strict=True):
            if (reply.stage, reply.tp_rank, reply.tp_size) != (init.stage, init.rank % init.tp_size, init.tp_size):
                raise EngineError(f"worker {worker.address} took stage {reply.stage}, TP rank {reply.tp_rank} of "
                                  f"{reply.tp_size}; asked for stage {init.stage}, TP rank "
                                  f"{init.rank % init.tp_size} of {init.tp_size}")
        # how the TP groups' collectives go (layers.parallel.TPGroup.path), for the ready line
        self.collectives = "/".join(sorted({reply.collectives for reply, _ in replies if reply.collectives}))

    def load_progress(self) -> list[LoadProgress | None]:
        """Each rank's last LoadProgress of the load running (None before its first)."""
        return [worker.loading for worker in self.workers]

    def report_progress(self, *_: Any) -> None:
        """Tell on_progress each rank's progress of the transfer or load running. An exception of it
        ends the first one (connect() raises it) rather than the reads of the replies it came with;
        after that (a reload while serving) it is logged and on_progress is told no more."""
        if self.on_progress is None or self.progress_failed is None or self.progress_failed.done():
            return
        try:
            self.on_progress(self.load_progress())
        except Exception as exc:
            if not self.loads:
                self.progress_failed.set_exception(exc)
                return
            log.error("on_progress raised %r; it is told no more of the loads", exc)
            self.on_progress = None

    async def _reporting(self, work: Coroutine[Any, Any, Any]) -> Any:
        """`work` (a transfer or a load) while report_progress may tell on_progress how it goes."""
        self.progress_failed = failed = asyncio.get_running_loop().create_future()
        task = asyncio.ensure_future(work)
        try:
            await asyncio.wait([task, failed], return_when=asyncio.FIRST_COMPLETED)
            if failed.done():
                if task.done() and not task.cancelled():
                    task.exception()  # (retrieved: the callback's exception is the one raised)
                raise failed.exception()
            return task.result()
        finally:
            self.progress_failed = None
            task.cancel()
            failed.cancel()

    async def load(self, request: LoadRequest) -> LoadReply:
        """Load (or load again, with other caches) on every rank; recovery reloads the same request."""
        for worker in self.workers:
            worker.loading = None
        replies = await self._reporting(self.call_all(request))
        for stage, ranks in enumerate(self.config.stage_ranks()):
            layers = replies[ranks[0]][0].layers  # ([first, end): written as `status` writes it)
            log.info("stage %d: decoder layers %s on %s", stage,
                     f"{layers[0]}-{layers[1] - 1}" if len(layers) == 2 else layers,
                     ", ".join(self.workers[rank].address for rank in ranks))
        self.load_request, self.load_info = request, replies[0][0]
        self.load_replies = [reply for reply, _ in replies]
        self.loads += 1
        self.paging = Paging.of([reply for reply, _ in replies])
        self.watchdog.loaded(sum(reply.weight_bytes for reply, _ in replies), self.load_info.draft_tokens)
        return self.load_info

    async def disconnect(self) -> None:
        """Goodbye to the workers still connected (each leaves the group and goes idle; one never reached
        gets none to wait on); close all."""
        live = [w for w in self.workers if w.failure is None and w.answered]
        await asyncio.gather(*(w.call(ShutdownRequest(), timeout=GOODBYE_TIMEOUT_S) for w in live),
                             return_exceptions=True)
        await asyncio.gather(*(w.close() for w in self.workers))

    async def recover(self, cause: str, stopped: Callable[[], bool]) -> bool:
        """Reconnect until every worker answers and has loaded again; False if stopped first. A
        spawned worker in a crash loop is started again after its pause (LocalWorkers)."""
        while not stopped():
            await self.disconnect()
            if self.local is not None and self.local.restart_exited() > 0:  # (this engine supervises them)
                await asyncio.sleep(RECONNECT_PAUSE_S)
                continue
            try:
                await self.connect(RECONNECT_HELLO_S)
            except (WorkerLost, RemoteError, EngineError) as exc:
                log.warning("reconnecting after %r: %s; trying again", cause, exc)
                await asyncio.sleep(RECONNECT_PAUSE_S)
                continue
            log.warning("the workers are back after %r; serving again", cause)
            return True
        return False

    async def close(self) -> None:
        """Goodbye to the workers, and stop the ones this engine spawned (also when the goodbyes are
        cancelled: a signal that comes while they are under way)."""
        try:
            await self.disconnect()
        finally:
            if self.local is not None:
                self.local.stop()
            if self.store_dir is not None:
                shutil.rmtree(self.store_dir, ignore_errors=True)
            # destroy, not term: term waits for every socket of the context to be closed, and hung the close of
            # an engine in the test suite (2 of 4 runs) on one still open; destroy closes what is left first
            self.ctx.destroy(linger=0)

    # --- relaying stage links -----------------------------------------------------------------------

    def _relay(self, source: WorkerClient, op: str, frames: list) -> None:
        """Forward a stage-link message, unchanged, to the ranks it is for: hidden states to the next
        stage's rank at the sender's TP place, a record (and its guesses) from the last stage to every earlier one's."""
        rank = self.rank_of.get(id(source))
        tp, last = self.config.tp_size, len(self.stages) - 1
        if not self.relay or rank is None:
            log.warning("dropped a stage-link message from %s: this group does not relay", source.address)
            return
        stage = rank // tp
        if op == HiddenStates.OP and stage < last:
            targets = [rank + tp]
        elif op in (AcceptRecord.OP, Guesses.OP) and stage == last:
            targets = [s * tp + rank % tp for s in range(last)]
        else:
            log.warning("dropped a %r message from %s (stage %d): not one it sends", op, source.address, stage)
            return
        for target in targets:
            transport.forward(self.workers[target].sock, [frame.buffer for frame in frames])

    # --- talking to every rank ---------------------------------------------------------------------

    def submit_all(self, request: Any, tensors: dict[str, torch.Tensor] | None = None) -> list[asyncio.Future]:
        """Send one request to every rank now; one future per rank, in rank order."""
        return [w.submit(request, tensors) for w in self.workers]

    async def call_last_stage(self, request: Any) -> list[tuple]:
        """Send one request to the last stage's ranks (those that decode) and wait for all."""
        return await self.gather([w.submit(request) for w in self.stages[-1]])

    async def call_all(self, request: Any, tensors: dict[str, torch.Tensor] | None = None,
                       timeout: float | None = None) -> list[tuple]:
        """Send one request to every rank and wait for all (reply, tensors), in rank order."""
        return await self.gather(self.submit_all(request, tensors), timeout)

    async def gather_step(self, step: Any) -> list[tuple]:
        """A step's replies (`step`: the engine's, with .futures and .batch), each within the
        watchdog's bound; a rank silent past it is reported as lost, as a dead one would be."""
        tokens = self.watchdog.tokens(step.batch)
        bound = self.watchdog.bound(tokens)
        started = asyncio.get_running_loop().time()
        replies = await self.gather(step.futures, bound, f"its step within {bound:g}s (the step timeout, "
                                    f"{'set' if self.config.step_timeout else 'derived from the batch'})")
        self.watchdog.measured(tokens, asyncio.get_running_loop().time() - started)
        return replies

    async def gather(self, futures: list[asyncio.Future], timeout: float | None = None,
                     what: str | None = None) -> list[tuple]:
        """Every rank's reply, in rank order; on an error, the most telling one.

        A rank that dies makes its peers' collectives fail too, often before its own connection is
        seen to drop: give that a heartbeat timeout to show, and report the lost worker rather than
        its peers. Ranks silent after `timeout` are named in a WorkerLost (`what`: what they did not
        send). The futures left are cancelled either way."""
        try:
            _, pending = await asyncio.wait(futures, timeout=timeout, return_when=asyncio.FIRST_EXCEPTION)
            if pending and not _errors(futures):  # a loop that was busy may not have read replies that came in time
                _, pending = await asyncio.wait(pending, timeout=LATE_READ_S, return_when=asyncio.FIRST_EXCEPTION)
            if not (errors := _errors(futures)):
                if pending:
                    silent = [w.address for w, f in zip(self.workers, futures, strict=True) if f in pending]
                    raise WorkerLost(f"worker{'s' * (len(silent) > 1)} {', '.join(silent)} did not answer "
                                     f"{what or f'within {timeout:g}s'}: hung or overloaded")
                return [future.result() for future in futures]
            if not any(isinstance(e, WorkerLost) for e in errors):
                await asyncio.wait(futures, timeout=self.config.heartbeat_timeout)
                errors = _errors(futures)
            raise next((e for e in errors if isinstance(e, WorkerLost)), errors[0])
        finally:
            for future in futures:
                future.cancel()


class StepWatchdog:
    """How long a step's replies may take: the configured step_timeout, or (0) a bound derived
    from the step's tokens and the slowest rate measured since the model loaded."""

    def __init__(self, configured: float) -> None:
        self.configured = configured
        self.draft_tokens = 0
        self.guessed_rate = 0.0  # seconds per token before any step is measured
        self.rate: float | None = None  # the slowest seconds per token measured
        self.steps = 0  # measured since the last load

    def loaded(self, weight_bytes: int, draft_tokens: int) -> None:
        self.draft_tokens = draft_tokens
        self.guessed_rate = GUESSED_S_PER_TOKEN_PER_GB * weight_bytes / 1e9
        self.rate, self.steps = None, 0

    def tokens(self, batch: Any) -> int:
        """The tokens a step computes: its prompts, and each decoded sequence's drafts and one more."""
        return sum(len(r.prompt) for r in batch.prefill) + len(batch.decode) * (1 + self.draft_tokens)

    def bound(self, tokens: int) -> float:
        if self.configured:
            return self.configured
        rate = self.guessed_rate if self.rate is None else self.rate
        floor = WARMUP_FLOOR_S if self.steps < WARMUP_STEPS else STEP_FLOOR_S
        return max(floor, STEP_FLOOR_S + STEP_SLACK * rate * max(tokens, 1))

    def measured(self, tokens: int, seconds: float) -> None:
        self.steps += 1
        if self.steps > WARMUP_STEPS:  # warm-up steps compile and capture: not the model's rate
            self.rate = max(self.rate or 0.0, seconds / max(tokens, 1))


def _errors(futures: list[asyncio.Future]) -> list[BaseException]:
    return [f.exception() for f in futures if f.done() and not f.cancelled() and f.exception() is not None]


def link_address(address: str) -> str:
    """Where the worker at `address` takes its stage links: two ports up on its host (the one above
    its own is rank 0's rendezvous), or a socket beside its ipc:// one."""
    if address.startswith("tcp://"):
        host, port = address.rsplit(":", 1)
        return f"{host}:{int(port) + 2}"
    return address.removesuffix(".sock") + ".link"


def rendezvous(addresses: list[str], port: int | None, links: list[str], store_file: str | None = None) -> str:
    """Where rank 0 hosts the torch.distributed store: on rank 0's host, at `port` or by default at
    the first port above rank 0's that no worker or stage link there listens on. For ipc:// workers
    (all on this host): `store_file` (in a folder only this user may enter), or 127.0.0.1 at `port`
    (or a free one when there is no file). A `port` that a worker there listens on is refused."""
    if not addresses[0].startswith("tcp://"):
        if store_file is not None and port is None:
            return f"file://{store_file}"
        return f"tcp://127.0.0.1:{port or free_port()}"
    host, rank0_port = addresses[0][len("tcp://") :].rsplit(":", 1)
    taken = {int(a.rsplit(":", 1)[1]): a for a in [*addresses, *links] if a.startswith(f"tcp://{host}:")}
    if port is None:
        port = next((p for p in range(int(rank0_port) + 1, 65536) if p not in taken), None)
        if port is None:
            raise EngineError(f"no free port above {addresses[0]}'s for the rendezvous: choose one with --dist-port")
    elif port in taken:
        raise EngineError(f"dist_port {port} is where {taken[port]} listens: give the rendezvous another port "
                          "(--dist-port)")
    return f"tcp://{host}:{port}"
