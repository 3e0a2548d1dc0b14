"""CURVE authentication and encryption between orchestrators and workers on tcp://."""

from __future__ import annotations

import asyncio
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import zmq
import zmq.auth

import shardspec
from shardspec import security
from shardspec.orchestrator.workers import WorkerLost, free_port
from shardspec.testing.network import wait_listening


def shardspec_cli(*args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "shardspec", *args], capture_output=True, text=True, timeout=timeout)


@pytest.fixture(scope="module")
def keys(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("keys")
    for name in ("worker", "orchestrator", "stranger"):
        assert shardspec_cli("keys", "generate", str(root / name), "--name", name).returncode == 0
    return {name: root / name for name in ("worker", "orchestrator", "stranger")}


@pytest.fixture
def secure_worker(keys, tmp_path):
    port = free_port()
    address = f"tcp://127.0.0.1:{port}"
    with open(tmp_path / "worker.log", "wb") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "shardspec", "worker", "--listen", address, "--threads", "1",
             "--keys", str(keys["worker"]), "--allow", str(keys["orchestrator"] / "orchestrator.key")],
            stdout=log, stderr=subprocess.STDOUT,
        )
    wait_listening(port)
    yield address
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(20) == 0


def test_keys_generate_writes_a_zeromq_certificate_pair_and_never_overwrites_it(tmp_path):
    assert shardspec_cli("keys", "generate", str(tmp_path), "--name", "node").returncode == 0
    public, secret = zmq.auth.load_certificate(str(tmp_path / "node.key_secret"))
    assert len(public) == len(secret) == 40 and (tmp_path / "node.key").is_file()
    assert (tmp_path / "node.key_secret").stat().st_mode & 0o077 == 0
    again = shardspec_cli("keys", "generate", str(tmp_path), "--name", "node")
    assert again.returncode == 2 and "not overwriting" in again.stderr
    assert zmq.auth.load_certificate(str(tmp_path / "node.key_secret"))[1] == secret
    for name in ("../outside", "", "a/b"):  # (a name is a file name: nothing lands outside DIR)
        with pytest.raises(security.KeyFileError, match="a key pair's name"):  # (the CLI's usage error, exit 2)
            security.generate(tmp_path / "in", name)
    assert not (tmp_path / "outside.key").exists() and not (tmp_path / "in").exists()


def generate(model, address, **security) -> list[int]:
    async def run():
        async with shardspec.connect(model=str(model), workers=[address], connect_timeout=60, **security) as engine:
            out = []
            async for chunk in engine.generate([1, 2, 3], max_tokens=6):
                out += chunk.token_ids
            return out

    return asyncio.run(run())


def test_only_a_client_with_an_allowed_key_and_the_right_server_key_gets_in(tiny_model, keys, secure_worker):
    right = {"keys": str(keys["orchestrator"]), "server_keys": str(keys["worker"] / "worker.key")}
    assert len(generate(tiny_model, secure_worker, **right)) == 6
    with pytest.raises(WorkerLost, match="refused this orchestrator's key"):
        generate(tiny_model, secure_worker, keys=str(keys["stranger"]), server_keys=right["server_keys"])
    with pytest.raises(WorkerLost, match="handshake"):
        generate(tiny_model, secure_worker, keys=right["keys"], server_keys=str(keys["stranger"] / "stranger.key"))
    with pytest.raises(WorkerLost, match="handshake"):
        generate(tiny_model, secure_worker)
    assert len(generate(tiny_model, secure_worker, **right)) == 6  # the worker kept serving


def test_worker_refuses_a_network_address_without_keys_unless_insecure(tmp_path):
    port = free_port()
    address = f"tcp://0.0.0.0:{port}"
    refused = shardspec_cli("worker", "--listen", address)
    assert refused.returncode == 2
    assert "shardspec keys generate" in refused.stderr and "--insecure" in refused.stderr
    proc = subprocess.Popen([sys.executable, "-m", "shardspec", "worker", "--listen", address, "--insecure"],
                            stderr=subprocess.PIPE, text=True)
    wait_listening(port)  # it runs, as asked
    assert proc.poll() is None
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(20) == 0
    assert "INSECURE" in proc.stderr.read()


