"""Workers that lack the model receive it from the orchestrator: the shard cache (content-addressed,
LRU under a size limit, consistent on a full disk), the chunks (checked, resumed), and two workers
with empty disks serving a model only the orchestrator has, from their caches the second time."""

from __future__ import annotations

import asyncio
import errno
import hashlib
import json
import logging
import os
import shutil
from pathlib import Path

import pytest
import torch

from shardspec.models.checkpoint import Checkpoint
from shardspec.models.shard_files import folder_key, weight_map
from shardspec.orchestrator.engine import connect
from shardspec.orchestrator.requests import EngineError
from shardspec.orchestrator.shard_sender import Transfer, _blob_bytes, _chunks, _items
from shardspec.protocol.codec import Message, decode, encode
from shardspec.protocol.errors import ErrorCode, ProtocolError
from shardspec.protocol.messages import MAX_CHUNK_BYTES, ChunkRequest, ItemNeed, ShardsRequest, to_meta
from shardspec.shard_worker import sources
from shardspec.shard_worker.shard_cache import CacheFull, ShardCache
from shardspec.shard_worker.shard_receiver import ShardReceiver

PROMPT = [3, 1, 4, 1, 5, 9, 2, 6]


def offer(folder: Path) -> tuple[ShardsRequest, dict[str, torch.Tensor]]:
    """What the orchestrator sends first (shard_sender.offer_shards), for a model folder."""
    checkpoint = Checkpoint.open(folder)
    index = json.dumps({"weight_map": weight_map(checkpoint), "blob_bytes": _blob_bytes(checkpoint)}).encode()
    frames = {"config": torch.frombuffer(bytearray((folder / "config.json").read_bytes()), dtype=torch.uint8),
              "index": torch.frombuffer(bytearray(index), dtype=torch.uint8)}
    return ShardsRequest(model=str(folder), key=folder_key(checkpoint), mtp="auto"), frames


def send(receiver: ShardReceiver, folder: Path, needs: list[ItemNeed], key: str) -> int:
    """Send the needed items as the orchestrator would; the bytes sent."""
    items = _items(Checkpoint.open(folder), None, [needs])

    async def run() -> int:
        sent = 0
        for need in needs:
            async for chunk, data in _chunks(key, items[need.item], need.have):
                receiver.chunk(chunk, {"data": data})
                sent += data.numel()
        return sent

    sent = asyncio.run(run())
    receiver.finished()  # (as a load does)
    return sent


@pytest.fixture
def receiver(tmp_path) -> ShardReceiver:
    return ShardReceiver(ShardCache(tmp_path / "cache"), model_root=tmp_path / "nothing-here")


def test_a_received_stage_is_kept_by_content_and_the_next_offer_needs_nothing(receiver, tiny_model_vl):
    request, frames = offer(tiny_model_vl)
    reply = receiver.offer(request, frames, stage=1, stages=2)
    assert reply.source == "send" and all(need.have == 0 for need in reply.need)
    send(receiver, tiny_model_vl, reply.need, request.key)
    held = receiver.cache.tensors(request.key)
    for name, digest in held.items():  # each blob is named by its contents' sha256
        assert hashlib.sha256(receiver.cache.blob(digest).read_bytes()).hexdigest() == digest, name
    assert receiver.offer(request, frames, stage=1, stages=2).source == "cache"
    stage0 = receiver.offer(request, frames, stage=0, stages=2)  # another stage's tensors are not all there
    assert stage0.source == "send" and {n.item for n in stage0.need}.isdisjoint(f"tensor:{k}" for k in held)


def test_a_cache_emptied_while_the_worker_runs_receives_the_stage_again(receiver, tiny_model_vl):
    request, frames = offer(tiny_model_vl)
    send(receiver, tiny_model_vl, receiver.offer(request, frames, 0, 1).need, request.key)
    receiver.committed = {request.key: {"late.weight": "0" * 64}}  # (received, not yet recorded)
    for sub in receiver.cache.root.iterdir():  # an operator's `rm -rf CACHE/*`
        if sub.is_dir():
            shutil.rmtree(sub)
        else:
            sub.unlink()
    reply = receiver.offer(request, frames, 0, 1)
    assert reply.source == "send" and reply.need
    send(receiver, tiny_model_vl, reply.need, request.key)
    assert receiver.offer(request, frames, 0, 1).source == "cache"


