"""Hardening against what the filesystem, a hung worker and the machine's other users can do:
model folders whose files are FIFOs, devices or lies; a worker that hangs while its heartbeats
keep flowing; key files and spawned workers' folders other users could read or that outlive a crash."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import shutil
import stat
import struct
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import zmq.auth
from conftest import wait_for_socket

import shardspec
from shardspec import security
from shardspec.cli import BUNDLED_MODEL, UsageError, build_parser, engine_config
from shardspec.layers.parallel import TPGroup
from shardspec.models import loader
from shardspec.models.checkpoint import checkpoint_files
from shardspec.models.config import ConfigError, read_config
from shardspec.orchestrator import workers
from shardspec.orchestrator.engine import EngineError
from shardspec.orchestrator.group import (
    GUESSED_S_PER_TOKEN_PER_GB,
    STEP_FLOOR_S,
    STEP_SLACK,
    WARMUP_FLOOR_S,
    WARMUP_STEPS,
    StepWatchdog,
)
from shardspec.orchestrator.tokenizer import Tokenizer
from shardspec.protocol import ErrorCode, Message, decode, encode, transport
from shardspec.shard_worker.profiling import TEST_HANG_ENV

LOAD = {"dtype": "auto", "max_seqs": 2, "max_seq_len": 64, "prefill_chunk": 8}


def copy_model(source: Path, target: Path) -> Path:
    shutil.copytree(source, target, symlinks=True)
    return target


def with_config(folder: Path, **changes) -> Path:
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, **changes}))
    return folder


# --- model folders -----------------------------------------------------------------------------


def test_a_worker_refuses_a_fifo_config_json_at_once_and_still_serves(tiny_model, tmp_path, spawn_worker,
                                                                      sync_client):
    fifo_model = copy_model(tiny_model, tmp_path / "fifo-model")
    (fifo_model / "config.json").unlink()
    os.mkfifo(fifo_model / "config.json")  # nobody ever writes: a blocking open or read never returns
    worker = spawn_worker()
    wait_for_socket(worker.address)
    client = sync_client(worker.address)

    def call(op: str, request_id: int, meta: dict) -> Message:
        return decode(client.exchange(encode(Message(op, request_id, meta)), timeout_ms=30_000))

    assert call("hello", 1, {"client": "test"}).op == "hello"
    init = {"rank": 0, "world_size": 1, "dist_addr": "tcp://127.0.0.1:1", "timeout_s": 5.0}
    assert call("init", 2, init).op == "init"
    refused = call("load", 3, {"model": str(fifo_model), **LOAD})  # dtype auto: the dtype is read from it too
    assert refused.op == "error" and refused.meta["code"] == ErrorCode.NOT_FOUND
    assert "FIFO" in refused.meta["message"] and "config.json" in refused.meta["message"]
    loaded = call("load", 4, {"model": str(tiny_model), **LOAD})  # the same worker loads a good folder
    assert loaded.op == "load" and loaded.meta["weight_bytes"] > 0
    assert worker.proc.poll() is None


@pytest.mark.parametrize("name", ["config.json", "tokenizer_config.json", "tokenizer.json", "model.safetensors"])
def test_a_model_file_linked_to_dev_zero_is_refused_without_reading_it(tiny_model, tmp_path, name):
    folder = copy_model(tiny_model, tmp_path / "zero-model")
    for tokenizer_file in ("tokenizer.json", "tokenizer_config.json"):  # present, so that each file is read
        shutil.copy(BUNDLED_MODEL / tokenizer_file, folder)
    (folder / name).unlink()
    (folder / name).symlink_to("/dev/zero")
    read = {"config.json": read_config, "tokenizer_config.json": Tokenizer.from_folder,
            "tokenizer.json": Tokenizer.from_folder, "model.safetensors": checkpoint_files}[name]
    with pytest.raises(ConfigError, match=f"{name}: it is a device, not a regular file"):
        read(folder)


def test_a_config_json_over_its_size_bound_is_refused(tiny_model, tmp_path):
    folder = with_config(copy_model(tiny_model, tmp_path / "big"), padding="x" * (16 * 2**20))
    with pytest.raises(ConfigError, match="at most 16777216"):
        read_config(folder)


@pytest.mark.parametrize(("field", "value"), [("vocab_size", 10**10), ("num_hidden_layers", 10**9),
                                              ("num_attention_heads", -1), ("hidden_size", "64"),
                                              ("vocab_size", True)])
def test_an_absurd_size_in_config_json_is_refused_naming_the_field(tiny_model, tmp_path, field, value):
    folder = with_config(copy_model(tiny_model, tmp_path / "absurd"), **{field: value})
    with pytest.raises(ConfigError, match=f"{field}={value!r} is out of range"):
        loader.load_model(folder, TPGroup(), torch.float32, torch.device("cpu"))


def test_a_config_implying_a_10_gb_embedding_is_refused_before_allocating(tiny_model, tmp_path, monkeypatch):
    folder = with_config(copy_model(tiny_model, tmp_path / "huge"), vocab_size=2_500_000, hidden_size=2048)
    allocated = []
    monkeypatch.setattr(torch.nn.Module, "to_empty", lambda *a, **k: allocated.append(a) or pytest.fail("allocated"))
    with pytest.raises(ConfigError, match=r"tensor 'model\.[a-z_.0-9]+' has shape .*, the config implies"):
        loader.load_model(folder, TPGroup(), torch.bfloat16, torch.device("cpu"))
    assert not allocated


def test_a_safetensors_header_claiming_more_bytes_than_the_file_holds_is_refused(tmp_path):
    header = json.dumps({"model.embed_tokens.weight": {"dtype": "BF16", "shape": [10**6, 5000],
                                                       "data_offsets": [0, 4]}}).encode()
    (tmp_path / "model.safetensors").write_bytes(struct.pack("<Q", len(header)) + header + b"\0" * 4)
    with pytest.raises(ConfigError, match="shape, dtype and data offsets must agree"):
        checkpoint_files(tmp_path)


@pytest.mark.parametrize("shard", ["../outside.safetensors", "/dev/zero"])
def test_a_checkpoint_index_cannot_name_a_file_outside_the_model_folder(tmp_path, shard):
    index = {"weight_map": {"model.embed_tokens.weight": shard}}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(ConfigError, match="inside the model folder"):
        checkpoint_files(tmp_path)


# --- the step watchdog -------------------------------------------------------------------------

HANG_S = 10.0


@pytest.mark.slow  # (15-25 s of workers and timeouts)
def test_a_worker_hung_in_a_step_fails_the_stream_naming_it_and_the_engine_serves_again(tiny_model, spawn_worker,
                                                                                        monkeypatch):
    monkeypatch.setenv(TEST_HANG_ENV, f"4:{HANG_S}")  # its 4th step sleeps; libzmq still answers heartbeats
    worker = spawn_worker()
    monkeypatch.delenv(TEST_HANG_ENV)

    async def run():
        async with shardspec.connect(model=str(tiny_model), workers=[worker.address], step_timeout=2) as engine:
            received = []
            started = time.monotonic()
            with pytest.raises(EngineError) as failed:
                async for chunk in engine.generate([5, 17, 300, 42], max_tokens=500, stop_at_eos=False):
                    received += chunk.token_ids
                    started = time.monotonic()
            elapsed = time.monotonic() - started
            deadline = time.monotonic() + 120
            while not engine.healthy:
                assert time.monotonic() < deadline, f"the engine did not recover: {engine.failure}"
                await asyncio.sleep(0.1)
            after = []
            async for chunk in engine.generate([5, 17, 300, 42], max_tokens=40, stop_at_eos=False):
                after += chunk.token_ids
            return received, elapsed, str(failed.value), after

    received, elapsed, error, after = asyncio.run(run())
    assert worker.address in error and "did not answer its step within 2s" in error
    assert elapsed < HANG_S  # the watchdog, not the end of the hang, ended the stream
    assert received and after[: len(received)] == received  # the same greedy output, served again


# longer than the worker's queue takes keepalive hellos: had they piled up while the worker was busy,
# libzmq would have stopped reading its connection (heartbeats too) and the connection would drop
LONG_STEP_S = transport.WORKER_QUEUED_REQUESTS * transport.KEEPALIVE_S + 4


@pytest.mark.slow  # one step of LONG_STEP_S
def test_a_step_longer_than_the_worker_s_queue_of_keepalives_keeps_its_connection(tiny_model, spawn_worker,
                                                                                    monkeypatch):
    monkeypatch.setenv(TEST_HANG_ENV, f"3:{LONG_STEP_S}")
    worker = spawn_worker()
    monkeypatch.delenv(TEST_HANG_ENV)

    async def run(address):
        async with shardspec.connect(model=str(tiny_model), workers=[address], step_timeout=LONG_STEP_S + 60) as engine:
            started = time.monotonic()
            tokens = [t async for chunk in engine.generate([5, 17, 300, 42], max_tokens=8, stop_at_eos=False)
                      for t in chunk.token_ids]
            return tokens, time.monotonic() - started

    tokens, elapsed = asyncio.run(run(worker.address))
    assert elapsed >= LONG_STEP_S  # the long step really happened, inside this generation
    assert tokens == asyncio.run(run(spawn_worker().address))[0]  # and the output is the usual one


def test_the_derived_step_bound_has_a_warm_up_floor_then_scales_with_the_measured_rate():
    watchdog = StepWatchdog(configured=0)
    watchdog.loaded(weight_bytes=2 * 10**9, draft_tokens=3)
    batch = SimpleNamespace(prefill=[SimpleNamespace(prompt=[1] * 100)], decode=[7, 8])
    assert watchdog.tokens(batch) == 100 + 2 * 4
    assert watchdog.bound(100) == WARMUP_FLOOR_S  # compiling, capturing: generous
    for _ in range(WARMUP_STEPS):
        watchdog.measured(8, 500.0)  # warm-up steps say nothing of the rate
    assert watchdog.bound(100) == STEP_FLOOR_S + STEP_SLACK * GUESSED_S_PER_TOKEN_PER_GB * 2 * 100
    watchdog.measured(8, 0.08)  # 10 ms per token
    assert watchdog.bound(8) == STEP_FLOOR_S + STEP_SLACK * 0.01 * 8
    assert watchdog.bound(4000) == pytest.approx(STEP_FLOOR_S + STEP_SLACK * 0.01 * 4000)
    watchdog.measured(8, 0.01)  # a faster step does not lower the bound
    assert watchdog.bound(8) == STEP_FLOOR_S + STEP_SLACK * 0.01 * 8
    assert StepWatchdog(configured=2.5).bound(10**6) == 2.5


def test_step_timeout_is_a_flag_of_generate_and_serve_and_is_checked():
    for command in ("generate", "serve"):
        args = build_parser().parse_args([command, "--step-timeout", "7.5", *(["x"] if command == "generate" else [])])
        assert engine_config(args).step_timeout == 7.5
    args = build_parser().parse_args(["generate", "x", "--step-timeout", "-1"])
    with pytest.raises(UsageError, match=r"--step-timeout must be a number of seconds in \[0, "):
        engine_config(args)


# --- key files, spawned workers' folders, the restart budget -----------------------------------


def test_key_files_and_their_folder_are_private_from_creation_even_under_umask_000(tmp_path):
    folder = tmp_path / "new" / "keys"  # its parent is missing too
    old = os.umask(0)
    try:
        public, secret = security.generate(folder, "worker")
    finally:
        os.umask(old)
    assert stat.S_IMODE(folder.stat().st_mode) == stat.S_IMODE(folder.parent.stat().st_mode) == 0o700
    assert stat.S_IMODE(secret.stat().st_mode) == 0o600
    assert stat.S_IMODE(public.stat().st_mode) == 0o644
    pair = security.load_pair(folder)  # zmq's certificate format: zmq reads them back
    assert zmq.auth.load_certificate(str(public)) == (pair.public, None)
    with pytest.raises(security.KeyFileError, match="not overwriting"):
        security.generate(folder, "worker")


def test_keys_written_into_a_folder_others_can_write_come_with_a_one_line_warning(tmp_path, caplog):
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o777)
    with caplog.at_level(logging.WARNING, logger="shardspec.security"):
        security.generate(shared, "worker")
    assert [r.getMessage() for r in caplog.records] == [
        f"key folder {shared} is writable by other users (mode 777); run chmod 700 {shared}"]


def test_a_secret_key_that_other_users_can_read_is_loaded_with_a_one_line_warning(tmp_path, caplog):
    _, secret = security.generate(tmp_path, "worker")
    with caplog.at_level(logging.WARNING, logger="shardspec.security"):
        security.load_pair(secret)
    assert not caplog.records  # 0600: nothing to say
    secret.chmod(0o644)
    with caplog.at_level(logging.WARNING, logger="shardspec.security"):
        security.load_pair(tmp_path)
    (record,) = caplog.records
    assert str(secret) in record.getMessage() and "chmod 600" in record.getMessage()
    assert "\n" not in record.getMessage()


def test_folders_left_by_killed_orchestrators_are_removed_at_the_next_start_and_live_ones_kept(tmp_path,
                                                                                              monkeypatch):
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()  # its pid is gone
    stale = tmp_path / f"{workers.DIR_PREFIX}{dead.pid}-abc"
    live = tmp_path / f"{workers.DIR_PREFIX}{os.getpid()}-def"
    unrelated = tmp_path / f"{workers.DIR_PREFIX}other"
    for folder in (stale, live, unrelated):
        folder.mkdir()
        (folder / "worker0.log").write_text("log")
    assert workers.remove_stale_dirs() == [stale]
    assert not stale.exists() and live.exists() and unrelated.exists()


def test_the_restart_budget_is_per_window_and_a_crash_loop_waits_out_a_doubling_pause(monkeypatch, tmp_path):
    now = [1000.0]
    monkeypatch.setattr(workers.time, "monotonic", lambda: now[0])
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    monkeypatch.setattr(workers.LocalWorkers, "_spawn", lambda self, i, mode: subprocess.Popen(
        [sys.executable, "-c", "raise SystemExit(3)"]))  # a worker that crashes at once
    local = workers.LocalWorkers(1, "cpu")

    def crash_and_restart() -> float:
        local.procs[0].wait()
        return local.restart_exited()

    try:
        for _ in range(workers.LocalWorkers.MAX_RESTARTS):
            assert crash_and_restart() == 0
            now[0] += 60
        # a crash loop: no start for a pause, said in the note; then one start
        assert crash_and_restart() == workers.LocalWorkers.BACKOFF_S
        assert local.note == "local worker 0 keeps exiting (code 3): starting it again in 5s"
        now[0] += workers.LocalWorkers.BACKOFF_S
        assert crash_and_restart() == 0 and local.restarts == [workers.LocalWorkers.MAX_RESTARTS + 1]
        assert crash_and_restart() == 2 * workers.LocalWorkers.BACKOFF_S  # the next pause is twice as long
        now[0] += workers.LocalWorkers.RESTART_WINDOW_S  # ten quiet minutes later: the budget is back
        assert crash_and_restart() == 0 and local.note is None
    finally:
        local.stop()
