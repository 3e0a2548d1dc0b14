"""Fine-grained FP8 checkpoints (block-wise e4m3, 128 × 128 scales): loaded on the CPU against
transformers on the same checkpoint dequantised, kept FP8 against dequantised, refused when not
supported."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import random
from pathlib import Path

import pytest
import torch
from conftest import pooled
from reference import fuse_experts, hf_logits, hf_model, read_checkpoint
from test_spec_decode import greedy_outputs

import shardspec
from shardspec.layers.batch import Batch
from shardspec.layers.fp8 import BlockSplitError, Fp8LinearMethod
from shardspec.layers.parallel import TPGroup
from shardspec.layers.quantization import QuantConfig
from shardspec.models import fp8, registry
from shardspec.models.base import Stage
from shardspec.models.checkpoint import Checkpoint
from shardspec.models.config import ConfigError
from shardspec.models.loader import load_model
from shardspec.testing.random_checkpoint import (
    fp8_quantized,
    nine_b_config,
    parameter_shapes,
    random_state_dict,
    thirty_five_b_a3b_config,
    tiny_config,
    tiny_moe_config,
    write_checkpoint,
    write_random_checkpoint,
)

# hidden 256 and 128-row heads: every projection whole 128 × 128 blocks, and at TP = 2 too
ALIGNED = tiny_config(hidden_size=256, intermediate_size=512, num_attention_heads=4, num_key_value_heads=2,
                      head_dim=128, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=128,
                      linear_value_head_dim=128)


@pytest.fixture(scope="module")
def fp8_model(tmp_path_factory) -> Path:
    """The tiny model in FP8 (fp32 where a release keeps 16-bit), the release's multimodal layout."""
    path = tmp_path_factory.mktemp("fp8-tiny")
    write_random_checkpoint(path, tiny_config(), seed=1, layout="language_model", fp8=True)
    return path