def test_a_cached_stage_loads_the_same_tensors_as_the_folder(receiver, tiny_model_vl):
    request, frames = offer(tiny_model_vl)
    send(receiver, tiny_model_vl, receiver.offer(request, frames, 0, 1).need, request.key)
    source = sources.open_source(str(tiny_model_vl), request.key, receiver.cache, Path("/nonexistent"), 0, 1,
                                 "auto", [])
    assert source.kind == "cache"
    folder = Checkpoint.open(tiny_model_vl)
    for name, blob in source.checkpoint.files.items():
        assert source.checkpoint.entries([name]) == folder.entries([name]), name
        assert blob.parent == receiver.cache.root / "blobs"


def test_a_stopped_transfer_resumes_from_the_bytes_the_worker_holds(tmp_path, tiny_model_vl):
    cache_dir = tmp_path / "cache"
    first = ShardReceiver(ShardCache(cache_dir), tmp_path / "none")
    request, frames = offer(tiny_model_vl)
    needs = first.offer(request, frames, 0, 1).need
    item = max(needs, key=lambda n: n.item.startswith("tensor:model.language_model.embed"))
    blob = b"".join(asyncio.run(_collect(tiny_model_vl, item, request.key)))
    half = len(blob) // 2
    first.chunk(ChunkRequest(key=request.key, item=item.item, offset=0, total=len(blob),
                             sha256=hashlib.sha256(blob[:half]).hexdigest()), {"data": _frame(blob[:half])})
    # the worker restarts: what it holds of the item survives, and is not sent again
    again = ShardReceiver(ShardCache(cache_dir), tmp_path / "none")
    resumed = {n.item: n for n in again.offer(request, frames, 0, 1).need}[item.item]
    assert resumed.have == half
    assert send(again, tiny_model_vl, [resumed], request.key) == len(blob) - half
    assert hashlib.sha256(blob).hexdigest() in again.cache.tensors(request.key).values()


async def _collect(folder: Path, need: ItemNeed, key: str) -> list[bytes]:
    items = _items(Checkpoint.open(folder), None, [[need]])
    return [data.numpy().tobytes() async for _, data in _chunks(key, items[need.item], 0)]


def _frame(data: bytes) -> torch.Tensor:
    return torch.frombuffer(bytearray(data), dtype=torch.uint8)


def _chunk(item: str, data: bytes, offset: int = 0, total: int | None = None, sha: str | None = None) -> ChunkRequest:
    return ChunkRequest(key="a" * 64, item=item, offset=offset, total=total or len(data),
                        sha256=sha or hashlib.sha256(data).hexdigest(),
                        blob_sha256=hashlib.sha256(data).hexdigest())


def test_a_corrupt_chunk_is_refused_and_leaves_the_partial_file_as_it_was(receiver):
    good = b"x" * 1000
    receiver.chunk(_chunk("file:tokenizer.json", good[:500], total=1000, sha=hashlib.sha256(good[:500]).hexdigest()),
                   {"data": _frame(good[:500])})
    corrupt = b"y" * 500
    with pytest.raises(ProtocolError) as refused:
        receiver.chunk(_chunk("file:tokenizer.json", corrupt, offset=500, total=1000,
                              sha=hashlib.sha256(good[500:]).hexdigest()), {"data": _frame(corrupt)})
    assert refused.value.code == ErrorCode.BAD_REQUEST and "do not hash" in refused.value.message
    assert receiver.cache.held_bytes("a" * 64, "file:tokenizer.json") == 500


@pytest.mark.parametrize("frame, why", [(b"", "1 to"), (None, "one uint8 tensor"), (b"z" * 10, "past its")])
def test_a_malformed_or_oversized_chunk_is_a_protocol_error(receiver, frame, why):
    tensors = {} if frame is None else {"data": _frame(frame) if frame else torch.empty(0, dtype=torch.uint8)}
    with pytest.raises(ProtocolError, match=why):
        receiver.chunk(_chunk("tensor:w", frame or b"z", total=5), tensors)
    big = torch.zeros(MAX_CHUNK_BYTES + 1, dtype=torch.uint8)
    with pytest.raises(ProtocolError, match="1 to"):
        receiver.chunk(_chunk("tensor:w", b"z", total=MAX_CHUNK_BYTES + 1), {"data": big})


def test_the_cache_size_limit_evicts_the_least_recently_used_blobs(tmp_path):
    cache = ShardCache(tmp_path, limit=3000)
    digests = []
    for i in range(3):
        data = bytes([i]) * 1000
        cache.make_room(len(data), keep=set)
        cache.append("b" * 64, f"file:{i}", 0, memoryview(data))
        digests.append(cache.commit("b" * 64, f"file:{i}", hashlib.sha256(data).hexdigest()).name)
        os.utime(cache.blob(digests[-1]), (1000 + i, 1000 + i))
    cache.touch([digests[0]])  # used just now: the newest
    cache.make_room(1000, keep=set)
    assert [cache.blob(d).exists() for d in digests] == [True, False, True]
    with pytest.raises(CacheFull, match="--cache-size"):
        cache.make_room(2500, keep=lambda: set(digests))


