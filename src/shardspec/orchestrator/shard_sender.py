"""The orchestrator's side of a model transfer: before each load, every worker is offered the model
(`shards`: its config and complete index); a worker that has it neither in a folder, nor in its
shard cache, nor within reach of the Hub answers with the tensors (and small files) it lacks, and
gets them here as `chunk` requests on its own connection (CURVE where keys are used): raw bytes of
at most MAX_CHUNK_BYTES, each with its sha256, WINDOW of them in flight per worker (so memory on
both sides stays bounded), resumed from the bytes the worker already holds."""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from shardspec.models import hub
from shardspec.models.checkpoint import Checkpoint
from shardspec.models.shard_files import TensorSpan, tensor_spans, weight_map
from shardspec.orchestrator.requests import EngineError
from shardspec.protocol.errors import ErrorCode, RemoteError
from shardspec.protocol.messages import MAX_CHUNK_BYTES, ChunkRequest, ItemNeed, LoadProgress, ShardsRequest

if TYPE_CHECKING:
    from shardspec.orchestrator.group import WorkerGroup
    from shardspec.orchestrator.workers import WorkerClient

log = logging.getLogger("shardspec.orchestrator")
WINDOW = 4  # chunks in flight per worker
# a chunk takes about CHUNK_S on the worker's share of the link (its acks are the connection's sign of life: a
# heartbeat timeout must never pass between two), within [MIN_CHUNK_BYTES, MAX_CHUNK_BYTES]
CHUNK_S = 0.1
MIN_CHUNK_BYTES = 64 << 10
SMALL_FILES = ("tokenizer.json", "tokenizer_config.json", "generation_config.json", "chat_template.jinja")


@dataclass(frozen=True)
class Item:
    """A tensor's blob (its one-tensor safetensors file: `span.header`, then its bytes in `span.file`),
    or a whole small file (`path`)."""

    name: str
    span: TensorSpan | None = None
    path: Path | None = None

    @property
    def size(self) -> int:
        return self.span.blob_bytes if self.span is not None else self.path.stat().st_size

    def read(self, offset: int, count: int) -> bytes:
        if self.span is None:
            with open(self.path, "rb") as f:
                f.seek(offset)
                return f.read(count)
        header = self.span.header
        head = header[offset : offset + count]
        start = self.span.start + max(0, offset - len(header))
        with open(self.span.file, "rb") as f:
            f.seek(start)
            return head + f.read(min(count - len(head), self.span.end - start))


async def offer_shards(group: WorkerGroup) -> None:
    """Offer the model the group loads to every worker and send each what it lacks."""
    config = group.config
    folder = Path(config.model)
    if not config.model_key or not (folder / "config.json").is_file():
        return  # the model is on the workers' hosts only
    if config.hub_model is not None and not (folder / "model.safetensors.index.json").is_file():
        return  # a Hub model in one file: its header is not here without the file (workers fetch it)
    checkpoint = Checkpoint.open(folder)
    request = group.load_request
    offer = ShardsRequest(model=request.model, key=config.model_key, layer_split=request.layer_split,
                          mtp=request.mtp, files=[name for name in SMALL_FILES if (folder / name).is_file()])
    index = {"weight_map": weight_map(checkpoint)}
    if config.hub_model is None:  # (a worker refuses at once a stage its cache can never hold)
        index["blob_bytes"] = await asyncio.to_thread(_blob_bytes, checkpoint)
    frames = {"config": _frame((folder / "config.json").read_bytes()), "index": _frame(json.dumps(index).encode())}
    try:
        replies = await group.call_all(offer, frames)
    except RemoteError as exc:
        if exc.code == ErrorCode.BAD_MESSAGE:  # a worker of a version before transfers
            log.warning("%s; the workers load the model from their own disks", exc)
            return
        if exc.code == ErrorCode.CAPACITY:  # (its cache can never hold its stage: said before any byte is sent)
            raise EngineError(f"sending the model to worker {exc.worker} failed: {exc.message}") from None
        raise
    needs = {worker: reply.need for worker, (reply, _) in zip(group.workers, replies, strict=True)
             if reply.source == "send"}
    for worker, (reply, _) in zip(group.workers, replies, strict=True):
        log.info("worker %s loads %s from its %s", worker.address, request.model,
                 {"send": "cache, once sent from here", "hub": "Hub cache"}.get(reply.source, reply.source))
    if needs:
        items = await asyncio.to_thread(_items, checkpoint, config.hub_model, needs.values())
        await Transfer(group, items, needs).run()


