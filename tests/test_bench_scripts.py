"""Every bench script runs as written, `python bench/x.py`: with bench/ first on sys.path, it answers
--help with exit 0 without touching a GPU, and no script's name shadows a module that a library
imports (transformers probes for a `kernels` package; a bench/kernels.py broke it)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

BENCH = Path(__file__).parents[1] / "bench"
HELPERS = {"gpu_timing.py"}  # imported by the scripts, no command line of its own

# one process for all scripts (each would import torch again): the way `python bench/x.py` runs a script
RUN_ALL = """
import contextlib, io, json, runpy, sys
bench, scripts = sys.argv[1], sys.argv[2:]
sys.path[0] = bench
results = {}
for script in scripts:
    sys.argv = [f"{bench}/{script}", "--help"]
    try:
        with contextlib.redirect_stdout(io.StringIO()):
            runpy.run_path(sys.argv[0], run_name="__main__")
        results[script] = "returned without printing its help"
    except SystemExit as exc:
        results[script] = exc.code or 0
    except BaseException as exc:
        results[script] = f"{type(exc).__name__}: {exc}"
try:  # what bench/decode.py and bench/main_job.py import when they run
    from transformers import Qwen3_5ForCausalLM, Qwen3_5MoeForCausalLM  # noqa: F401
    results["transformers"] = 0
except BaseException as exc:
    results["transformers"] = f"{type(exc).__name__}: {exc}"
import torch
results["cuda initialised"] = torch.cuda.is_initialized()
print(json.dumps(results))
"""


def test_every_bench_script_answers_help_and_shadows_no_library_module():
    scripts = sorted(p.name for p in BENCH.glob("*.py") if p.name not in HELPERS)
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
    done = subprocess.run([sys.executable, "-c", RUN_ALL, str(BENCH), *scripts], capture_output=True, text=True,
                          env=env, timeout=120, check=True)
    results = json.loads(done.stdout.splitlines()[-1])
    assert {script: results[script] for script in scripts} == dict.fromkeys(scripts, 0)
    assert results["transformers"] == 0
    assert results["cuda initialised"] is False
