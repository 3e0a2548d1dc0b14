"""Two "hosts" made of Linux network namespaces joined by a veth pair with 5 ms of added latency
(tc netem): TP = 2 generation over CURVE between them gives the loopback output.

Host A runs the orchestrator and worker 0 (rank 0, hence the rendezvous), host B runs worker 1;
every orchestrator <-> worker 1 message and every collective crosses the slow link. Needs root and
iproute2 (`ip`, `tc`) on a kernel with network namespaces and the netem qdisc; elsewhere the test
is skipped and says which of these is missing.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

import shardspec
from shardspec import security

PROMPT = [5, 17, 300, 42, 7, 99]
LATENCY_MS = 5
NEEDS = "needs root and iproute2 (ip, tc) with network namespaces and the netem qdisc (kernel module sch_netem)"


class Hosts:
    """Namespaces A (10.231.0.1) and B (10.231.0.2) on one veth pair, `latency_ms` added each way."""

    def __init__(self, latency_ms: int):
        tag = f"ss{os.getpid() % 100000}"
        self.ns = {"a": f"{tag}a", "b": f"{tag}b"}
        self.dev = {"a": f"{tag}va", "b": f"{tag}vb"}
        self.ip = {"a": "10.231.0.1", "b": "10.231.0.2"}
        self.latency_ms = latency_ms
        self.procs: list[subprocess.Popen] = []

    def __enter__(self) -> Hosts:
        try:
            self._ip("netns", "add", self.ns["a"])
            self._ip("netns", "add", self.ns["b"])
            self._ip("link", "add", self.dev["a"], "type", "veth", "peer", "name", self.dev["b"])
            for host in "ab":
                self._ip("link", "set", self.dev[host], "netns", self.ns[host])
                self._ip("-n", self.ns[host], "addr", "add", f"{self.ip[host]}/24", "dev", self.dev[host])
                self._ip("-n", self.ns[host], "link", "set", self.dev[host], "up")
                self._ip("-n", self.ns[host], "link", "set", "lo", "up")
                if self.latency_ms:
                    _run("tc", "-n", self.ns[host], "qdisc", "add", "dev", self.dev[host], "root", "netem", "delay",
                         f"{self.latency_ms}ms")
        except subprocess.CalledProcessError as exc:
            self.__exit__()
            pytest.skip(f"{NEEDS}: `{' '.join(exc.cmd)}` failed: {exc.stderr.strip()}")
        return self

    def __exit__(self, *_exc) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for proc in self.procs:
            try:
                proc.wait(20)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        for ns in self.ns.values():  # deleting a namespace deletes its end of the veth, and so the pair
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, check=False)

    def _ip(self, *args: str) -> None:
        _run("ip", *args)

    def spawn(self, host: str, args: list[str], log: Path, **kwargs) -> subprocess.Popen:
        """A shardspec command inside host's namespace. GLOO_SOCKET_IFNAME is left unset: a worker
        must find the veth itself (the host name resolves to a loopback address here)."""
        env = {key: value for key, value in os.environ.items() if key != "GLOO_SOCKET_IFNAME"}
        cmd = ["ip", "netns", "exec", self.ns[host], sys.executable, "-m", "shardspec", *args]
        with open(log, "ab") as out:
            proc = subprocess.Popen(cmd, stdout=kwargs.get("stdout", out), stderr=out, stdin=subprocess.DEVNULL,
                                    env=env)
        self.procs.append(proc)
        return proc

    def qdisc(self, host: str) -> str:
        return _run("tc", "-n", self.ns[host], "qdisc", "show", "dev", self.dev[host]).stdout


def _run(*cmd: str) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, capture_output=True, text=True, check=True, timeout=30)


def wait_listening(hosts: Hosts, host: str, port: int, timeout: float = 120.0) -> None:
    """Until something accepts TCP on host's address and port (checked from inside host A)."""
    probe = f"import socket; socket.create_connection(('{hosts.ip[host]}', {port}), timeout=1).close()"
    deadline = time.monotonic() + timeout
    while subprocess.run(["ip", "netns", "exec", hosts.ns["a"], sys.executable, "-c", probe],
                         capture_output=True, check=False).returncode != 0:
        assert time.monotonic() < deadline, f"no worker listening on {hosts.ip[host]}:{port}"
        time.sleep(0.3)


def loopback_output(model: Path) -> list[int]:
    async def run():
        async with shardspec.connect(model=str(model), local=2) as engine:
            tokens = []
            async for chunk in engine.generate(PROMPT, max_tokens=24):
                tokens += chunk.token_ids
            return tokens

    return asyncio.run(run())


@pytest.mark.skipif(os.geteuid() != 0 or not (shutil.which("ip") and shutil.which("tc")), reason=NEEDS)
def test_tp2_with_curve_across_two_network_namespaces_with_latency_matches_loopback(tiny_model, tmp_path):
    worker_pub, _ = security.generate(tmp_path / "keys" / "worker", "worker")
    orchestrator_pub, _ = security.generate(tmp_path / "keys" / "orchestrator", "orchestrator")
    with Hosts(LATENCY_MS) as hosts:
        assert f"delay {LATENCY_MS}ms" in hosts.qdisc("a") and f"delay {LATENCY_MS}ms" in hosts.qdisc("b")
        addresses = [f"tcp://{hosts.ip[host]}:7000" for host in "ab"]
        for host, address in zip("ab", addresses):
            hosts.spawn(host, ["worker", "--listen", address, "--threads", "1", "--keys",
                               str(tmp_path / "keys" / "worker"), "--allow", str(orchestrator_pub)],
                        tmp_path / f"worker-{host}.log")
        for host in "ab":
            wait_listening(hosts, host, 7000)
        orchestrator = hosts.spawn(
            "a", ["generate", "--model", str(tiny_model), "--workers", ",".join(addresses), "--prompt-ids",
                  ",".join(map(str, PROMPT)), "--max-tokens", "24", "--temperature", "0", "--json",
                  "--keys", str(tmp_path / "keys" / "orchestrator"), "--server-keys", str(worker_pub)],
            tmp_path / "orchestrator.log", stdout=subprocess.PIPE)
        out, _ = orchestrator.communicate(timeout=300)
        logs = "\n".join(p.read_text(errors="replace")[-2000:] for p in sorted(tmp_path.glob("*.log")))
        assert orchestrator.returncode == 0, logs
        remote = json.loads(out)["token_ids"]
    assert remote == loopback_output(tiny_model) and len(remote) == 24