class Transfer:
    """One transfer to the workers that need it, each its own window of chunks in flight."""

    def __init__(self, group: WorkerGroup, items: dict[str, Item], needs: dict[WorkerClient, list[ItemNeed]]):
        self.group, self.items, self.needs = group, items, needs
        self.sent = {worker: 0 for worker in needs}
        self.rates = {worker: ChunkSize() for worker in needs}
        self.totals = {worker: sum(items[n.item].size - _start(items[n.item], n) for n in need)
                       for worker, need in needs.items()}

    async def run(self) -> None:
        started = time.perf_counter()
        await asyncio.gather(*(self._send(worker, need) for worker, need in self.needs.items()))
        seconds = time.perf_counter() - started
        total = sum(self.sent.values())
        log.info("sent %.1f MB of model shards to %d workers in %.1fs (%.0f MB/s)", total / 1e6, len(self.needs),
                 seconds, total / 1e6 / max(seconds, 1e-9))

    async def _send(self, worker: WorkerClient, need: list[ItemNeed]) -> None:
        window = asyncio.Semaphore(WINDOW)
        in_flight: list[asyncio.Future] = []
        for done, item_need in enumerate(need):
            item = self.items[item_need.item]
            async for chunk, data in _chunks(self.group.config.model_key, item, _start(item, item_need),
                                             self.rates[worker].bytes):
                await window.acquire()
                in_flight = _pending(in_flight, worker)
                future = worker.submit(chunk, {"data": data})
                count = data.numel()
                future.add_done_callback(lambda f, n=count, d=done: self._acked(worker, window, f, n, d))
                in_flight.append(future)
        if in_flight:
            await asyncio.wait(in_flight)
        _pending(in_flight, worker)

    def _acked(self, worker: WorkerClient, window: asyncio.Semaphore, future: asyncio.Future, count: int,
               done: int) -> None:
        window.release()
        if future.cancelled() or future.exception() is not None:
            return
        self.rates[worker].acked(count)
        self.sent[worker] += count
        items = done + future.result()[0].done  # (an item counts once its last chunk is in)
        worker.loading = LoadProgress(items, len(self.needs[worker]), self.sent[worker], self.totals[worker])
        self.group.report_progress()


class ChunkSize:
    """The next chunk's size for one worker, from the rate its acks come at (chunks in flight are
    served one after the other, so the time between two acks is one chunk's time on the link)."""

    def __init__(self) -> None:
        self.rate = 0.0  # bytes/s, smoothed
        self.last: float | None = None

    def acked(self, count: int) -> None:
        now = time.perf_counter()
        if self.last is not None and now > self.last:
            rate = count / (now - self.last)
            self.rate = rate if not self.rate else 0.7 * self.rate + 0.3 * rate
        self.last = now

    def bytes(self) -> int:
        size = int(self.rate * CHUNK_S) if self.rate else 1 << 20
        return max(MIN_CHUNK_BYTES, min(MAX_CHUNK_BYTES, size))


def _pending(futures: list[asyncio.Future], worker: WorkerClient) -> list[asyncio.Future]:
    """The chunks not yet acknowledged (at most the window); EngineError if one failed."""
    for future in futures:
        if future.done() and not future.cancelled() and (exc := future.exception()) is not None:
            why = exc.message if isinstance(exc, RemoteError) else exc
            raise EngineError(f"sending the model to worker {worker.address} failed: {why}") from None
    return [future for future in futures if not future.done()]


async def _chunks(key: str, item: Item, start: int, chunk_bytes=lambda: MAX_CHUNK_BYTES):
    """The chunk requests of `item` from byte `start` (each of chunk_bytes()), the sha256 of the whole on the last."""
    digest = hashlib.sha256()
    for offset in range(0, start, MAX_CHUNK_BYTES):  # what the worker holds: hashed, not sent
        digest.update(await asyncio.to_thread(item.read, offset, min(MAX_CHUNK_BYTES, start - offset)))
    size, offset = item.size, start
    while offset < size:
        data = await asyncio.to_thread(item.read, offset, min(chunk_bytes(), size - offset))
        digest.update(data)
        last = offset + len(data) >= size
        yield (ChunkRequest(key=key, item=item.name, offset=offset, total=size,
                            sha256=hashlib.sha256(data).hexdigest(), blob_sha256=digest.hexdigest() if last else ""),
               _frame(data))
        offset += len(data)


def _start(item: Item, need: ItemNeed) -> int:
    """Where the item's bytes start for a worker that holds `need.have` of them (0 if that is past its end)."""
    return need.have if need.have < item.size else 0


def _blob_bytes(checkpoint: Checkpoint) -> dict[str, int]:
    """Each tensor's size in a worker's shard cache (its blob: the bytes and a header naming it)."""
    return {name: span.blob_bytes for path in sorted(set(checkpoint.files.values()))
            for name, span in tensor_spans(path).items()}


def _items(checkpoint: Checkpoint, hub_model: hub.HubModel | None, needs) -> dict[str, Item]:
    """Each item the workers need, with where its bytes are; a Hub model's files fetched here first."""
    names = {n.item for need in needs for n in need}
    tensors = {name.removeprefix("tensor:") for name in names if name.startswith("tensor:")}
    lacking = sorted(tensors - checkpoint.files.keys())
    if lacking:
        raise EngineError(f"a worker asked for tensor {lacking[0]!r}, which {checkpoint.folder} does not hold")
    files = sorted({checkpoint.files[name] for name in tensors})
    if hub_model is not None:
        log.info("fetching %d safetensors files of %s from the Hub to send to workers", len(files), hub_model.pinned)
        hub.fetch(hub_model, [path.name for path in files])
    spans: dict[str, TensorSpan] = {}
    for path in files:
        spans.update(tensor_spans(path))
    items = {f"tensor:{name}": Item(f"tensor:{name}", span=spans[name]) for name in tensors}
    for name in names - items.keys():
        file = name.removeprefix("file:")
        if not name.startswith("file:") or file not in SMALL_FILES:
            raise EngineError(f"a worker asked for {name!r}, which is not a file this side offered")
        items[name] = Item(name, path=checkpoint.folder / file)
    return items


def _frame(data: bytes) -> torch.Tensor:
    return torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else torch.empty(0, dtype=torch.uint8)
