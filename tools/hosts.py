"""Emulated hosts on one machine: Linux network namespaces, each plugged into a VDE switch of its
own, joined to a central switch through a wirefilter link with a one-way delay. Real Ethernet
frames cross the links, so TCP, ZeroMQ and Gloo all feel the delay (this kernel has no netem).

    with EmulatedHosts(2, delay_ms=1) as hosts:      # host to host: 2 x 1 ms one way
        proc = hosts.popen(0, [sys.executable, "-m", "shardspec", "worker", ...])

Needs root and Debian's vde2 and vde-wirefilter packages (.ci/run installs them);
`EmulatedHosts.missing()` says what is lacking, or None. Used by tests/test_netns.py and
bench/pipeline.py.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

TOOLS = ("ip", "vde_switch", "vde_plug2tap", "vde_plug", "dpipe", "wirefilter", "taskset")


class EmulatedHosts:
    """`count` hosts `delay_ms` one way from the central switch; `cores`: the CPU cores each host's
    processes may run on (taskset; None: any), so that hosts do not share cores as real ones would not."""

    def __init__(self, count: int, delay_ms: float, cores: list[str] | None = None, rate: float | None = None):
        self.count, self.delay_ms, self.cores = count, delay_ms, cores
        self.rate = rate  # each link's bandwidth in bytes/s, each way (None: as fast as wirefilter goes)
        self.tag = f"ssb{os.getpid() % 100000}"
        self.dir = Path(tempfile.mkdtemp(prefix="shardspec-hosts-"))
        self.namespaces: list[str] = []
        self.procs: list[subprocess.Popen] = []  # the switches and links
        self.guests: list[subprocess.Popen] = []  # what runs inside the hosts

    @staticmethod
    def missing() -> str | None:
        if os.geteuid() != 0:
            return "emulated hosts need root (network namespaces)"
        lacking = [tool for tool in TOOLS if not shutil.which(tool)]
        return f"emulated hosts need {', '.join(lacking)} (Debian: vde2, vde-wirefilter, iproute2)" if lacking else None

    def address(self, host: int) -> str:
        return f"198.18.0.{host + 1}"

    def __enter__(self) -> EmulatedHosts:
        try:
            self._daemon(["vde_switch", "-s", f"{self.dir}/core"])
            for i in range(self.count):
                self._host(i)
            time.sleep(1.0)  # the plugs attach
        except BaseException:
            self.__exit__()
            raise
        return self

    def _host(self, i: int) -> None:
        ns, tap, switch = f"{self.tag}h{i}", f"{self.tag}t{i}", f"{self.dir}/sw{i}"
        _run("ip", "netns", "add", ns)
        self.namespaces.append(ns)
        for cmd in (["ip", "link", "set", "lo", "up"], ["ip", "tuntap", "add", "dev", tap, "mode", "tap"],
                    ["ip", "addr", "add", f"{self.address(i)}/24", "dev", tap], ["ip", "link", "set", tap, "up"]):
            _run("ip", "netns", "exec", ns, *cmd)
        self._daemon(["vde_switch", "-s", switch])
        time.sleep(0.2)
        self._daemon(["ip", "netns", "exec", ns, "vde_plug2tap", "-s", switch, tap])
        band = ["-b", f"{self.rate:.0f}"] if self.rate else []
        self._daemon(["dpipe", "vde_plug", switch, "=", "wirefilter", "-d", f"{self.delay_ms:g}", *band, "=",
                      "vde_plug", f"{self.dir}/core"], session=False)  # dpipe makes its own process group

    def _daemon(self, cmd: list[str], session: bool = True) -> None:
        """A process group of its own, killed whole at exit."""
        self.procs.append(subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.DEVNULL,
                                           stderr=subprocess.DEVNULL, start_new_session=session))

    def popen(self, host: int, cmd: list[str], **kwargs) -> subprocess.Popen:
        """A process inside host `host`'s namespace, on its cores (stopped at exit if still running)."""
        pinned = ["taskset", "-c", self.cores[host]] if self.cores else []
        proc = subprocess.Popen(["ip", "netns", "exec", self.namespaces[host], *pinned, *cmd], **kwargs)
        self.guests.append(proc)
        return proc

    def set_link(self, host: int, up: bool) -> None:
        """Take host `host`'s network link down (no frame in or out, as when a cable is pulled) or up."""
        _run("ip", "netns", "exec", self.namespaces[host], "ip", "link", "set", f"{self.tag}t{host}",
             "up" if up else "down")

    def wait_listening(self, host: int, port: int, timeout: float = 120.0) -> None:
        """Until something accepts TCP on `host`'s address and `port`, seen from host 0."""
        probe = f"import socket; socket.create_connection(('{self.address(host)}', {port}), timeout=1).close()"
        deadline = time.monotonic() + timeout
        while subprocess.run(["ip", "netns", "exec", self.namespaces[0], sys.executable, "-c", probe],
                             capture_output=True, check=False).returncode != 0:
            if time.monotonic() > deadline:
                raise TimeoutError(f"nothing listening on {self.address(host)}:{port}")
            time.sleep(0.3)

    def __exit__(self, *_exc) -> None:
        for proc in self.guests:
            if proc.poll() is None:
                proc.terminate()
        for proc in self.guests:
            try:
                proc.wait(20)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        for proc in reversed(self.procs):
            if proc.poll() is None:
                os.killpg(proc.pid, 15)
        for proc in self.procs:
            try:
                proc.wait(5)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, 9)
        for ns in self.namespaces:
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)
        shutil.rmtree(self.dir, ignore_errors=True)


def _run(*cmd: str) -> None:
    subprocess.run(cmd, check=True, capture_output=True, text=True)
