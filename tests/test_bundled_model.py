"""The bundled model: the main job a new user runs, and MTP measured on real text."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys

import pytest
from conftest import pooled

import shardspec
from shardspec.cli import BUNDLED_MODEL
from shardspec.models.checkpoint import Checkpoint

PROMPTS = [
    "def fibonacci(n):",
    "import os\nimport sys\n\n\ndef main():\n",
    "class Stack:\n    def __init__(self):\n",
    "for i in range(10):\n",
    "    def __repr__(self):\n        return ",
]


def test_bundled_model_is_a_small_bf16_qwen3_5_folder_with_mtp():
    files = {p.name for p in BUNDLED_MODEL.iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json", "README.md"} <= files
    assert (BUNDLED_MODEL / "model.safetensors").stat().st_size <= 50 * 10**6  # the weights stay under 50 MB
    config = Checkpoint.open(BUNDLED_MODEL).config
    assert config.dtype == "bfloat16" and config.mtp_num_hidden_layers == 1
    assert set(config.layer_types) == {"linear_attention", "full_attention"}


@pytest.mark.parametrize("tp", [1, pytest.param(2, marks=pytest.mark.slow)])  # TP = 2: test_spec_decode.py's
def test_greedy_output_with_mtp_equals_output_without_on_the_bundled_model(tp):
    # deterministic: the model's own bfloat16, where equality is guaranteed (by default a verify pass's
    # k + 1 rows can round differently from the same rows one at a time and flip a close argmax;
    # docs/architecture.md, "Deterministic decoding")
    async def run(mtp):
        async with shardspec.connect(model=str(BUNDLED_MODEL), workers=pooled(tp), mtp=mtp, max_seqs=8,
                                     dtype="bfloat16", deterministic=True) as engine:
            async def one(prompt):
                tokens, final = [], None
                async for chunk in engine.generate(prompt, max_tokens=64, stop_at_eos=False):
                    tokens += chunk.token_ids
                    final = chunk
                return tokens, final.stats

            return await asyncio.gather(*(one(p) for p in PROMPTS))

    with_mtp, without = asyncio.run(run(True)), asyncio.run(run(False))
    assert [t for t, _ in with_mtp] == [t for t, _ in without]
    drafts = sum(s["drafts"] for _, s in with_mtp)
    accepted = sum(s["accepted_tokens"] for _, s in with_mtp)
    assert 1 + accepted / drafts > 1.5  # the trained MTP head really drafts, and drafts are really used


def generate(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "shardspec", "generate", *args], capture_output=True, text=True,
                          timeout=180)


def test_main_job_streams_python_and_a_summary_and_its_json_run_gives_the_same_text_at_temperature_0():
    # two runs of the main job: deterministic at temperature 0, whether streamed or as JSON
    streamed = generate("def fibonacci(n):", "--temperature", "0", "--max-tokens", "24")
    assert streamed.returncode == 0, streamed.stderr
    summary = streamed.stderr.strip().splitlines()[-1]
    assert "24 tokens" in summary and "tokens/s" in summary and "mean acceptance length" in summary
    assert "2 workers" in streamed.stderr  # the main job runs tensor-parallel on two local workers
    out = json.loads(generate("def fibonacci(n):", "--temperature", "0", "--max-tokens", "24", "--json").stdout)
    assert len(out["token_ids"]) == 24 and out["text"].strip()
    assert streamed.stdout.removesuffix("\n") == out["text"]
    assert out["stats"]["mean_acceptance_length"] >= 1.0 and out["stats"]["generated_tokens"] == 24
