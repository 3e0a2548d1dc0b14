"""Random Qwen3.5 checkpoints: file round trips, randomisation, and the transformers reference."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from reference import hf_greedy, hf_greedy_with_logits, hf_logits, hf_model, read_checkpoint
from safetensors import safe_open
from safetensors.torch import load_file
from transformers import Qwen3_5TextConfig

from shardspec.testing import checkpoint_files
from shardspec.testing import random_checkpoint as rc
from shardspec.testing.random_checkpoint import (
    layout_name,
    nine_b_config,
    parameter_shapes,
    random_state_dict,
    tiny_config,
    twenty_seven_b_config,
    write_checkpoint,
    write_random_checkpoint,
)

PROMPT = [3, 141, 59, 265, 358, 97, 93, 238, 46, 264, 33, 83]


@pytest.fixture(scope="module")
def config() -> dict:
    return tiny_config()


@pytest.fixture(scope="module")
def state_dict(config: dict) -> dict[str, torch.Tensor]:
    return random_state_dict(config, seed=0)


@pytest.fixture(scope="module")
def model(config, state_dict):
    return hf_model((config, state_dict))


def assert_same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert set(a) == set(b)
    for name in a:
        assert a[name].dtype == b[name].dtype and torch.equal(a[name], b[name]), name


def test_configs_load_in_transformers():
    for cfg in (tiny_config(), nine_b_config(), twenty_seven_b_config()):
        hf = Qwen3_5TextConfig(**cfg)
        assert hf.rope_parameters["partial_rotary_factor"] == 0.25
        assert hf.layer_types == cfg["layer_types"] and len(hf.layer_types) == hf.num_hidden_layers
        for heads in (
            "num_attention_heads",
            "num_key_value_heads",
            "linear_num_key_heads",
            "linear_num_value_heads",
        ):
            assert cfg[heads] % 4 == 0, heads
    counts = {
        f.__name__: sum(map(math.prod, parameter_shapes(f()).values()))
        for f in (nine_b_config, twenty_seven_b_config)
    }
    assert 8.5e9 < counts["nine_b_config"] < 9.5e9
    assert 26.5e9 < counts["twenty_seven_b_config"] < 28e9
    assert len(parameter_shapes(twenty_seven_b_config(), mtp=False)) == 851


@pytest.mark.parametrize("layout", ["model", "language_model"])
@pytest.mark.parametrize("shards", [1, 3])
def test_round_trip(tmp_path: Path, config, state_dict, layout: str, shards: int):
    write_checkpoint(tmp_path, config, state_dict, layout=layout, shards=shards)
    files = sorted(p.name for p in tmp_path.glob("*.safetensors"))
    if shards == 1:
        assert (
            files == ["model.safetensors"]
            and not (tmp_path / "model.safetensors.index.json").exists()
        )
    else:
        assert files == [f"model-0000{i}-of-00003.safetensors" for i in (1, 2, 3)]
        index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
        assert index["metadata"]["total_size"] == sum(t.nbytes for t in state_dict.values())
        assert set(index["weight_map"]) == {layout_name(n, layout) for n in state_dict}
        assert set(index["weight_map"].values()) == set(files)
    raw_names = set()
    for file in files:
        with safe_open(tmp_path / file, "pt") as f:
            assert f.metadata() == {"format": "pt"}
            raw_names |= set(f.keys())
            if shards > 1:
                assert all(index["weight_map"][n] == file for n in f.keys())  # noqa: SIM118 (safe_open has keys(), not __iter__)
    assert raw_names == {layout_name(n, layout) for n in state_dict}
    if layout == "language_model":
        assert all(n.startswith(("model.language_model.", "lm_head.", "mtp.")) for n in raw_names)
    assert any(n.startswith("mtp.") for n in raw_names) and "lm_head.weight" in raw_names

    raw_config = json.loads((tmp_path / "config.json").read_text())
    if layout == "model":
        assert (
            raw_config["architectures"] == ["Qwen3_5ForCausalLM"]
            and raw_config["model_type"] == "qwen3_5_text"
        )
    else:
        assert (
            raw_config["architectures"] == ["Qwen3_5ForConditionalGeneration"]
            and raw_config["model_type"] == "qwen3_5"
        )
        assert raw_config["tie_word_embeddings"] is False
    read_config, read_state = read_checkpoint(tmp_path)
    assert {k: v for k, v in read_config.items() if k != "architectures"} == config
    assert_same(read_state, state_dict)
    assert set(state_dict) == set(parameter_shapes(config))


def test_write_random_checkpoint_streams_same_tensors(tmp_path: Path, config, monkeypatch, capsys):
    kept = write_random_checkpoint(tmp_path / "a", config, seed=1, dtype=torch.bfloat16, shards=2)
    expected = random_state_dict(config, seed=1, dtype=torch.bfloat16)
    assert_same(kept, expected)
    assert_same(read_checkpoint(tmp_path / "a")[1], expected)
    assert read_checkpoint(tmp_path / "a")[0]["dtype"] == "bfloat16"

    monkeypatch.setattr(checkpoint_files, "PROGRESS_MIN_BYTES", 1)
    assert (
        write_random_checkpoint(tmp_path / "b", config, seed=1, dtype=torch.bfloat16, keep=False)
        == {}
    )
    assert "GiB" in capsys.readouterr().err
    assert_same(read_checkpoint(tmp_path / "b")[1], expected)


def test_variants_and_determinism(config, state_dict):
    assert_same(random_state_dict(config, seed=0), state_dict)
    other = random_state_dict(config, seed=1)
    assert all(not torch.equal(other[n], state_dict[n]) for n in state_dict)

    no_mtp = random_state_dict(config, seed=0, mtp=False)
    assert set(no_mtp) == {n for n in state_dict if not n.startswith("mtp.")}
    assert_same(no_mtp, {n: state_dict[n] for n in no_mtp})
    tied = random_state_dict(tiny_config(tie_word_embeddings=True), seed=0)
    assert "lm_head.weight" not in tied

    full = config["layer_types"].index("full_attention")
    main_layer = {
        n.removeprefix(f"model.layers.{full}.")
        for n in state_dict
        if n.startswith(f"model.layers.{full}.")
    }
    mtp_layer = {
        n.removeprefix("mtp.layers.0.") for n in state_dict if n.startswith("mtp.layers.0.")
    }
    assert mtp_layer == main_layer
    assert {n for n in state_dict if n.startswith("mtp.") and not n.startswith("mtp.layers.")} == {
        "mtp.fc.weight",
        "mtp.pre_fc_norm_embedding.weight",
        "mtp.pre_fc_norm_hidden.weight",
        "mtp.norm.weight",
    }
    assert state_dict["mtp.fc.weight"].shape == (config["hidden_size"], 2 * config["hidden_size"])


def test_every_parameter_randomised(state_dict):
    for name, t in state_dict.items():
        assert t.dtype == torch.float32 and torch.isfinite(t).all(), name
        assert not torch.all(t == 0) and not torch.all(t == 1), name
        assert t.float().std() > 0.05, name
        if name.endswith("linear_attn.norm.weight"):
            assert abs(t.mean() - 1) < 0.3, name
        elif "norm" in name.split(".")[-2]:
            assert abs(t.mean()) < 0.3, name
    a_log = torch.cat([t for n, t in state_dict.items() if n.endswith("A_log")])
    assert a_log.min() >= math.log(0.5) and a_log.max() <= math.log(8.0)


def test_transformers_model_from_folders(tmp_path: Path, config, state_dict, model):
    logits = hf_logits(model, PROMPT)
    assert logits.shape == (len(PROMPT), config["vocab_size"]) and torch.isfinite(logits).all()
    assert 1.0 < logits.abs().max() < 30.0 and logits.std() > 0.5
    assert len(set(logits.argmax(-1).tolist())) > len(PROMPT) // 2  # positions are not all alike

    for layout, shards in (("model", 1), ("language_model", 3)):
        write_checkpoint(tmp_path / layout, config, state_dict, layout=layout, shards=shards)
        assert torch.equal(hf_logits(hf_model(tmp_path / layout), PROMPT), logits)

    tied_config = tiny_config(tie_word_embeddings=True)
    tied = hf_model((tied_config, random_state_dict(tied_config, seed=0)))
    assert tied.lm_head.weight.data_ptr() == tied.model.embed_tokens.weight.data_ptr()
    assert torch.isfinite(hf_logits(tied, PROMPT)).all()


# 70 crosses a 64-token GDN chunk boundary; the short prompts (transformers' generate is slow on a CPU) run
# with the slow tests
@pytest.mark.parametrize("prompt_len", [*(pytest.param(n, marks=pytest.mark.slow) for n in (1, 12)), 70])
def test_hf_greedy_matches_full_forward_argmax(model, prompt_len: int):
    prompt = [(7 * i + 3) % 512 for i in range(prompt_len)]
    steps = 6
    tokens, step_logits = hf_greedy_with_logits(model, prompt, steps)
    assert len(tokens) == steps and hf_greedy(model, prompt, steps) == tokens
    sequence = list(prompt)
    for i in range(steps):
        full = hf_logits(model, sequence)[-1]
        torch.testing.assert_close(step_logits[i], full, atol=1e-4, rtol=1e-4)
        assert tokens[i] == int(full.argmax())
        sequence.append(tokens[i])


def test_zero_fp8_experts_are_kept_as_written_weights_and_scales_alike(tmp_path: Path):
    kept = write_random_checkpoint(tmp_path, rc.tiny_moe_config(), fp8=True, experts="per_expert", zero_experts=True)
    written = load_file(tmp_path / "model.safetensors")
    assert any(name.endswith("experts.0.gate_proj.weight_scale_inv") for name in kept)
    assert_same(kept, written)


@pytest.mark.parametrize(("argv", "message"), [
    (["--shards", "0"], "shards must be in [1, 71], got 0"),
    (["--shards", "1000"], "shards must be in [1, 71], got 1000"),
    (["--zero-experts"], "--zero-experts applies to the MoE sizes (tiny-moe, 35b-a3b), not tiny"),
])
def test_the_command_refuses_bad_options_in_one_line(tmp_path: Path, argv, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        rc.main([str(tmp_path / "ckpt"), *argv])
    assert exit_info.value.code == 2
    assert capsys.readouterr().err.strip().splitlines()[-1].endswith(message)
    assert not (tmp_path / "ckpt" / "config.json").exists()