@pytest.fixture(scope="module")
def aligned_fp8_model(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("fp8-aligned")
    write_random_checkpoint(path, ALIGNED, seed=2, fp8=True)
    return path


def dequantised_twin(folder: Path) -> tuple[dict, dict[str, torch.Tensor]]:
    """The checkpoint's text config and state dict with every FP8 weight times its block scales in
    fp32 (written out here, apart from the code under test) and the scales dropped; per-expert
    weights then fused as transformers holds them."""
    config, state = read_checkpoint(folder, fuse=False)
    twin = {}
    for name, tensor in state.items():
        if name.endswith("_scale_inv"):
            continue
        scale = state.get(name + "_scale_inv")
        if scale is not None:
            n, k = tensor.shape
            tensor = tensor.float() * scale.repeat_interleave(128, 0)[:n].repeat_interleave(128, 1)[:, :k]
        twin[name] = tensor.float()
    return config, fuse_experts(twin)


def logits_of(model, ids: list[int]) -> torch.Tensor:
    x = torch.tensor([ids])
    return model.lm_head.logits(model(x, Batch.uncached(1, len(ids), x.device)))[0]


def test_the_release_layout_quantises_what_the_releases_quantise(fp8_model):
    _, state = read_checkpoint(fp8_model)
    raw = json.loads((fp8_model / "config.json").read_text())
    assert raw["quantization_config"]["weight_block_size"] == [128, 128]
    kept = {"model.embed_tokens.weight", "lm_head.weight", "mtp.fc.weight",
            "model.layers.0.linear_attn.in_proj_a.weight"}
    for name in kept:
        assert state[name].dtype == torch.float32 and name + "_scale_inv" not in state
    quantised = [n for n, t in state.items() if t.dtype == torch.float8_e4m3fn]
    assert {"model.layers.0.mlp.down_proj.weight", "model.layers.3.self_attn.q_proj.weight",
            "mtp.layers.0.mlp.gate_proj.weight"} <= set(quantised)
    for name in quantised:
        n, k = state[name].shape
        assert state[name + "_scale_inv"].shape == (-(-n // 128), -(-k // 128))


def test_an_moe_release_quantises_its_experts_and_keeps_the_router_and_the_shared_gate_in_16_bits():
    shapes = parameter_shapes(tiny_moe_config(), experts="mixed")
    quantised = {name for name, shape in shapes.items() if fp8_quantized(name, shape)}
    for name in ("model.layers.0.mlp.gate.weight", "model.layers.0.mlp.shared_expert_gate.weight",
                 "mtp.layers.0.mlp.gate.weight"):
        assert name in shapes and name not in quantised
    assert {"mtp.layers.0.mlp.experts.7.down_proj.weight", "model.layers.0.mlp.shared_expert.gate_proj.weight",
            "mtp.layers.0.mlp.shared_expert.down_proj.weight"} <= quantised


def test_quantising_keeps_each_weight_within_e4m3_rounding_of_its_twin_of_the_same_seed(fp8_model):
    # the unquantised checkpoint of the same seed: random_state_dict draws what --fp8 quantises
    twin = random_state_dict(tiny_config(), seed=1)
    _, dequantised = dequantised_twin(fp8_model)
    for name, original in twin.items():
        if fp8_quantized(name, tuple(original.shape)):
            block_max = original.abs().max()  # a tiny weight is one or two blocks
            assert (dequantised[name] - original).abs().max() <= block_max / 16  # e4m3: 3 mantissa bits
        else:
            assert torch.equal(dequantised[name], original)


def test_fp8_logits_on_the_cpu_equal_transformers_on_the_checkpoint_dequantised_to_fp32(fp8_model):
    ids = random.Random(0).choices(range(512), k=70)  # 70 > 64: crosses a GDN chunk boundary
    reference = hf_logits(hf_model(dequantised_twin(fp8_model)), ids)
    model = load_model(fp8_model, TPGroup(), torch.float32, torch.device("cpu"), with_mtp=False)
    logits = logits_of(model, ids)
    # both multiply the same fp32 weights (e4m3 · fp32 scale is exact in fp32): fp32 rounding apart
    assert (logits - reference).abs().max() <= 1e-4 * reference.abs().max()


@pytest.mark.parametrize(("tp", "ep"), [(1, 1), (4, 2)])
def test_fp8_moe_logits_equal_transformers_on_the_dequantised_checkpoint_at_each_split(tmp_path, tp, ep):
    """Per-expert FP8 experts (the releases' layout) dequantised at load: the logits at TP 1; split
    over ranks and expert groups, the ranks' MoE blocks sum to transformers' block."""
    write_random_checkpoint(tmp_path, tiny_moe_config(), seed=5, fp8=True, experts="per_expert")
    reference = hf_model(dequantised_twin(tmp_path))
    ids = random.Random(5).choices(range(512), k=30)
    if tp == 1:
        model = load_model(tmp_path, TPGroup(), torch.float32, torch.device("cpu"), with_mtp=False)
        expected = hf_logits(reference, ids)
        assert (logits_of(model, ids) - expected).abs().max() <= 1e-4 * expected.abs().max()
        return
    x = torch.randn(37, 64, generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        expected = reference.model.layers[0].mlp(x[None])[0]
    total = sum(load_model(tmp_path, TPGroup(rank, tp), torch.float32, torch.device("cpu"), with_mtp=False,
                           expert_parallel=ep).layers["0"].mlp(x) for rank in range(tp))
    assert (total - expected).abs().max() <= 1e-5 * expected.abs().max()


def test_fp8_logits_through_workers_at_tp_2_equal_transformers_on_the_dequantised_checkpoint(fp8_model):
    ids = random.Random(1).choices(range(512), k=40)

    async def run():
        async with shardspec.connect(model=str(fp8_model), workers=pooled(2), mtp=False, dtype="float32") as engine:
            out = []
            async for chunk in engine.generate(ids, max_tokens=24):
                out += chunk.token_ids
            return out

    tokens = asyncio.run(run())
    reference = hf_logits(hf_model(dequantised_twin(fp8_model)), ids + tokens[:-1])
    assert tokens == reference[len(ids) - 1 :].argmax(-1).tolist()


def test_greedy_output_of_an_fp8_checkpoint_is_the_same_with_mtp_on_and_off(fp8_model):
    rng = random.Random(2)
    prompts = [rng.choices(range(512), k=rng.randint(1, 20)) for _ in range(3)]
    plain = greedy_outputs(fp8_model, prompts, tp=1, mtp=False, max_tokens=16)
    assert greedy_outputs(fp8_model, prompts, tp=1, mtp=True, max_tokens=16) == plain


@pytest.mark.parametrize("tp", [1, 2])
def test_weights_kept_fp8_give_the_logits_of_weights_dequantised_at_load(aligned_fp8_model, tp):
    ids = random.Random(3).choices(range(512), k=20)
    for rank in range(tp):  # each rank's slices alone: its partial logits before any all-reduce
        group = TPGroup(rank, tp)
        kept = load_model(aligned_fp8_model, group, torch.float32, torch.device("cpu"), fp8_native=True)
        plain = load_model(aligned_fp8_model, group, torch.float32, torch.device("cpu"), fp8_native=False)
        layer = kept.layers["0"].linear_attn.in_proj
        assert isinstance(layer.method, Fp8LinearMethod) and layer.weight.dtype == torch.float8_e4m3fn
        assert layer.rest is not None
        x = torch.randn(1, 5, ALIGNED["hidden_size"])
        for a, b in zip(layer(x), plain.layers["0"].linear_attn.in_proj(x), strict=True):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
        for a, b in zip(kept.layers["3"].mlp.gate_up_proj(x), plain.layers["3"].mlp.gate_up_proj(x), strict=True):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
        h = torch.randn(1, 5, ALIGNED["intermediate_size"] // tp)  # down_proj: this rank's columns
        torch.testing.assert_close(kept.layers["3"].mlp.down_proj(h), plain.layers["3"].mlp.down_proj(h),
                                   rtol=1e-5, atol=1e-5)
        if tp == 1:
            torch.testing.assert_close(logits_of(kept, ids), logits_of(plain, ids), rtol=1e-4, atol=1e-4)


def test_parts_shorter_than_a_block_are_padded_so_kept_fp8_equals_dequantised(fp8_model):
    # the tiny model's k_proj is 64 rows: padded to a block inside the merged q|k|v projection
    kept = load_model(fp8_model, TPGroup(), torch.float32, torch.device("cpu"), fp8_native=True)
    plain = load_model(fp8_model, TPGroup(), torch.float32, torch.device("cpu"), fp8_native=False)
    assert kept.layers["3"].self_attn.qkv_proj.weight.shape[0] == 512  # q|gate 256, k and v 64 + 64 padding
    ids = random.Random(4).choices(range(512), k=20)
    torch.testing.assert_close(logits_of(kept, ids), logits_of(plain, ids), rtol=1e-4, atol=1e-4)


def test_a_tp_degree_that_splits_fp8_blocks_is_refused_on_the_gpu_path_naming_the_degrees_that_work(fp8_model):
    # the tiny model's q heads are 16 rows each: at TP = 2 a rank's q slice ends inside a block
    with pytest.raises(ConfigError, match=r"tensor-parallel degree 2 splits .* are \[1\]"):
        load_model(fp8_model, TPGroup(1, 2), torch.float32, torch.device("cpu"), fp8_native=True)
    Checkpoint.open(fp8_model).check_quantization(2, fp8_native=False)  # dequantised at load, any degree


def test_the_engine_refuses_an_fp8_tp_degree_for_gpu_workers_before_starting_them(fp8_model):
    with pytest.raises(ValueError, match="tensor-parallel degree 2 splits"):
        shardspec.EngineConfig(model=str(fp8_model), local=2, device="cuda").check_model_folder()


def converts_on_every_rank(raw: dict, tp: int, quantized: set[str]) -> bool:
    """Whether every rank's model, built on the meta device with the FP8 weights kept FP8, takes
    them as they are (the check made at load, when a projection makes its FP8 weights)."""
    family = registry.resolve(raw)
    config = family.parse_config(raw)
    shapes = parameter_shapes(raw)
    quant = QuantConfig({key: tuple(shapes[key]) for key in quantized})
    stage = Stage.whole(config.num_hidden_layers)
    try:
        for rank in range(tp):
            with torch.device("meta"):
                family.build(config, TPGroup(rank, tp), stage, True, quant)
    except BlockSplitError:
        return False
    return True


@pytest.mark.parametrize("raw", [tiny_config(), ALIGNED, nine_b_config(), tiny_moe_config(),
                                 thirty_five_b_a3b_config()], ids=["tiny", "aligned", "9b", "tiny-moe", "35b-a3b"])
@pytest.mark.parametrize("quantised", ["as releases", "every matrix"])
def test_the_config_says_which_tp_degrees_keep_fp8_blocks_whole_as_converting_each_rank_does(raw, quantised):
    """The orchestrator decides from the config (fp8.split_problem), the loader by converting its
    rank's model: at every degree that splits the model, on every rank, they agree."""
    shapes = parameter_shapes(raw)
    every = quantised == "every matrix"
    quantized = {name for name, shape in shapes.items()
                 if (every and name.endswith(".weight") and len(shape) == 2) or fp8_quantized(name, shape)}
    config = registry.resolve(raw).parse_config(raw)
    degrees = [tp for tp in (1, 2, 3, 4, 8) if _splits(config, tp)]
    by_config = [tp for tp in degrees if fp8.split_problem(config, tp, quantized) is None]
    assert by_config == [tp for tp in degrees if converts_on_every_rank(raw, tp, quantized)]
    assert by_config[0] == 1


def _splits(config, tp: int) -> bool:
    try:
        config.check_tp(tp)
    except ConfigError:
        return False
    return True


def test_the_engine_checks_an_fp8_checkpoint_without_building_a_model(fp8_model, monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("the orchestrator built a model")

    monkeypatch.setattr(registry, "_families", {f.name: dataclasses.replace(f, build=refuse)
                                                for f in registry.families()})
    with pytest.raises(ValueError, match=r"tensor-parallel degree 2 splits .* blocks are \[1\]"):
        shardspec.EngineConfig(model=str(fp8_model), local=2, device="cuda").check_model_folder()
    shardspec.EngineConfig(model=str(fp8_model), local=2, device="cpu").check_model_folder()  # CPU workers dequantise


def _with_quantization(tmp_path: Path, source: Path, **fields) -> Path:
    folder = tmp_path / "model"
    folder.mkdir()
    for file in source.iterdir():
        (folder / file.name).symlink_to(file)
    raw = json.loads((source / "config.json").read_text())
    raw["quantization_config"] = {**raw["quantization_config"], **fields}
    (folder / "config.json").unlink()
    (folder / "config.json").write_text(json.dumps(raw))
    return folder


@pytest.mark.parametrize(("fields", "named"), [
    ({"quant_method": "gptq"}, "quant_method 'gptq'"),
    ({"quant_method": "awq"}, "quant_method 'awq'"),
    ({"fmt": "e5m2"}, "fmt 'e5m2'"),
    ({"weight_block_size": [64, 64]}, r"weight_block_size \[64, 64\]"),
    ({"weight_block_size": None}, "weight_block_size None"),
    ({"activation_scheme": "static"}, "activation_scheme 'static'"),
    ({"scale_fmt": "ue8m0"}, "scale_fmt 'ue8m0'"),
])
def test_an_unsupported_quantization_is_refused_in_one_line_naming_what_is_supported(tmp_path, fp8_model, fields,
                                                                                      named):
    folder = _with_quantization(tmp_path, fp8_model, **fields)
    expected = named + r".* is not supported; supported: fine-grained FP8 \(quant_method 'fp8', fmt 'e4m3'"
    with pytest.raises(ConfigError, match=expected) as worker_side:
        load_model(folder, TPGroup(), torch.float32, torch.device("cpu"))
    assert "\n" not in str(worker_side.value)
    with pytest.raises(ValueError, match=expected):  # and before any worker starts
        shardspec.EngineConfig(model=str(folder), local=1).check_model_folder()


def test_fp8_tensors_without_a_quantization_config_or_without_scales_are_refused(tmp_path, fp8_model):
    config, state = read_checkpoint(fp8_model)
    plain = {k: v for k, v in config.items() if k != "quantization_config"}
    write_checkpoint(tmp_path / "no-config", plain, state)
    with pytest.raises(ConfigError, match=r"is FP8 but config\.json has no quantization_config"):
        load_model(tmp_path / "no-config", TPGroup(), torch.float32, torch.device("cpu"))
    missing = "model.layers.1.mlp.up_proj.weight_scale_inv"
    quantization = json.loads((fp8_model / "config.json").read_text())["quantization_config"]
    write_checkpoint(tmp_path / "no-scale", config | {"quantization_config": quantization},
                     {k: v for k, v in state.items() if k != missing})
    with pytest.raises(ConfigError, match=f"has no '{missing}'"):
        load_model(tmp_path / "no-scale", TPGroup(), torch.float32, torch.device("cpu"))


def test_an_moe_whose_router_is_fp8_gives_the_logits_of_its_router_dequantised_at_load(tmp_path, monkeypatch):
    """Releases keep the router and the shared gate in 16 bits; a checkpoint that quantises them
    makes the block's stacked router an FP8 projection, whose parts the block joins again."""
    import shardspec.testing.fp8 as fp8_format

    keep = tuple(k for k in fp8_format.FP8_KEEP if k not in ("mlp.gate.", "shared_expert_gate"))
    monkeypatch.setattr(fp8_format, "FP8_KEEP", keep)
    write_random_checkpoint(tmp_path, tiny_moe_config(), seed=6, fp8=True, experts="per_expert")
    kept = load_model(tmp_path, TPGroup(), torch.float32, torch.device("cpu"), fp8_native=True)
    plain = load_model(tmp_path, TPGroup(), torch.float32, torch.device("cpu"), fp8_native=False)
    assert isinstance(kept.layers["0"].mlp.router.method, Fp8LinearMethod)
    ids = random.Random(6).choices(range(512), k=20)
    torch.testing.assert_close(logits_of(kept, ids), logits_of(plain, ids), rtol=1e-4, atol=1e-4)
