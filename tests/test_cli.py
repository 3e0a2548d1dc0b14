"""The `shardspec` command line, run as a user would run it."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from shardspec.cli import main


def shardspec(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "shardspec", *args], capture_output=True, text=True,
                          timeout=timeout)


def test_help_lists_the_commands():
    result = shardspec("--help")
    assert result.returncode == 0
    assert "worker" in result.stdout and "generate" in result.stdout


def test_generate_json_reports_tokens_reason_and_stats(tiny_model, capfd):
    # in this process (what `python -m shardspec` runs is main; its workers are processes all the same)
    assert main(["generate", "--model", str(tiny_model), "--prompt-ids", "1,2,3", "--max-tokens", "9",
                 "--local", "2", "--json", "--temperature", "0"]) == 0
    out = json.loads(capfd.readouterr().out)
    assert len(out["token_ids"]) == 9 and out["finish_reason"] == "length"
    assert {"prompt_tokens", "generated_tokens", "tokens_per_s", "time_to_first_token_s"} <= set(out["stats"])
    assert {"drafts", "accepted_tokens", "acceptance_per_position", "mean_acceptance_length"} <= set(out["stats"])
    assert out["stats"]["prompt_tokens"] == 3 and out["stats"]["generated_tokens"] == 9
    assert "text" not in out  # this checkpoint has no tokenizer


def test_generate_streams_token_ids_and_a_summary_without_json(tiny_model, capfd):
    assert main(["generate", "--model", str(tiny_model), "--prompt-ids", "4,5", "--max-tokens", "5"]) == 0
    result = capfd.readouterr()
    assert len(result.out.split()) == 5
    assert "5 tokens" in result.err and "tokens/s" in result.err


@pytest.mark.parametrize(
    ("args", "message"),
    [
        ([], "exactly one"),
        (["hello", "--prompt-ids", "1"], "exactly one"),
        (["--prompt-ids", "1,x"], "comma-separated integers"),
        (["--prompt-ids", "1", "--max-tokens", "0"], "--max-tokens"),
        (["--prompt-ids", "1,99999"], "[0, 512)"),
        (["--prompt-ids", "1", "--max-tokens", "5000"], "exceeds the context"),
        (["hello"], "tokenizer"),
        (["--prompt-ids", "1", "--tp", "2", "--local", "1"], "tp must equal"),
        (["--prompt-ids", "1", "--tp", "2", "--pp", "2", "--local", "2"], "tp × pp must equal the worker count"),
        (["--prompt-ids", "1", "--workers", "nonsense"], "tcp://HOST:PORT"),
        (["--prompt-ids", "1", "--repetition-penalty", "0"], "repetition_penalty must be above 0"),
        (["--prompt-ids", "1", "--presence-penalty", "3"], "presence_penalty must be in [-2.0, 2.0]"),
        (["--prompt-ids", "1", "--frequency-penalty", "-2.5"], "frequency_penalty must be in [-2.0, 2.0]"),
        # (sampling values are checked before any worker is reached: none listens there)
        (["--prompt-ids", "1", "--temperature", "-1", "--workers", "tcp://127.0.0.1:9"], "temperature must be in"),
    ],
)
def test_generate_rejects_bad_input_with_exit_code_2_and_no_traceback(tiny_model, args, message, capsys):
    # in this process (what `python -m shardspec` runs is main): an exception main lets out fails the test
    local = [] if "--local" in args or "--workers" in args else ["--local", "1"]
    assert main(["generate", "--model", str(tiny_model), *local, *args]) == 2
    assert message in capsys.readouterr().err


@pytest.mark.slow  # (15-25 s of workers and timeouts)
def test_generate_samples_with_the_penalties_it_is_given(tiny_model, capsys):
    """The CLI's penalties reach the sampler: its greedy output is the engine's with the same
    penalties, and differs from the output without them (negative presence and frequency penalties
    reward repeats, which this checkpoint's greedy output has none of)."""
    import asyncio

    import shardspec

    penalties = {"repetition_penalty": 1.2, "presence_penalty": -1.0, "frequency_penalty": -2.0}

    def cli(*extra: str) -> list[int]:
        assert main(["generate", "--model", str(tiny_model), "--local", "1", "--prompt-ids", "1,2,3",
                     "--max-tokens", "12", "--temperature", "0", "--json", *extra]) == 0
        return json.loads(capsys.readouterr().out)["token_ids"]

    async def engine() -> list[int]:
        async with shardspec.connect(model=str(tiny_model), local=1) as e:
            return [t async for chunk in e.generate([1, 2, 3], max_tokens=12, temperature=0.0, **penalties)
                    for t in chunk.token_ids]

    penalised = cli("--repetition-penalty", "1.2", "--presence-penalty", "-1", "--frequency-penalty", "-2")
    assert penalised == asyncio.run(engine())
    assert penalised != cli()


def test_generate_penalises_repetition_by_default_when_it_samples_and_never_when_greedy():
    from shardspec.cli import DEFAULT_REPETITION_PENALTY, build_parser, sampling_penalties

    def penalty(*argv: str) -> float:
        return sampling_penalties(build_parser().parse_args(["generate", "x", *argv]))["repetition_penalty"]

    assert DEFAULT_REPETITION_PENALTY > 1
    assert penalty() == penalty("--temperature", "0.5") == DEFAULT_REPETITION_PENALTY
    assert penalty("--temperature", "0") == 1.0
    assert penalty("--temperature", "0", "--repetition-penalty", "1.3") == 1.3
    assert penalty("--repetition-penalty", "1") == 1.0


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_stops_generate_with_its_exit_code_and_nothing_left(tiny_model, sig):
    proc = subprocess.Popen([sys.executable, "-m", "shardspec", "generate", "--model", str(tiny_model), "--local", "2",
                             "--prompt-ids", "1,2", "--max-tokens", "400"], stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True, preexec_fn=lambda: signal.signal(sig, signal.SIG_DFL))
    assert "starting workers" in proc.stderr.readline()  # (the workers are spawned and loading)
    def folders() -> list[Path]:  # (the spawned workers' folder, and the group's store once it forms)
        return list(Path(tempfile.gettempdir()).glob(f"shardspec-{proc.pid}-*"))

    deadline = time.monotonic() + 30
    while not (workers := [f for f in folders() if "-store-" not in f.name]) and time.monotonic() < deadline:
        time.sleep(0.05)
    proc.send_signal(sig)
    err = proc.stderr.read()
    assert proc.wait(60) == 128 + sig and "interrupted" in err and "Traceback" not in err, err
    assert workers and not folders()
    spawned = [pid for pid in map(int, filter(str.isdigit, os.listdir("/proc"))) if _cmdline_holds(pid, workers[0])]
    assert not spawned


def test_generate_whose_reader_leaves_stops_as_sigpipe_would_with_nothing_left(tiny_model):
    # `shardspec generate ... | head`: the first write after the reader left fails with EPIPE
    proc = subprocess.Popen([sys.executable, "-m", "shardspec", "generate", "--model", str(tiny_model), "--local", "1",
                             "--prompt-ids", "1,2", "--max-tokens", "400", "--temperature", "0"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert proc.stdout.read(1)  # (streaming)
    proc.stdout.close()
    err = proc.stderr.read()
    assert proc.wait(60) == 128 + signal.SIGPIPE and "Traceback" not in err, err
    assert not list(Path(tempfile.gettempdir()).glob(f"shardspec-{proc.pid}-*"))


def _cmdline_holds(pid: int, folder: Path) -> bool:
    try:
        return str(folder) in Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace")
    except OSError:
        return False


@pytest.mark.parametrize("command", [["generate", "--prompt-ids", "1"], ["serve", "--port", "0"]])
def test_generate_and_serve_on_a_folder_without_a_model_say_so_in_one_line_and_exit_2(tmp_path, command, capfd):
    # in this process (what `python -m shardspec` runs is main); serve says it before any HTTP is served
    assert main([command[0], "--model", str(tmp_path), *command[1:]]) == 2
    err = capfd.readouterr().err
    assert "not a model folder" in err and "Traceback" not in err
    assert "Started server" not in err and "Shutting down" not in err


def _subcommands(parser):
    """(name, parser) of every subcommand, nested ones too."""
    import argparse

    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield name, sub
                yield from _subcommands(sub)


def test_every_option_that_takes_a_value_says_its_default_in_help():
    """--help names the default of every option with a value (flags are off unless given); an
    option with no default says what it does without one, in words that include "default"."""
    import argparse

    from shardspec.cli import build_parser

    missing = []
    for name, sub in _subcommands(build_parser()):
        for action in sub._actions:
            if (action.option_strings and action.nargs != 0 and not action.required
                    and not isinstance(action, argparse._HelpAction)
                    and "default" not in (action.help or "").lower()):
                missing.append(f"{name} {action.option_strings[-1]}")
    assert not missing, missing
