"""tools/train_tiny.py: a paused and resumed training run."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
import train_tiny
from safetensors.torch import load_file


def tiny_data(out) -> None:
    """Token arrays and the tokenizer file `train` reads, with random tokens of the bundled vocabulary."""
    rng = np.random.default_rng(1)
    out.mkdir(parents=True, exist_ok=True)
    train_tiny.save_tokens(out / "train.tokens.xz", rng.integers(0, 4096, 4000).astype(np.uint16))
    train_tiny.save_tokens(out / "held_out.tokens.xz", rng.integers(0, 4096, 200).astype(np.uint16))
    (out / "tokenizer.json").write_text(json.dumps({"added_tokens": [{"id": 0}]}))


def run(out, **kw) -> bool:
    return train_tiny.train(out, torch.device("cpu"), steps=4, minutes=None, max_epochs=None, batch=2, length=32,
                            lr=3e-3, warmup=1, mtp_weight=0.5, eval_every=500, gdn="torch", seed=0, **kw)


@pytest.mark.slow  # (10 s: with the slow tests)
def test_a_paused_and_resumed_run_ends_with_the_weights_of_a_run_that_did_not_stop(tmp_path):
    straight, paused = tmp_path / "straight", tmp_path / "paused"
    tiny_data(straight)
    tiny_data(paused)
    assert run(straight)
    assert not run(paused, pause_after=0.0)  # stops after its first step
    assert (paused / train_tiny.STATE).is_file() and not (paused / "model").exists()
    assert run(paused, resume=True)
    assert not (paused / train_tiny.STATE).exists()  # the finished run leaves no state behind
    expected, got = (load_file(d / "model" / "model.safetensors") for d in (straight, paused))
    assert expected.keys() == got.keys()
    for name in expected:
        assert torch.equal(expected[name], got[name]), name
    assert json.loads((paused / "train.json").read_text())["steps"] == 4


def test_resuming_with_other_settings_is_refused_with_the_settings_named(tmp_path):
    tiny_data(tmp_path)
    assert not run(tmp_path, pause_after=0.0)
    with pytest.raises(SystemExit, match="lr"):
        train_tiny.train(tmp_path, torch.device("cpu"), steps=4, minutes=None, max_epochs=None, batch=2, length=32,
                         lr=1e-3, warmup=1, mtp_weight=0.5, eval_every=500, gdn="torch", seed=0, resume=True)


def test_resuming_where_no_run_was_paused_is_refused(tmp_path):
    tiny_data(tmp_path)
    with pytest.raises(SystemExit, match="no paused run"):
        run(tmp_path, resume=True)