def test_a_stage_the_cache_can_never_hold_is_refused_at_the_offer_and_evicts_nothing(tmp_path, tiny_model_vl):
    request, frames = offer(tiny_model_vl)
    receiver = ShardReceiver(ShardCache(tmp_path / "cache", limit=64 << 10), tmp_path / "none")
    other = receiver.cache.blob("ab" * 32)
    other.write_bytes(b"another model's tensor")
    with pytest.raises(ProtocolError, match=r"cannot hold this rank's stage .* raise the worker's --cache-size") as exc:
        receiver.offer(request, frames, 0, 1)
    assert exc.value.code == ErrorCode.CAPACITY and other.is_file()


def test_a_full_disk_is_a_clear_error_and_leaves_the_cache_consistent(receiver, monkeypatch):
    data = b"w" * 4096
    receiver.chunk(_chunk("tensor:w", data[:1024], total=4096, sha=hashlib.sha256(data[:1024]).hexdigest()),
                   {"data": _frame(data[:1024])})
    real = os.pwrite

    def full(fd, chunk, offset):  # the disk fills half-way through the write
        real(fd, bytes(chunk[:100]), offset)
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "pwrite", full)
    with pytest.raises(ProtocolError) as refused:
        receiver.chunk(_chunk("tensor:w", data[1024:2048], offset=1024, total=4096,
                              sha=hashlib.sha256(data[1024:2048]).hexdigest()), {"data": _frame(data[1024:2048])})
    assert refused.value.code == ErrorCode.CAPACITY and "No space left" in refused.value.message
    assert "--cache-dir" in refused.value.message
    assert receiver.cache.held_bytes("a" * 64, "tensor:w") == 1024  # cut back to its last whole chunk
    assert not any((receiver.cache.root / "blobs").iterdir())


@pytest.mark.slow  # three loads on two spawned workers: ~10 s on an idle 2-core host, 30 s on a busy one
def test_workers_with_empty_disks_serve_a_model_only_the_orchestrator_has_then_read_it_from_their_cache(
        tmp_path, tiny_model_vl, spawn_worker, caplog):
    progress: list[list] = []

    async def tokens(model: Path) -> list[int]:
        async with connect(model=str(model), workers=workers, pp=2, dtype="float32", max_seqs=1,
                           on_progress=progress.append) as engine:
            return [t async for chunk in engine.generate(PROMPT, max_tokens=12, temperature=0.0)
                    for t in chunk.token_ids]

    disk = tmp_path / "worker-disk"  # the only folders the workers may read
    shutil.copytree(tiny_model_vl, disk / "model")
    workers = [spawn_worker("--model-dir", str(disk), "--cache-dir", str(tmp_path / f"cache{i}")).address
               for i in range(2)]
    with caplog.at_level(logging.INFO, logger="shardspec.orchestrator"):
        sent = asyncio.run(tokens(tiny_model_vl))  # a folder outside --model-dir: as on another host
        assert "sent " in caplog.text and caplog.text.count("from its cache, once sent from here") == 2
        # the transfer shows in the progress the operator sees: bytes sent of the stage's, then the load's bytes
        assert all(len(totals(progress, rank)) == 2 for rank in range(2)), [totals(progress, r) for r in range(2)]
        progress.clear()
        caplog.clear()
        cached = asyncio.run(tokens(tiny_model_vl))
        assert "sent " not in caplog.text and caplog.text.count("from its cache\n") == 2
        assert all(len(totals(progress, rank)) == 1 for rank in range(2))
        caplog.clear()
        folder = asyncio.run(tokens(disk / "model"))
        assert caplog.text.count("from its folder\n") == 2
    assert sent == cached == folder


