"""Hardening against a hostile client or peer, for operations: the rendezvous store's keys, what
error bodies and `shardspec status` show, and a streaming client that never reads."""

from __future__ import annotations

import asyncio
import re
import socket
from datetime import timedelta

import pytest
import torch.distributed as dist
from test_failures import Worker

import shardspec
from shardspec.orchestrator import group as orchestrator_group
from shardspec.orchestrator.workers import free_port
from shardspec.shard_worker.group import SealedStore, rendezvous_store

SECRET = "0123456789abcdef0123456789abcdef"

# --- the rendezvous store ----------------------------------------------------------------------------


def test_a_sealed_store_shows_no_key_or_value_and_refuses_a_value_written_without_the_secret():
    raw = dist.HashStore()
    sealed = SealedStore(SECRET, raw)
    sealed.set("default_pg/0//cpu//rank_1", b"127.0.0.1:5000")
    assert sealed.get("default_pg/0//cpu//rank_1") == b"127.0.0.1:5000"
    (name,) = raw.list_keys()
    assert re.fullmatch("[0-9a-f]{64}", name) and b"127.0.0.1" not in raw.get(name)
    raw.set(name, b"10.6.6.6:5000")  # a stranger's value
    with pytest.raises(ValueError, match=r"rank_1.*without the group's secret"):
        sealed.get("default_pg/0//cpu//rank_1")
    sealed.set("other", b"x")
    raw.set(name, raw.get(sealed._name("other")))  # a sealed value moved to another key
    with pytest.raises(ValueError, match="without the group's secret"):
        sealed.get("default_pg/0//cpu//rank_1")
    assert sealed.compare_set("other", b"x", b"y") == b"y" == sealed.get("other")
    assert sealed.add("count", 2) == 2 and sealed.check(["count", "other"]) and not sealed.check(["none"])


def test_the_rendezvous_store_listens_on_the_groups_address_only():
    address = _non_loopback_address()
    port = free_port(address)
    store = rendezvous_store(f"tcp://{address}:{port}", 0, 2, timedelta(seconds=5))
    try:
        with pytest.raises(OSError):  # not on loopback, nor any other interface
            socket.create_connection(("127.0.0.1", port), timeout=5).close()
        socket.create_connection((address, port), timeout=5).close()
    finally:
        del store


def test_a_stranger_at_the_rendezvous_port_reads_no_key_of_a_tcp_group_which_still_generates(tiny_model, tmp_path,
                                                                                              monkeypatch):
    secrets: list[str] = []
    token_hex = orchestrator_group.secrets.token_hex
    monkeypatch.setattr(orchestrator_group.secrets, "token_hex", lambda n: secrets.append(token_hex(n)) or secrets[-1])
    workers = [Worker(tmp_path, f"worker{i}") for i in range(2)]
    dist_port = free_port()

    async def run() -> tuple[list[int], list[int], list[str], list[bytes]]:
        async with shardspec.connect(model=str(tiny_model), workers=[w.address for w in workers], tp=2,
                                     dist_port=dist_port) as engine:
            before = await _tokens(engine)
            stranger = dist.TCPStore("127.0.0.1", dist_port, is_master=False, timeout=timedelta(seconds=10))
            names = stranger.list_keys()
            values = [stranger.get(name) for name in names]
            for name in names:  # overwritten, deleted, added to: the group formed needs none of them
                stranger.set(name, b"127.0.0.1:1")
            stranger.set("default_pg/0//cpu//rank_1", b"127.0.0.1:1")
            return before, await _tokens(engine), names, values

    try:
        before, after, names, values = asyncio.run(run())
    finally:
        for worker in workers:
            worker.stop()
    assert len(before) == 8 and after == before
    (secret,) = secrets
    assert names and all(re.fullmatch("[0-9a-f]{64}", name) for name in names), names
    readable = b"".join(values)
    assert secret.encode() not in readable and b"127.0.0.1" not in readable and b"rank" not in readable


async def _tokens(engine) -> list[int]:
    return [t async for chunk in engine.generate([1, 2, 3], max_tokens=8) for t in chunk.token_ids]


def _non_loopback_address() -> str:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        try:
            probe.connect(("192.0.2.1", 9))  # (TEST-NET-1: only picks a route, sends nothing)
            address = probe.getsockname()[0]
        except OSError:
            address = "127.0.0.1"
    if address.startswith("127."):
        pytest.skip("this host has no address besides loopback")
    return address
