"""Hardening against a hostile client or peer, for operations: the rendezvous store's keys, what
error bodies and `shardspec status` show, and a streaming client that never reads."""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta
from pathlib import Path

import httpx
import pytest
import torch.distributed as dist
import zmq
from test_failures import Worker
from test_server import start_server

import shardspec
from shardspec.orchestrator import group as orchestrator_group
from shardspec.orchestrator.workers import free_port
from shardspec.protocol import codec
from shardspec.protocol.codec import Message
from shardspec.protocol.messages import StatusReply, to_meta
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
    with ThreadPoolExecutor(2) as pool:  # (each waits for its worker to listen)
        workers = list(pool.map(lambda i: Worker(tmp_path, f"worker{i}"), range(2)))
    dist_port = free_port()

    async def run() -> tuple[list[int], list[int], list[str], list[bytes]]:
        async with shardspec.connect(model=str(tiny_model), workers=[w.address for w in workers], tp=2,
                                     dist_port=dist_port) as engine:
            before = await _tokens(engine)
            stranger = dist.TCPStore("127.0.0.1", dist_port, is_master=False, timeout=timedelta(seconds=10))
            names = stranger.list_keys()
            values = [stranger.get(name) for name in names]
            for name in names:  # overwritten, and one added under torch's own name: the group formed needs none
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


# --- what the server's error bodies show ------------------------------------------------------------


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """The bundled model on one spawned worker (an ipc:// socket in a private folder); responses a
    client does not read for 1 s are dropped."""
    started = start_server(tmp_path_factory.mktemp("hardening-ops"), "--local", "1", "--write-timeout", "1",
                           "--max-seq-len", "4096")
    yield started
    assert started.stop() == 0, started.log.read_text(errors="replace")


def test_the_503_bodies_of_health_and_completions_name_no_private_folder(server):
    (worker,) = server.worker_pids()
    os.kill(worker, signal.SIGSTOP)  # silent: the engine loses it and keeps trying to reconnect
    try:
        deadline = time.monotonic() + 60
        while (health := httpx.get(f"{server.root}/health", timeout=30)).status_code == 200:
            assert time.monotonic() < deadline, "the server did not notice the stopped worker"
            time.sleep(0.05)
        refused = httpx.post(f"{server.url}/completions", json={"prompt": "x", "max_tokens": 2}, timeout=30)
    finally:
        os.kill(worker, signal.SIGCONT)
    assert health.status_code == refused.status_code == 503
    for body in (health.text, refused.text):
        assert "worker0.sock" in body and "/tmp" not in body and f"shardspec-{server.proc.pid}-" not in body, body
    assert f"shardspec-{server.proc.pid}-" in server.log.read_text()  # (the log keeps the details)
    deadline = time.monotonic() + 120
    while httpx.get(f"{server.root}/health", timeout=30).status_code != 200:  # serving again, for the next test
        assert time.monotonic() < deadline, "the server did not recover"
        time.sleep(0.2)


# --- a client that does not read ------------------------------------------------------------------


@pytest.mark.slow  # (15-25 s of workers and timeouts)
def test_a_stream_nobody_reads_is_cut_after_the_write_timeout_and_frees_its_sequence(server):
    """A raw client with a small receive buffer asks for a long stream whose first event (the echoed
    prompt's log-probabilities) fills the server's send buffers, and never reads: after --write-timeout
    (1 s) without progress the server drops the connection and cancels the generation."""
    body = json.dumps({"prompt": "word " * 250, "max_tokens": 3000, "stream": True, "echo": True, "logprobs": 20,
                       "ignore_eos": True}).encode()
    host, port = server.root.removeprefix("http://").rsplit(":", 1)
    before = _request_outcomes(server)
    with socket.socket() as client:
        client.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        client.connect((host, int(port)))
        client.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                       b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
        deadline = time.monotonic() + 120  # (a bound against a hang: the property is the outcome)
        while "did not read its response for 1 s (--write-timeout)" not in server.log.read_text():
            assert time.monotonic() < deadline, "the unread stream's connection was never closed"
            time.sleep(0.1)
        while (outcomes := _request_outcomes(server)).get("cancelled", 0) == before.get("cancelled", 0):
            assert time.monotonic() < deadline, f"the unread stream was never cancelled: {outcomes}"
            time.sleep(0.1)
        while httpx.get(f"{server.url}/internal/stats", timeout=30).json()["running"] > 0:  # its sequence freed
            assert time.monotonic() < deadline, "the cancelled stream's sequence still runs"
            time.sleep(0.1)
        client.settimeout(30)
        assert b"[DONE]" not in _read_until_closed(client)  # the server closed it mid-response
    assert outcomes.get("finished") == before.get("finished")


