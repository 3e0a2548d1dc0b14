"""The worker's side of a model transfer: `shards` (the orchestrator offers a model: what does this
rank lack?) and `chunk` (a piece of one tensor or small file, written into the shard cache and,
once whole and its sha256 checked, kept there as a blob)."""

from __future__ import annotations

import hashlib
import json
import logging
import time
from pathlib import Path

import torch

from shardspec.models import hub
from shardspec.models.config import ConfigError
from shardspec.models.shard_files import INDEX_FILE, CachedCheckpoint
from shardspec.protocol.errors import ErrorCode, ProtocolError
from shardspec.protocol.messages import (
    MAX_CHUNK_BYTES,
    ChunkReply,
    ChunkRequest,
    ItemNeed,
    ShardsReply,
    ShardsRequest,
)
from shardspec.shard_worker import sources
from shardspec.shard_worker.shard_cache import CacheFull, ShardCache, is_digest

log = logging.getLogger("shardspec.worker")
TENSOR, FILE = "tensor:", "file:"
RECORD_EVERY_S = 2.0
SMALL_FILE_BYTES = 64 << 20  # a small file (tokenizer.json) sent whole


class ShardReceiver:
    def __init__(self, cache: ShardCache, model_root: Path | None = None):
        self.cache = cache
        self.model_root = model_root
        self.key = ""  # the model of the transfer under way
        self.started = 0.0
        self.received = 0  # bytes of it so far
        self.digests: dict[tuple[str, str], object] = {}  # (key, item) -> sha256 of its partial file so far
        self.committed: dict[str, dict[str, str]] = {}  # model key -> tensors in blobs, not yet in its tensors.json
        self.recorded = time.monotonic()

    def offer(self, body: ShardsRequest, tensors: dict[str, torch.Tensor], stage: int, stages: int) -> ShardsReply:
        """Where this rank's stage of the offered model will load from, and what it lacks."""
        self.record()  # (a transfer that stopped before its load)
        if sources.local_folder(body.model, self.model_root) is not None:
            return ShardsReply("folder")
        for name in ("config", "index"):
            frame = tensors.get(name)
            if frame is None or frame.dtype != torch.uint8 or frame.dim() != 1:
                raise ProtocolError(ErrorCode.BAD_REQUEST, f"shards takes the model's {name} as a uint8 frame")
        try:
            self.cache.make_folders()
            self.cache.write_file(body.key, "config.json", tensors["config"].numpy().tobytes())
            self.cache.write_file(body.key, INDEX_FILE, tensors["index"].numpy().tobytes())
            checkpoint = sources.cached_checkpoint(self.cache, body.key)
            stage_, mtp = sources.stage_of(checkpoint, body.mtp, body.layer_split, stage, stages)
            lacking = sources.missing(checkpoint, stage_, mtp, self.cache.tensors(body.key))
            sizes = _blob_bytes(tensors["index"])  # (the whole stage must fit, its cached tensors too)
            self.cache.check_room(sum(sizes.get(name, 0) for name in sources.stage_keys(checkpoint, stage_, mtp)),
                                  f"this rank's stage of {body.model}")
        except CacheFull as exc:
            raise ProtocolError(ErrorCode.CAPACITY, str(exc)) from None
        except (ConfigError, OSError, ValueError) as exc:
            raise ProtocolError(ErrorCode.NOT_FOUND, f"the offered model: {exc}") from None
        folder = self.cache.model_folder(body.key)
        files = [name for name in body.files if not (folder / name).is_file()]
        if not lacking and not files:
            return ShardsReply("cache")
        if self._hub_has(body.model, checkpoint, stage_, mtp):
            return ShardsReply("hub")
        items = [TENSOR + name for name in lacking] + [FILE + name for name in files]
        self.key, self.started, self.received = body.key, time.perf_counter(), 0
        log.info("receiving %d tensors and %d files of %s from the orchestrator (stage layers %d-%d) into %s",
                 len(lacking), len(files), body.model, stage_.start, stage_.end - 1, self.cache.root)
        return ShardsReply("send", [ItemNeed(item, self.cache.held_bytes(body.key, item)) for item in items])

    def chunk(self, body: ChunkRequest, tensors: dict[str, torch.Tensor]) -> ChunkReply:
        """Append one chunk to its item's partial file; the whole item, checked, into the blobs."""
        data = self._data(body, tensors)
        if not body.item.startswith((TENSOR, FILE)):
            raise ProtocolError(ErrorCode.BAD_REQUEST, f"chunk item {body.item!r} is neither tensor: nor file:")
        name = body.item.removeprefix(FILE)
        if body.item.startswith(FILE) and (body.total > SMALL_FILE_BYTES or not name or "/" in name
                                           or name.startswith(".")):
            raise ProtocolError(ErrorCode.BAD_REQUEST, f"{body.item}: a model's small file has a plain name and "
                                f"at most {SMALL_FILE_BYTES} bytes")
        held = self.cache.held_bytes(body.key, body.item)
        if body.offset not in (0, held):
            raise ProtocolError(ErrorCode.BAD_REQUEST, f"chunk of {body.item} at {body.offset}: this worker holds "
                                f"{held} bytes of it (send from there, or from 0)")
        end = body.offset + len(data)
        if end > body.total:
            raise ProtocolError(ErrorCode.BAD_REQUEST, f"chunk of {body.item} ends at {end}, past its {body.total}")
        if hashlib.sha256(data).hexdigest() != body.sha256:
            raise ProtocolError(ErrorCode.BAD_REQUEST, f"chunk of {body.item} at {body.offset}: its bytes do not "
                                "hash to its sha256 (corrupted on the way); send it again")
        try:
            if body.offset == 0:
                self.cache.make_room(body.total, keep=lambda: self._held_blobs(body.key),
                                     writing=self.cache.partial(body.key, body.item))
            digest = self._digest(body)
            held = self.cache.append(body.key, body.item, body.offset, data)
        except CacheFull as exc:
            self.digests.pop((body.key, body.item), None)
            raise ProtocolError(ErrorCode.CAPACITY, str(exc)) from None
        digest.update(data)
        self.received += len(data)
        if held < body.total:
            return ChunkReply(body.item, held, False)
        self._commit(body, self.digests.pop((body.key, body.item)).hexdigest())
        return ChunkReply(body.item, held, True)

    def _digest(self, body: ChunkRequest):
        """The running sha256 of the item's partial file, before this chunk."""
        name = (body.key, body.item)
        if body.offset == 0:
            self.digests[name] = hashlib.sha256()
        elif name not in self.digests:  # a resumed transfer: hash what the file holds
            self.digests[name] = self.cache.partial_digest(body.key, body.item)
        return self.digests[name]

    def _data(self, body: ChunkRequest, tensors: dict[str, torch.Tensor]) -> memoryview:
        data = tensors.get("data")
        if set(tensors) != {"data"} or data.dtype != torch.uint8 or data.dim() != 1:
            raise ProtocolError(ErrorCode.BAD_REQUEST, "chunk takes one uint8 tensor frame 'data'")
        if not 0 < data.numel() <= MAX_CHUNK_BYTES:
            raise ProtocolError(ErrorCode.BAD_REQUEST, f"a chunk holds 1 to {MAX_CHUNK_BYTES} bytes, got "
                                f"{data.numel()}")
        if not is_digest(body.key) or not is_digest(body.sha256):
            raise ProtocolError(ErrorCode.BAD_REQUEST, "chunk: key and sha256 must be sha256 digests in hex")
        return memoryview(data.numpy())

    def _commit(self, body: ChunkRequest, found: str) -> None:
        if not is_digest(body.blob_sha256):
            self.cache.partial(body.key, body.item).unlink(missing_ok=True)
            raise ProtocolError(ErrorCode.BAD_REQUEST, f"the last chunk of {body.item} lacks its blob_sha256")
        try:
            path = self.cache.commit(body.key, body.item, body.blob_sha256, found)
        except ValueError as exc:
            raise ProtocolError(ErrorCode.BAD_REQUEST, f"{exc}; send it again") from None
        kind, _, name = body.item.partition(":")
        try:
            if kind == "file":
                self.cache.write_file(body.key, name, path.read_bytes())
            else:
                self.committed.setdefault(body.key, {})[name] = body.blob_sha256
                if time.monotonic() - self.recorded >= RECORD_EVERY_S:
                    self.record()
        except (CacheFull, ValueError) as exc:
            raise ProtocolError(ErrorCode.CAPACITY if isinstance(exc, CacheFull) else ErrorCode.BAD_REQUEST,
                                str(exc)) from None

    def _hub_has(self, model: str, checkpoint, stage, mtp: bool) -> bool:
        """Whether this worker can fetch its files of `model` from the Hub itself (or has them in its Hub cache)."""
        ref = hub.parse_ref(model)
        if ref is None or not ref.pinned:
            return False
        resolved = hub.HubModel(ref, ref.revision, Path())
        bare = CachedCheckpoint.open_cached(checkpoint.folder, {})  # (every tensor named by its file)
        names = sources.hub_files(bare, stage, mtp)
        if hub.cached(resolved, names):
            return True
        if hub.offline():
            return False
        try:
            hub.resolve(ref, ("config.json",))
        except ConfigError as exc:
            log.info("the Hub is out of reach (%s): the orchestrator sends the model", exc)
            return False
        return True

    def record(self) -> None:
        """Write the tensors received since the last time into the model's tensors.json (one write
        every RECORD_EVERY_S, not one per tensor: a model may have 100,000 of them). One that cannot be
        written (the cache emptied meanwhile) is dropped with a warning: those tensors are sent again."""
        committed, self.committed, self.recorded = self.committed, {}, time.monotonic()
        for key, tensors in committed.items():
            try:
                self.cache.add_tensors(key, tensors)
            except OSError as exc:
                log.warning("shard cache: could not record %d received tensors of model %s: %s", len(tensors),
                            key[:12], exc)

    def _held_blobs(self, key: str) -> set[str]:
        return set(self.cache.tensors(key).values()) | set(self.committed.get(key, {}).values())

    def finished(self) -> None:
        """Record and log the transfer (the load after it)."""
        self.record()
        if self.key and self.received:
            seconds = time.perf_counter() - self.started
            log.info("received %.1f MB from the orchestrator in %.1fs (%.0f MB/s)", self.received / 1e6, seconds,
                     self.received / 1e6 / max(seconds, 1e-9))
        self.key, self.received = "", 0
        self.digests.clear()  # (a transfer resumed later hashes what its partial files hold)


def _blob_bytes(index: torch.Tensor) -> dict[str, int]:
    """The offer's sizes of the tensors' blobs ({} from an orchestrator that sends none)."""
    sizes = json.loads(index.numpy().tobytes()).get("blob_bytes", {})
    if not isinstance(sizes, dict) or not all(type(n) is int and 0 <= n < 1 << 50 for n in sizes.values()):
        raise ValueError("the index's blob_bytes must map tensor names to byte counts")
    return sizes
