"""Shared fixtures: random checkpoints, and worker daemons run as real processes."""

from __future__ import annotations

import argparse
import os
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
import torch
import zmq

if not torch.cuda.is_available():  # before anything imports Triton: its kernels then run interpreted
    os.environ.setdefault("TRITON_INTERPRET", "1")

from shardspec.testing.random_checkpoint import tiny_config, write_random_checkpoint

sys.path.insert(0, str(Path(__file__).parents[1] / "tools"))  # tools/hosts.py: the emulated hosts


def pytest_addoption(parser) -> None:
    parser.addoption("--worker-flags", default="", help="the workers' options for this run, as shardspec "
                     "generate's flags (e.g. '--allreduce nccl --draft-head cublas'): for the models built "
                     "in-process and the engines of tests/test_cuda.py")


def pytest_configure(config) -> None:
    from shardspec import kernels
    from shardspec.option_flags import add_flags, from_flags
    from shardspec.protocol.messages import WorkerOptions

    flags = argparse.ArgumentParser(prog="pytest --worker-flags")
    add_flags(flags, WorkerOptions, "worker options", "")
    try:
        args = flags.parse_args(shlex.split(config.getoption("--worker-flags")))
    except SystemExit:  # argparse has printed what is wrong
        raise pytest.UsageError("--worker-flags takes shardspec generate's worker option flags") from None
    kernels.use(from_flags(args, WorkerOptions))
    # xdist's test processes share the machine's cores: each computes in-process on its share, not on all of
    # them at once (which oversubscribed two cores beside the worker daemons the other process spawns)
    processes = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    if processes > 1 and not torch.cuda.is_available():
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // processes))


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


class WorkerPool:
    """Worker daemons started once per test process and lent to the tests that only need an engine:
    an engine's goodbye leaves its workers idle for the next (as for any orchestrator), so a test
    pays for a load, not for starting processes. A worker found dead is started again."""

    def __init__(self) -> None:
        self.folder: Path | None = None
        self.workers: list[WorkerProcess] = []
        self.started = 0

    def take(self, count: int) -> list[str]:
        """The addresses of `count` idle workers (the first `count` of the pool)."""
        for i, worker in enumerate(self.workers[:count]):
            if worker.proc.poll() is not None:
                self.workers[i] = self._start()
        while len(self.workers) < count:
            self.workers.append(self._start())
        for worker in self.workers[:count]:
            wait_for_socket(worker.address, process=worker.proc)
        return [worker.address for worker in self.workers[:count]]

    def _start(self) -> WorkerProcess:
        if self.folder is None:
            self.folder = Path(tempfile.mkdtemp(prefix="pytest-pool-"))
        self.started += 1
        return WorkerProcess(self.folder / f"w{self.started}.sock")

    def stop(self) -> None:
        for worker in self.workers:
            worker.stop()
        if self.folder is not None:
            shutil.rmtree(self.folder, ignore_errors=True)


POOL = WorkerPool()


def full_blocks(engine) -> list[int]:
    """K/V blocks for a sequence of any length, from an engine's pool, for a test that sends its own
    steps through engine.group (the engine's requests get theirs from its scheduler)."""
    paging = engine.group.paging
    return engine.scheduler.pool.take(paging.blocks_for(paging.context))


def pooled(count: int) -> list[str]:
    """`count` worker addresses for `connect(workers=...)`, shared by this test process's tests."""
    return POOL.take(count)


def pytest_sessionfinish(session, exitstatus) -> None:
    POOL.stop()


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
        return self.receive(timeout_ms)

    def receive(self, timeout_ms: int = 20_000) -> list[bytes]:
        """The next message from the worker."""
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