@pytest.mark.skipif(shutil.which("tcpdump") is None, reason="needs tcpdump (apt-get install tcpdump) and root")
def test_captured_traffic_carries_the_prompt_in_clear_only_without_curve(tiny_model, keys, secure_worker, tmp_path):
    import struct

    prompt = [411, 97, 263, 305, 171, 444, 58, 310]  # as it travels: one int64 frame
    needle = b"".join(struct.pack("<q", t) for t in prompt)

    def captured(address, **security) -> bytes:
        port = address.rsplit(":", 1)[1]
        pcap = tmp_path / f"{port}.pcap"
        dump = subprocess.Popen(["tcpdump", "-i", "lo", "-w", str(pcap), "-U", f"tcp port {port}"],
                                stderr=subprocess.DEVNULL)
        time.sleep(1)

        async def run():
            async with shardspec.connect(model=str(tiny_model), workers=[address], **security) as engine:
                async for _ in engine.generate(prompt, max_tokens=4):
                    pass

        asyncio.run(run())
        time.sleep(1)
        dump.send_signal(signal.SIGINT)
        dump.wait(10)
        return pcap.read_bytes()

    plain_port = free_port()
    plain = subprocess.Popen([sys.executable, "-m", "shardspec", "worker", "--listen", f"tcp://127.0.0.1:{plain_port}",
                              "--threads", "1", "--insecure"], stderr=subprocess.DEVNULL)
    try:
        wait_listening(plain_port)
        assert needle in captured(f"tcp://127.0.0.1:{plain_port}")  # the capture sees frames in clear
    finally:
        plain.terminate()
        plain.wait(20)
    secured = captured(secure_worker, keys=str(keys["orchestrator"]), server_keys=str(keys["worker"] / "worker.key"))
    assert needle not in secured and b"prefill" not in secured


def test_serve_reaches_a_curve_worker_with_keys_and_server_keys(tiny_model, keys, secure_worker, tmp_path):
    import httpx
    from test_server import start_server

    server = start_server(tmp_path, "--model", str(tiny_model), "--workers", secure_worker, "--max-seq-len", "128",
                          "--keys", str(keys["orchestrator"]), "--server-keys", str(keys["worker"] / "worker.key"))
    try:
        reply = httpx.post(f"{server.url}/completions", json={"prompt": [1, 2, 3], "max_tokens": 6}, timeout=60)
        assert reply.status_code == 200 and reply.json()["usage"]["completion_tokens"] == 6
    finally:
        assert server.stop() == 0
    refused = shardspec_cli("serve", "--model", str(tiny_model), "--workers", secure_worker, "--port", "0",
                            "--keys", str(keys["stranger"]), "--server-keys", str(keys["worker"] / "worker.key"))
    assert refused.returncode == 1 and "refused this orchestrator's key" in refused.stderr


def free_port_run(count: int) -> int:
    """A loopback port p with p .. p + count - 1 all free (a worker, its rendezvous, its stage link)."""
    while True:
        base = free_port()
        try:
            for port in range(base, base + count):
                socket.create_server(("127.0.0.1", port)).close()
            return base
        except OSError:
            continue


def test_curve_stage_links_take_hidden_states_only_from_the_ranks_that_send_them(tiny_model, keys, tmp_path):
    from shardspec.protocol import transport
    from shardspec.protocol.codec import Message
    from shardspec.protocol.messages import HiddenStates, to_meta
    from shardspec.security import load_pair, load_public_keys, make_client

    ports = [free_port_run(3) for _ in range(2)]
    addresses = [f"tcp://127.0.0.1:{port}" for port in ports]
    procs = []
    for i, address in enumerate(addresses):
        with open(tmp_path / f"worker{i}.log", "wb") as log:
            procs.append(subprocess.Popen(
                [sys.executable, "-m", "shardspec", "worker", "--listen", address, "--threads", "1", "--keys",
                 str(keys["worker"]), "--allow", str(keys["orchestrator"] / "orchestrator.key")],
                stdout=log, stderr=subprocess.STDOUT))
    try:
        for port in ports:
            wait_listening(port)

        async def run():
            async with shardspec.connect(model=str(tiny_model), workers=addresses, pp=2, keys=str(keys["orchestrator"]),
                                         server_keys=str(keys["worker"] / "worker.key")) as engine:
                async def tokens():
                    return [t async for chunk in engine.generate([1, 2, 3], max_tokens=8) for t in chunk.token_ids]

                before = await tokens()
                # a stranger with a key of its own, and the worker's right server key, pushes hidden states
                # at worker 1's stage link
                ctx = zmq.Context()
                push = ctx.socket(zmq.PUSH)
                make_client(push, load_pair(keys["stranger"]), load_public_keys(keys["worker"] / "worker.key")[0])
                push.connect(f"tcp://127.0.0.1:{ports[1] + 2}")
                fake = Message(HiddenStates.OP, 0, to_meta(HiddenStates(1, 0)), {"hidden": torch.zeros(1, 3, 64)})
                transport.send(push, fake)
                deadline = time.monotonic() + 20
                while "unknown CURVE key" not in (tmp_path / "worker1.log").read_text():
                    assert time.monotonic() < deadline, "the stranger's link was never refused"
                    await asyncio.sleep(0.1)
                push.close(linger=0)
                ctx.term()
                return before, await tokens()

        before, after = asyncio.run(run())
        assert before == after and len(before) == 8  # the stages kept serving, unharmed
    finally:
        for proc in procs:
            proc.send_signal(signal.SIGTERM)
            proc.wait(20)
