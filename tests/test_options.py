"""The workers' options: one dataclass, checked where it is made and on the wire, a CLI flag per
field, and sent by the orchestrator so that a worker needs no environment."""

from __future__ import annotations

import asyncio
import dataclasses
import os
from pathlib import Path

import pytest

import shardspec
from shardspec.cli import build_parser, engine_config
from shardspec.layers.moe import EXPERT_BACKENDS
from shardspec.option_flags import from_flags
from shardspec.orchestrator.config import EngineConfig
from shardspec.protocol.errors import ProtocolError
from shardspec.protocol.messages import InitRequest, StatsReply, WorkerOptions, parse, to_meta

FIELDS = dataclasses.fields(WorkerOptions)


def _other_values() -> WorkerOptions:
    """Every option away from its default: the other bool, the last choice that is not the default."""
    return WorkerOptions(**{f.name: (not f.default) if isinstance(f.default, bool) else
                            [c for c in f.metadata["choices"] if c != f.default][-1] for f in FIELDS})


def _flags(options: WorkerOptions) -> list[str]:
    """The command-line flags that ask for `options`."""
    flags = []
    for f in FIELDS:
        value, name = getattr(options, f.name), f.name.replace("_", "-")
        if isinstance(f.default, bool):
            flags += [] if value == f.default else [f"--no-{name}" if f.default else f"--{name}"]
        else:
            flags += [f"--{name}", value]
    return flags


def test_every_option_has_help_and_a_default_among_its_choices():
    for f in FIELDS:
        assert f.metadata["help"], f.name
        assert isinstance(f.default, bool) or f.default in f.metadata["choices"], f.name
    moe = next(f for f in FIELDS if f.name == "moe_backend")
    assert set(moe.metadata["choices"]) == {"auto", *EXPERT_BACKENDS}  # the wire's choices are the layer's


@pytest.mark.parametrize(("given", "message"), [
    ({"draft_head": "fp9"}, "draft_head must be one of fp8, bf16, cublas, got 'fp9'"),
    ({"launch_ahead": "1"}, "launch_ahead must be one of auto, on, off, got '1'"),
    ({"kernels": 0}, "kernels must be True or False, got 0"),
    ({"fused_norm": "no"}, "fused_norm must be True or False, got 'no'"),
])
def test_options_refuse_a_bad_value_naming_the_field(given, message):
    with pytest.raises(ValueError, match=message):
        WorkerOptions(**given)


def test_the_wire_refuses_a_bad_option_naming_the_field_and_carries_a_good_one():
    meta = {"rank": 0, "world_size": 1, "options": {"fp8_decode": "int4"}}
    with pytest.raises(ProtocolError, match=r"meta\.options\.fp8_decode: 'int4' is not one of w8a8, weight-only"):
        parse(InitRequest, meta)
    init = InitRequest(rank=0, world_size=1, options=_other_values())
    assert parse(InitRequest, to_meta(init)) == init
    assert parse(InitRequest, {"rank": 0, "world_size": 1}).options == WorkerOptions()


def test_the_engine_config_holds_the_options_and_refuses_anything_else():
    options = WorkerOptions(allreduce="nccl")
    assert EngineConfig(workers=["tcp://a:1"], worker_options=options).worker_options is options
    assert EngineConfig().worker_options == WorkerOptions()
    with pytest.raises(ValueError, match=r"worker_options must be a shardspec\.WorkerOptions"):
        EngineConfig(worker_options={"allreduce": "nccl"})
    assert shardspec.WorkerOptions is WorkerOptions


@pytest.mark.parametrize("command", ["generate", "serve"])
def test_generate_and_serve_have_a_flag_for_every_option(command):
    parser = build_parser()
    wanted = _other_values()
    assert from_flags(parser.parse_args([command, *_flags(wanted)]), WorkerOptions) == wanted
    assert from_flags(parser.parse_args([command]), WorkerOptions) == WorkerOptions()
    config = engine_config(parser.parse_args([command, "--workers", "tcp://a:1", *_flags(wanted)]))
    assert config.worker_options == wanted


def test_the_help_explains_each_option_with_its_choices_and_default():
    subcommands = build_parser()._subparsers._group_actions[0].choices
    text = "".join(subcommands["generate"].format_help().split())  # (argparse wraps lines, also at hyphens)
    assert "--draft-head{fp8,bf16,cublas}" in text and "(default:fp8)" in text
    assert "--no-kernelsTritonkernelsonCUDAworkers;off:PyTorchoperationsonly(default:on)" in text
    for f in FIELDS:
        assert f"-{f.name.replace('_', '-')}" in text and "".join(f.metadata["help"].split()) in text, f.name


def test_a_bad_option_flag_is_an_argparse_error_naming_the_flag_and_the_choices(capsys):
    with pytest.raises(SystemExit) as exit_:
        build_parser().parse_args(["generate", "--launch-ahead", "sometimes"])
    assert exit_.value.code == 2
    assert "argument --launch-ahead: invalid choice: 'sometimes' (choose from" in capsys.readouterr().err


def test_a_remote_worker_needs_no_environment_the_orchestrator_sends_the_options(
        spawn_worker, tiny_model, monkeypatch):
    """A worker started by address with no SHARDSPEC_* variable gets the orchestrator's options
    in init: its stats report them, and launch-ahead (off by default on a CPU) runs."""
    for name in [name for name in os.environ if name.startswith("SHARDSPEC_")]:
        monkeypatch.delenv(name)
    worker = spawn_worker()
    assert b"SHARDSPEC_" not in Path(f"/proc/{worker.proc.pid}/environ").read_bytes()
    options = WorkerOptions(launch_ahead="on", draft_head="cublas", kernels=False, moe_backend="gathered")

    async def run() -> list[StatsReply]:
        async with shardspec.connect(model=str(tiny_model), workers=[worker.address], mtp=True, dtype="float32",
                                     worker_options=options) as engine:
            async def one(prompt: list[int]) -> None:
                async for _ in engine.generate(prompt, max_tokens=12):
                    pass

            await asyncio.gather(*(one(prompt) for prompt in ([1, 2, 3], [7], [4, 4, 9])))
            return await engine.stats()

    (stats,) = asyncio.run(run())
    assert stats.options == options
    assert stats.launched_ahead > 0