def test_serve_refuses_a_write_timeout_that_is_not_positive(capsys):
    from shardspec.cli import main

    assert main(["serve", "--write-timeout=0"]) == 2
    assert "--write-timeout must be positive" in capsys.readouterr().err


def _request_outcomes(server) -> dict[str, float]:
    text = httpx.get(f"{server.root}/metrics", timeout=30).text
    return {m[1]: float(m[2]) for m in re.finditer(r'shardspec_requests_total\{endpoint="/v1/completions",'
                                                   r'outcome="(\w+)"\} (\S+)', text)}


def _read_until_closed(client: socket.socket) -> bytes:
    """What the client gets until the server closes the connection (EOF, or reset: unsent data dropped)."""
    parts = []
    try:
        while data := client.recv(1 << 16):
            parts.append(data)
    except ConnectionResetError:
        pass
    return b"".join(parts)


# --- shardspec status against a hostile endpoint --------------------------------------------------

FORGED = StatusReply(state="idle\x1b[2J\x1b[31m", owner="nobody\r\nworker tcp://10.0.0.9:1: idle; forged",
                     version="9\x07", device="cpu\x1b]0;title\x07", hostname="h\u202eost", pid=1, uptime_s=1.0,
                     rss_bytes=1, device_bytes=0, model="m", layers=[1])


class HostilePeer:
    """Something at an ipc:// address that answers one status request its own way (`answer(send, id)`)."""

    def __init__(self, path: Path, answer: Callable[[Callable[[list], None], int], None]):
        self.address = f"ipc://{path}"
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
        self.sock.setsockopt(zmq.SNDTIMEO, 30_000)
        self.sock.setsockopt(zmq.RCVTIMEO, 60_000)
        self.sock.bind(self.address)
        self.thread = threading.Thread(target=self._serve, args=(answer,), daemon=True)
        self.thread.start()

    def _serve(self, answer: Callable[[Callable[[list], None], int], None]) -> None:
        try:
            peer, *frames = self.sock.recv_multipart()
            answer(lambda reply: self.sock.send_multipart([peer, *reply], copy=False), codec.peek_id(frames))
        except zmq.ZMQError:  # the client left
            pass

    def close(self) -> None:
        self.thread.join(60)
        self.sock.close(linger=0)
        self.ctx.term()


def _status_against(tmp_path: Path, answer: Callable[[Callable[[list], None], int], None]) -> tuple[int, str, str, int]:
    """`shardspec status` against a HostilePeer: (exit code, stdout, stderr, its peak RSS in bytes)."""
    peer = HostilePeer(tmp_path / "hostile.sock", answer)
    out, err = tmp_path / "out.txt", tmp_path / "err.txt"
    try:
        with open(out, "wb") as stdout, open(err, "wb") as stderr:
            proc = subprocess.Popen([sys.executable, "-m", "shardspec", "status", peer.address, "--timeout", "60"],
                                    stdout=stdout, stderr=stderr, stdin=subprocess.DEVNULL)
            _, status, usage = os.wait4(proc.pid, 0)  # (not proc.wait: this gives the process's resources)
            proc.returncode = os.waitstatus_to_exitcode(status)
    finally:
        peer.close()
    return proc.returncode, out.read_text(), err.read_text(), usage.ru_maxrss * 1024


def _reply(reply_id: int, status: StatusReply = FORGED) -> list:
    return codec.encode(Message(StatusReply.OP, reply_id, to_meta(status), {}))


def test_status_drops_a_reply_over_its_bound_before_reading_it(tmp_path):
    huge = 256 << 20
    code, out, err, rss = _status_against(tmp_path, lambda send, _: send([bytes(huge)]))
    _, _, _, baseline = _status_against(tmp_path, lambda send, reply_id: send(_reply(reply_id)))
    assert code == 1 and f"over {codec.MAX_HEADER_BYTES} bytes" in out and "Traceback" not in err, (out, err)
    assert rss < baseline + huge // 4, (rss, baseline)


def test_status_logs_a_flood_of_bogus_replies_in_a_few_lines_and_prints_no_control_character(tmp_path):
    def flood(send: Callable[[list], None], reply_id: int) -> None:
        for i in range(10_000):
            send([b"\x1b[2J\x1b[Hjunk\r\n"])  # undecodable
            send(_reply(reply_id + 1 + i))  # matches no request
        send(_reply(reply_id))

    code, out, err, _ = _status_against(tmp_path, flood)
    assert code == 0, (out, err)
    assert len(err.splitlines()) < 20 and "left out" in err, err[-2000:]
    (line,) = out.splitlines()  # one line per address: the owner's \r\n did not forge a second
    assert not any(char in line + err for char in "\x1b\x07\r\u202e"), repr(line)
    assert "idle\\x1b[2J" in line and "nobody\\r\\nworker" in line