def test_a_corrupt_or_oversized_chunk_on_the_wire_is_an_error_reply_and_the_worker_serves_on(spawn_worker,
                                                                                               sync_client, tmp_path):
    worker = spawn_worker("--cache-dir", str(tmp_path / "cache"))
    client = sync_client(worker.address)

    def call(op: str, meta: dict, tensors: dict | None = None) -> Message:
        return decode(client.exchange(encode(Message(op, 1, meta, tensors or {}))))

    assert call("hello", {}).op == "hello"
    data = b"q" * 4096
    corrupt = call("chunk", to_meta(_chunk("tensor:w", data, sha="0" * 64)), {"data": _frame(data)})
    assert (corrupt.op, corrupt.meta["code"]) == ("error", str(ErrorCode.BAD_REQUEST))
    big = call("chunk", to_meta(_chunk("tensor:w", b"z", total=MAX_CHUNK_BYTES + 1)),
               {"data": torch.zeros(MAX_CHUNK_BYTES + 1, dtype=torch.uint8)})
    assert big.op == "error" and "1 to" in big.meta["message"]
    assert call("hello", {}).op == "hello" and worker.proc.poll() is None


def totals(progress: list[list], rank: int) -> set[int]:
    """The distinct totals (bytes) a worker's progress reports counted towards."""
    return {report[rank].bytes_total for report in progress if report[rank] is not None and report[rank].bytes_total}


def test_a_blob_larger_than_the_free_disk_is_refused_before_any_byte_is_written(receiver, monkeypatch):
    usage = shutil.disk_usage(receiver.cache.root)
    monkeypatch.setattr(shutil, "disk_usage", lambda _path: usage._replace(free=1000))
    data = b"v" * 4096
    with pytest.raises(ProtocolError) as refused:
        receiver.chunk(_chunk("tensor:v", data), {"data": _frame(data)})
    assert refused.value.code == ErrorCode.CAPACITY and "0.0 MB free" in refused.value.message
    assert "--cache-dir" in refused.value.message
    assert receiver.cache.held_bytes("a" * 64, "tensor:v") == 0


def test_workers_sharing_a_cache_folder_receive_into_partial_files_of_their_own(tmp_path):
    caches = [ShardCache(tmp_path, tag=f"ipc:///w{i}.sock") for i in range(2)]
    assert caches[0].partial("a" * 64, "tensor:w") != caches[1].partial("a" * 64, "tensor:w")
    assert ShardCache(tmp_path, tag="ipc:///w0.sock").partial("a" * 64, "tensor:w") == caches[0].partial("a" * 64,
                                                                                                          "tensor:w")


def test_a_start_after_a_stopped_transfer_sends_only_what_the_partial_files_lack(tmp_path, tiny_model, spawn_worker,
                                                                               monkeypatch):
    request, frames = offer(tiny_model)
    needs = ShardReceiver(ShardCache(tmp_path / "scratch"), tmp_path / "none").offer(request, frames, 0, 1).need
    items = _items(Checkpoint.open(tiny_model), None, [needs])
    whole = sum(items[n.item].size for n in needs)
    worker = spawn_worker("--model-dir", str(tmp_path / "none"), "--cache-dir", str(tmp_path / "cache"))
    # the worker's partial file of the embedding from a transfer that stopped half-way
    embedding = items["tensor:model.embed_tokens.weight"]
    half = embedding.read(0, embedding.size // 2)
    ShardCache(tmp_path / "cache", tag=worker.address).append(request.key, embedding.name, 0, memoryview(half))
    transfers: list[Transfer] = []
    run = Transfer.run

    async def counted(self: Transfer) -> None:
        transfers.append(self)
        await run(self)

    monkeypatch.setattr(Transfer, "run", counted)

    async def generate() -> list[int]:
        async with connect(model=str(tiny_model), workers=[worker.address], dtype="float32", max_seqs=1) as engine:
            return [t async for c in engine.generate(PROMPT, max_tokens=4, temperature=0.0) for t in c.token_ids]

    assert len(asyncio.run(generate())) == 4
    (transfer,) = transfers
    assert sum(transfer.sent.values()) == whole - len(half)


def test_a_stage_over_the_cache_size_limit_fails_the_start_naming_the_flag(tmp_path, tiny_model, spawn_worker):
    worker = spawn_worker("--model-dir", str(tmp_path / "none"), "--cache-dir", str(tmp_path / "cache"),
                          "--cache-size", "64KiB")

    async def start() -> None:
        async with connect(model=str(tiny_model), workers=[worker.address], dtype="float32", max_seqs=1):
            pass

    with pytest.raises(EngineError, match=r"failed: the shard cache at .* over its limit of 0\.1 MB: raise the "
                                          r"worker's --cache-size"):
        asyncio.run(start())
    assert worker.proc.poll() is None  # and what its cache holds is whole: each blob hashes to its name
    for blob in (tmp_path / "cache" / "blobs").iterdir():
        assert hashlib.sha256(blob.read_bytes()).hexdigest() == blob.name
