"""EngineConfig: every option of connect, the CLI and the server, checked in one place."""

from __future__ import annotations

import pytest
import torch

from shardspec.cli import build_parser
from shardspec.cli.commands import engine_config
from shardspec.orchestrator.config import EngineConfig
from shardspec.protocol.messages import LoadRequest


@pytest.mark.parametrize(("options", "field"), [
    ({"local": 0}, "local"),
    ({"tp": -1}, "tp"),
    ({"workers": []}, "workers"),
    ({"workers": ["nonsense"]}, "workers"),
    ({"workers": ["tcp://a:1", "tcp://b:1", "tcp://a:1"]}, "workers: each address once"),
    ({"dtype": "int8"}, "dtype"),
    ({"max_seqs": 0}, "max_seqs"),
    ({"max_seqs": 10**6}, "max_seqs"),
    ({"max_seq_len": 1.5}, "max_seq_len"),
    ({"prefill_chunk": 0}, "prefill_chunk"),
    ({"draft_tokens": 99}, "draft_tokens"),
    ({"mtp": "yes"}, "mtp"),
    ({"dist_timeout": 0}, "dist_timeout"),
    ({"connect_timeout": float("nan")}, "connect_timeout"),
    ({"dist_port": 70000}, "dist_port"),
    ({"keys": "k"}, "server_keys"),
    ({"forced_acceptance": 0.5}, "forced acceptance"),
])
def test_a_bad_option_is_refused_with_a_message_naming_it(options, field):
    with pytest.raises(ValueError, match=field):
        EngineConfig(model="m", **options)


def test_ranges_are_the_wires_ranges():
    lo, hi = LoadRequest.__dataclass_fields__["max_seqs"].metadata["range"]
    EngineConfig(model="m", max_seqs=hi)
    with pytest.raises(ValueError, match=f"\\[{lo}, {hi}\\]"):
        EngineConfig(model="m", max_seqs=hi + 1)


def test_workers_and_tp_agree_or_are_refused():
    config = EngineConfig(model="m", workers=["tcp://a:1", "tcp://b:1"])
    assert config.world_size == 2 and config.stage_ranks() == [[0, 1]]
    with pytest.raises(ValueError, match="tp must equal"):
        EngineConfig(model="m", workers=["tcp://a:1"], tp=2)
    with pytest.raises(ValueError, match="not both"):
        EngineConfig(model="m", workers=["tcp://a:1"], local=1)


def test_the_model_defaults_to_the_bundled_one():
    from shardspec.cli import BUNDLED_MODEL

    assert EngineConfig(local=1).model == str(BUNDLED_MODEL)
    assert (BUNDLED_MODEL / "config.json").is_file()


@pytest.mark.parametrize("gpus", [0, 1])
def test_spawned_workers_take_the_gpu_where_there_is_one_in_python_as_on_the_command_line(gpus, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: gpus > 0)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: gpus)
    device = "cuda" if gpus else "cpu"
    assert EngineConfig(model="m").device == device
    assert engine_config(build_parser().parse_args(["generate", "hi"])).device == device
    assert EngineConfig(model="m", device="cpu").device == "cpu"
