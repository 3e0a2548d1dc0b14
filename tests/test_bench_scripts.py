"""Every bench script runs as written, `python bench/x.py`: with bench/ first on sys.path, it answers
--help with exit 0 without touching a GPU, and no script's name shadows a module that a library
imports (transformers probes for a `kernels` package; a bench/kernels.py broke it). bench/prefix_cache.py
also runs a tiny trace and a tiny sweep against a real `shardspec serve`."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).parents[1] / "bench"
HELPERS = {"gpu_timing.py"}  # imported by the scripts, no command line of its own
NO_DEVICE = {  # the scripts without --device, and why
    "allreduce.py": "one process on each of --gpus GPUs",
    "chat_encoding.py": "the server's tokenizing, on the CPU",
    "cpu_collectives.py": "the CPU's collectives",
    "draft_head.py": "the fp8 draft head emulated on the CPU",
    "plot_decode.py": "reads results",
    "trace_gaps.py": "reads traces",
    "tree_bound.py": "computes a bound from measured parts",
}

# one process for all scripts (each would import torch again): the way `python bench/x.py` runs a script
RUN_ALL = """
import contextlib, io, json, runpy, sys
bench, scripts = sys.argv[1], sys.argv[2:]
sys.path[0] = bench
results = {}
devices = []  # the scripts whose help offers --device
for script in scripts:
    sys.argv = [f"{bench}/{script}", "--help"]
    out = io.StringIO()
    try:
        with contextlib.redirect_stdout(out):
            runpy.run_path(sys.argv[0], run_name="__main__")
        results[script] = "returned without printing its help"
    except SystemExit as exc:
        results[script] = exc.code or 0
    except BaseException as exc:
        results[script] = f"{type(exc).__name__}: {exc}"
    if "--device" in out.getvalue():
        devices.append(script)
results["--device"] = devices
try:  # what bench/decode.py and bench/main_job.py import when they run
    from transformers import Qwen3_5ForCausalLM, Qwen3_5MoeForCausalLM  # noqa: F401
    results["transformers"] = 0
except BaseException as exc:
    results["transformers"] = f"{type(exc).__name__}: {exc}"
import torch
results["cuda initialised"] = torch.cuda.is_initialized()
print(json.dumps(results))
"""


def test_every_bench_script_answers_help_and_shadows_no_library_module_and_each_that_runs_on_a_device_takes_it():
    scripts = sorted(p.name for p in BENCH.glob("*.py") if p.name not in HELPERS)
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
    done = subprocess.run([sys.executable, "-c", RUN_ALL, str(BENCH), *scripts], capture_output=True, text=True,
                          env=env, timeout=120, check=True)
    results = json.loads(done.stdout.splitlines()[-1])
    assert {script: results[script] for script in scripts} == dict.fromkeys(scripts, 0)
    assert results["transformers"] == 0
    assert results["cuda initialised"] is False
    assert sorted(set(scripts) - set(results["--device"])) == sorted(NO_DEVICE)


def run_prefix_cache_bench(tmp_path: Path, *args: str) -> dict:
    """bench/prefix_cache.py's --json figures of a run on one CPU worker; it must exit 0."""
    out = tmp_path / "figures.json"
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
    subprocess.run([sys.executable, str(BENCH / "prefix_cache.py"), *args, "--json", str(out), "--", "--local", "1"],
                   env=env, timeout=300, check=True)
    return json.loads(out.read_text())


TRACE_RUN_KEYS = {"ready_line", "requests", "wall_s", "prompt_tokens", "completion_tokens", "cached_tokens",
                  "cached_tokens_reported", "reusable_tokens", "reusable_prompts_mismatched", "hit_rate",
                  "reusable_hit_rate", "completion_tokens_per_s", "per_turn", "prefix_cache_metrics", "turns"}


@pytest.mark.slow  # two servers, one after the other: 20 s to a minute on two cores
def test_prefix_cache_bench_runs_a_tiny_trace_and_writes_every_figure(tmp_path):
    figures = run_prefix_cache_bench(tmp_path, "--conversations", "2", "--turns", "2", "--system-tokens", "64",
                                     "--user-tokens", "16", "--max-tokens", "4", "--concurrency", "1")
    assert set(figures) == {"config", "runs", "second_turn_ttft_ratio", "cold_second_turn_ttft_ratio"}
    runs = [figures["runs"]["on"]] + ([] if "error" in figures["runs"]["off"] else [figures["runs"]["off"]])
    for run in runs:
        assert set(run) == TRACE_RUN_KEYS
        assert run["requests"] == 4 and run["completion_tokens"] == 4 * 4  # ignore_eos: every reply is 4 tokens
        assert set(run["per_turn"]) == {"1", "2"}
        assert set(run["per_turn"]["1"]) == {"ttft_p50_ms", "ttft_p95_ms", "reusable_share", "cached_of_reusable",
                                             "phases_p50_ms"}  # (concurrency 1: each turn's phases)
        phases = run["per_turn"]["1"]["phases_p50_ms"]
        assert set(phases) == {"prepare", "queue", "first step", "wire", "stream", "HTTP"}
        assert phases["first step"] > 0 and all(t["phases_ms"]["first step"] > 0 for t in run["turns"])
        assert len(run["turns"]) == 4
        assert run["reusable_prompts_mismatched"] == 0  # the client renders and tokenizes as the server does
        # one conversation at a time: the second's turn 1 can reuse the system prompt, every turn 2 its history
        assert 0 < run["reusable_tokens"] < run["prompt_tokens"]
        assert 0.0 <= run["hit_rate"] <= 1.0
    assert figures["second_turn_ttft_ratio"] > 0


@pytest.mark.slow  # a server, then 1 and 2 requests: 15 to 40 s on two cores
def test_prefix_cache_bench_sweep_reads_the_peak_of_running_sequences(tmp_path):
    figures = run_prefix_cache_bench(tmp_path, "--sweep", "--sweep-requests", "1", "2", "--sweep-prompt-tokens", "32",
                                     "--sweep-max-tokens", "16")
    assert figures["kv_positions"] > 0 and figures["max_seq_len"] > 0
    assert figures["fixed_reservation_sequences"] == figures["kv_positions"] // figures["max_seq_len"]
    assert [level["requests"] for level in figures["levels"]] == [1, 2]
    assert all(1 <= level["peak_running"] <= level["requests"] for level in figures["levels"])
    assert all(level["completion_tokens"] == 16 * level["requests"] for level in figures["levels"])


def test_the_tree_bound_gives_one_loop_a_step_without_holds_and_half_a_loop_when_free_branches_all_hold():
    """bench/tree_bound.py's recurrence at its two ends: no tree held, 2L + T0 + S1 a step; every tree
    held with branches that cost nothing, two steps in flight, half that; a chain on the path adds."""
    import runpy

    step_ms = runpy.run_path(str(BENCH / "tree_bound.py"))["step_ms"]
    link, stage0, stage1 = 10.0, 7.0, 16.0
    loop = 2 * link + stage0 + stage1
    assert step_ms(0.0, link, stage0, stage1, 0.0, stage0) == pytest.approx(loop, rel=1e-3)
    assert step_ms(1.0, link, stage0, stage1, 0.0, stage0) == pytest.approx(loop / 2, rel=1e-3)
    assert step_ms(1.0, link, stage0, stage1, 14.0, 20.0) == pytest.approx((2 * link + 14.0 + 20.0 + stage1) / 2,
                                                                         rel=1e-3)
