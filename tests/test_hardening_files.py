"""Hardening against what the filesystem, a hung worker and the machine's other users can do:
model folders whose files are FIFOs, devices or lies; a worker that hangs while its heartbeats
keep flowing; key files and spawned workers' folders other users could read or that outlive a crash."""

from __future__ import annotations

import json
import os
import shutil
import struct
from pathlib import Path

import pytest
import torch
from conftest import wait_for_socket

from shardspec.cli import BUNDLED_MODEL
from shardspec.layers.parallel import TPGroup
from shardspec.models import loader
from shardspec.models.config import ConfigError, read_config
from shardspec.orchestrator.tokenizer import Tokenizer
from shardspec.protocol import ErrorCode, Message, decode, encode

LOAD = {"dtype": "auto", "max_slots": 2, "max_seq_len": 64, "prefill_chunk": 8}


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
            "tokenizer.json": Tokenizer.from_folder, "model.safetensors": loader.checkpoint_files}[name]
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
        loader.checkpoint_files(tmp_path)


@pytest.mark.parametrize("shard", ["../outside.safetensors", "/dev/zero"])
def test_a_checkpoint_index_cannot_name_a_file_outside_the_model_folder(tmp_path, shard):
    index = {"weight_map": {"model.embed_tokens.weight": shard}}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(ConfigError, match="inside the model folder"):
        loader.checkpoint_files(tmp_path)
