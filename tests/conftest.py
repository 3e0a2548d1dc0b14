"""Shared fixtures: random checkpoints, and worker daemons run as real processes."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import zmq

if not torch.cuda.is_available():  # before anything imports Triton: its kernels then run interpreted
    os.environ.setdefault("TRITON_INTERPRET", "1")

from shardspec.models.random_checkpoint import tiny_config, write_random_checkpoint

sys.path.insert(0, str(Path(__file__).parents[1] / "tools"))  # tools/hosts.py: the emulated hosts


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> Path:
    """Tiny random Qwen3.5 with MTP, text-only layout (`model.*`), one file."""
    path = tmp_path_factory.mktemp("tiny-model")
    write_random_checkpoint(path, tiny_config(), seed=1, layout="model")
    return path


@pytest.fixture(scope="session")
def tiny_model_vl(tmp_path_factory) -> Path:
    """The same weights in the multimodal layout (`model.language_model.*`), sharded with an index."""
    path = tmp_path_factory.mktemp("tiny-model-vl")
    write_random_checkpoint(path, tiny_config(), seed=1, layout="language_model", shards=3)
    return path


@pytest.fixture(scope="session")
def small_vocab_model(tmp_path_factory) -> Path:
    """A 16-token vocabulary: random MTP drafts then match the target often enough to exercise
    acceptance of 0..k drafts, and sampled distributions are cheap to estimate."""
    path = tmp_path_factory.mktemp("small-vocab-model")
    write_random_checkpoint(path, tiny_config(vocab_size=16), seed=5, layout="model")
    return path


def _die_with_the_tests() -> None:
    """In a worker the tests start: SIGTERM when the test process dies, however it dies (Linux)."""
    import ctypes

    ctypes.CDLL("libc.so.6").prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


class WorkerProcess:
    """A `shardspec worker` daemon on an ipc:// socket, stopped (and checked stopped) at teardown."""

    def __init__(self, path: Path, *extra: str, threads: int | None = 1):
        self.address = f"ipc://{path}"
        self.log = path.with_suffix(".log")
        cmd = [sys.executable, "-m", "shardspec", "worker", "--listen", self.address, *extra]
        if threads is not None:
            cmd += ["--threads", str(threads)]
        with open(self.log, "wb") as log:
            self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                         preexec_fn=_die_with_the_tests)

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode

    def log_text(self) -> str:
        return self.log.read_text(errors="replace")


@pytest.fixture
def spawn_worker(tmp_path):
    """Factory: spawn_worker() -> WorkerProcess; all are stopped at teardown."""
    started: list[WorkerProcess] = []

    def spawn(*extra: str, threads: int | None = 1) -> WorkerProcess:
        worker = WorkerProcess(tmp_path / f"w{len(started)}.sock", *extra, threads=threads)
        started.append(worker)
        wait_for_socket(worker.address, process=worker.proc)  # an orchestrator gives up on a refused address
        return worker

    yield spawn
    for worker in started:
        worker.stop()


def wait_for_socket(path: str, timeout: float = 60.0, process: subprocess.Popen | None = None) -> None:
    deadline = time.monotonic() + timeout
    while not os.path.exists(path.removeprefix("ipc://")):
        if time.monotonic() > deadline:
            raise TimeoutError(f"{path} never appeared")
        if process is not None and process.poll() is not None:
            return  # it exited: the test sees why
        time.sleep(0.05)


class SyncClient:
    """A blocking DEALER for raw-wire tests: send arbitrary frames, read one reply."""

    def __init__(self, address: str):
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(address)

    def exchange(self, frames: list, timeout_ms: int = 20_000) -> list[bytes]:
        self.sock.send_multipart(frames)
        if not self.sock.poll(timeout_ms):
            raise TimeoutError("no reply")
        return self.sock.recv_multipart()

    def close(self) -> None:
        self.sock.close(linger=0)
        self.ctx.term()


@pytest.fixture
def sync_client():
    clients: list[SyncClient] = []

    def make(address: str) -> SyncClient:
        clients.append(SyncClient(address))
        return clients[-1]

    yield make
    for client in clients:
        client.close()
