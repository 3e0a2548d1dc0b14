"""Qwen3.5 mixture of experts: the sharded model against transformers' Qwen3_5MoeForCausalLM, in
both expert layouts, under tensor and expert parallelism; MTP; the splits that are refused."""

from __future__ import annotations

import asyncio
import math
import random
import re

import pytest
import torch
from conftest import pooled
from reference import fuse_experts, hf_greedy, hf_logits, hf_model, read_checkpoint
from test_deterministic import decode_logits, prompts_of
from test_model_equivalence import DECODE_STEPS, sharded_logits
from test_spec_decode import generate_all
from transformers import Qwen3_5MoeTextConfig

import shardspec
from shardspec.layers.parallel import TPGroup
from shardspec.models.base import split_config
from shardspec.models.config import ConfigError
from shardspec.models.loader import load_model
from shardspec.models.qwen3_5 import Qwen3_5MoeConfig
from shardspec.orchestrator.config import EngineConfig
from shardspec.testing.random_checkpoint import (
    parameter_shapes,
    random_state_dict,
    thirty_five_b_a3b_config,
    tiny_moe_config,
    write_checkpoint,
    write_random_checkpoint,
)


@pytest.fixture(scope="session")
def moe_model(tmp_path_factory):
    """Tiny random MoE with MTP, routed experts fused in the layers and per expert in the MTP layer
    (as the 35B-A3B release), multimodal layout."""
    path = tmp_path_factory.mktemp("tiny-moe")
    write_random_checkpoint(path, tiny_moe_config(), seed=2, layout="language_model", experts="mixed")
    return path


@pytest.fixture(scope="session")
def moe_model_per_expert(tmp_path_factory):
    """The same weights, one tensor per expert everywhere, text layout, in three files."""
    path = tmp_path_factory.mktemp("tiny-moe-per-expert")
    write_random_checkpoint(path, tiny_moe_config(), seed=2, layout="model", experts="per_expert", shards=3)
    return path


# fast: each layout, TP 1, 2 and 4, TP split inside expert groups; slow: the other combinations
@pytest.mark.parametrize(("layout", "tp", "ep"), [
    ("mixed", 1, 1), ("per_expert", 2, 1), ("mixed", 4, 2),
    *(pytest.param(*case, marks=pytest.mark.slow) for case in [
        ("per_expert", 1, 1), ("mixed", 2, 1), ("per_expert", 2, 2), ("per_expert", 4, 1), ("mixed", 4, 4)]),
])
def test_moe_logits_match_transformers_for_prefill_and_decode(layout, tp, ep, moe_model, moe_model_per_expert):
    model_dir = moe_model if layout == "mixed" else moe_model_per_expert
    prompt = random.Random(tp + ep).choices(range(512), k=70)
    tokens, logits = asyncio.run(sharded_logits(model_dir, tp, prompt, ep=ep))
    reference = hf_logits(hf_model(model_dir), prompt + tokens[:-1])
    assert logits.shape == reference.shape == (len(prompt) + DECODE_STEPS, 512)
    scale = reference.abs().max().item()
    assert (logits - reference).abs().max().item() <= 1e-4 * scale
    assert tokens == reference[len(prompt) - 1 :].argmax(-1).tolist()


@pytest.fixture(scope="session")
def moe_small_vocab_model(tmp_path_factory):
    """A 16-token vocabulary: random MTP drafts are accepted often enough, and rejected too."""
    path = tmp_path_factory.mktemp("tiny-moe-small-vocab")
    write_random_checkpoint(path, tiny_moe_config(vocab_size=16), seed=6, layout="model", experts="mixed")
    return path


@pytest.mark.parametrize("options", [dict(ep=2, mtp=False), dict(pp=2, mtp=True)])
def test_moe_greedy_generation_through_the_orchestrator_equals_transformers_generate(moe_model, options):
    """Expert parallelism, and pipeline stages with the MoE MTP layer on the last one."""
    rng = random.Random(8)
    prompts = [rng.choices(range(512), k=n) for n in (1, 9, 40)]
    reference = hf_model(moe_model)
    expected = [hf_greedy(reference, prompt, 32) for prompt in prompts]

    async def run() -> list[list[int]]:
        async with shardspec.connect(model=str(moe_model), dtype="float32", workers=pooled(2), **options) as engine:
            return await generate_all(engine, prompts, max_tokens=32)  # batched in shared steps

    assert asyncio.run(run()) == expected


@pytest.mark.parametrize(("tp", "ep"), [pytest.param(1, 1, marks=pytest.mark.slow), (2, 2)])
def test_moe_greedy_output_with_mtp_equals_output_without(moe_small_vocab_model, tp, ep):
    rng = random.Random(tp)
    prompts = [rng.choices(range(16), k=rng.randint(1, 30)) for _ in range(4)]

    async def run(mtp: bool) -> tuple[list[list[int]], object]:
        # deterministic: equal outputs are guaranteed whatever shares a step and with MTP on or off
        async with shardspec.connect(model=str(moe_small_vocab_model), workers=pooled(tp), ep=ep, mtp=mtp, max_seqs=8,
                                     dtype="float32", deterministic=True) as engine:
            return await generate_all(engine, prompts, max_tokens=24), (await engine.stats())[0]

    plain, _ = asyncio.run(run(False))
    with_mtp, stats = asyncio.run(run(True))
    assert with_mtp == plain
    assert 0 < stats.accepted_tokens < stats.draft_tokens  # drafts were accepted, and others rolled back


def test_moe_deterministic_logits_are_the_same_bits_alone_in_a_batch_and_with_mtp_in_bf16(moe_model):
    model = load_model(moe_model, TPGroup(), torch.bfloat16, torch.device("cpu"), with_mtp=True)
    prompts = prompts_of([5, 5, 1, 70], seed=2)
    together = decode_logits(model, prompts, draft_len=3, deterministic=True)
    for prompt, batched in zip(prompts, together):
        alone = decode_logits(model, [prompt], draft_len=0, deterministic=True)[0]
        assert alone.keys() == batched.keys()
        assert all(torch.equal(alone[pos], batched[pos]) for pos in alone)


@pytest.mark.parametrize("experts", ["fused", "per_expert"])
def test_a_rank_reads_its_experts_and_its_rows_of_each_from_either_layout(tmp_path, experts):
    """TP 4 in 2 expert groups: rank 3 holds experts 4..7 (the second half), rows 16..31 of each."""
    config = tiny_moe_config()
    state = write_random_checkpoint(tmp_path, config, seed=4, experts=experts)
    model = load_model(tmp_path, TPGroup(3, 4), torch.float32, torch.device("cpu"), with_mtp=True, expert_parallel=2)
    for prefix, layer in (("model.layers.1.", model.layers["1"]), ("mtp.layers.0.", model.mtp.layers[0])):
        fused = fuse_experts({n: t for n, t in state.items() if n.startswith(prefix)})
        gate_up, down = fused[f"{prefix}mlp.experts.gate_up_proj"], fused[f"{prefix}mlp.experts.down_proj"]
        rows = slice(16, 32)
        expected = torch.cat([gate_up[4:, rows], gate_up[4:, 32 + 16 : 64]], 1)
        assert torch.equal(layer.mlp.experts.gate_up_proj, expected)
        assert torch.equal(layer.mlp.experts.down_proj, down[4:, :, rows])
        router = torch.cat([fused[f"{prefix}mlp.gate.weight"], fused[f"{prefix}mlp.shared_expert_gate.weight"]])
        assert torch.equal(layer.mlp.router.weight, router)  # the router and the shared gate: whole
        shared = slice(36, 48)  # the shared expert: split over all 4 ranks
        assert torch.equal(layer.mlp.shared_expert.down_proj.weight,
                           fused[f"{prefix}mlp.shared_expert.down_proj.weight"][:, shared])


def test_the_expert_layouts_hold_the_same_weights_and_mixed_puts_the_mtp_layer_per_expert():
    config = tiny_moe_config()
    fused = random_state_dict(config, seed=1, experts="fused")
    per_expert = random_state_dict(config, seed=1, experts="per_expert")
    mixed = random_state_dict(config, seed=1, experts="mixed")
    assert "model.layers.0.mlp.experts.7.down_proj.weight" in per_expert
    assert "model.layers.0.mlp.experts.down_proj" in mixed and "mtp.layers.0.mlp.experts.7.up_proj.weight" in mixed
    for other in (per_expert, mixed):
        together = fuse_experts(other)
        assert together.keys() == fused.keys()
        assert all(torch.equal(together[n], fused[n]) for n in fused)


def test_every_moe_parameter_is_randomised():
    state = random_state_dict(tiny_moe_config(), seed=0, experts="mixed")
    for name in ("model.layers.0.mlp.gate.weight", "model.layers.0.mlp.experts.gate_up_proj",
                 "model.layers.0.mlp.shared_expert_gate.weight", "mtp.layers.0.mlp.experts.3.down_proj.weight"):
        assert name in state
    for name, t in state.items():
        assert torch.isfinite(t).all() and t.float().std() > 0.05, name
    gate_up = state["model.layers.0.mlp.experts.gate_up_proj"]
    assert not torch.equal(gate_up[0], gate_up[1]) and not torch.equal(gate_up[0, :32], gate_up[0, 32:])


def test_the_35b_a3b_shape_has_35b_parameters_and_loads_in_transformers():
    config = thirty_five_b_a3b_config()
    count = sum(math.prod(s) for s in parameter_shapes(config, mtp=False).values())
    assert 34e9 < count < 36e9
    hf = Qwen3_5MoeTextConfig(**{k: v for k, v in config.items() if k != "model_type"})
    assert (hf.num_experts, hf.num_experts_per_tok, hf.moe_intermediate_size) == (256, 8, 512)
    assert hf.layer_types == config["layer_types"]


def test_a_missing_expert_tensor_is_named(tmp_path):
    config = tiny_moe_config()
    state = random_state_dict(config, seed=1, experts="per_expert")
    missing = "model.layers.2.mlp.experts.5.up_proj.weight"
    write_checkpoint(tmp_path, config, {n: t for n, t in state.items() if n != missing})
    with pytest.raises(ConfigError, match=missing.replace(".", r"\.")):
        load_model(tmp_path, TPGroup(), torch.float32, torch.device("cpu"), with_mtp=False)


def test_a_fused_expert_tensor_of_another_shape_is_refused(tmp_path):
    config = tiny_moe_config()
    state = random_state_dict(config, seed=1)
    name = "model.layers.0.mlp.experts.down_proj"
    write_checkpoint(tmp_path, config, {**state, name: state[name][:-1]})
    with pytest.raises(ConfigError, match=re.escape(f"{name}' has shape [7, 64, 32], the config implies [8, 64, 32]")):
        load_model(tmp_path, TPGroup(), torch.float32, torch.device("cpu"), with_mtp=False)


@pytest.mark.parametrize(("options", "message"), [
    ({"local": 3}, "tensor-parallel degree 3 does not divide num_attention_heads=8; degrees that work: 1, 2, 4$"),
    ({"local": 4, "ep": 3}, "expert-parallel degree 3 does not divide the tensor-parallel degree 4; at "
                            "tensor-parallel degree 4 these work: 1, 2, 4$"),
    ({"local": 2, "ep": 2, "pp": 1}, None),
])
def test_a_split_that_does_not_fit_the_experts_is_refused_before_any_worker_starts(moe_model, options, message):
    config = EngineConfig(model=str(moe_model), **options)
    if message is None:
        config.check_model_folder()
        return
    with pytest.raises(ValueError, match=message):
        config.check_model_folder()


def test_the_refusals_name_the_expert_count_and_width_and_the_degrees_that_work():
    few = Qwen3_5MoeConfig.from_dict(tiny_moe_config(num_experts=6))
    with pytest.raises(ConfigError, match=r"expert-parallel degree 4 does not divide num_experts=6; at tensor-parallel "
                                          r"degree 4 these work: 1, 2$"):
        split_config(few, 4, 4)
    narrow = Qwen3_5MoeConfig.from_dict(tiny_moe_config(moe_intermediate_size=6))
    with pytest.raises(ConfigError, match=r"tensor-parallel degree 4 leaves 4 ranks per expert, which do not divide "
                                          "moe_intermediate_size=6; degrees that work: 1, 2$"):
        split_config(narrow, 4)
    assert split_config(narrow, 4, 2).expert_parallel == 2  # two ranks per expert: 3 rows each


def test_an_expert_parallel_degree_out_of_range_is_refused():
    with pytest.raises(ValueError, match=r"ep must be an expert-parallel degree in \[1, 4096\], got 0"):
        EngineConfig(local=2, ep=0)


def test_expert_parallelism_on_a_dense_model_is_refused(tiny_model):
    with pytest.raises(ValueError, match="expert parallelism \\(ep=2\\) applies to mixture-of-experts models"):
        EngineConfig(model=str(tiny_model), local=2, ep=2).check_model_folder()


@pytest.mark.parametrize(("backend", "tp", "ep"), [
    ("grouped", 1, 1), ("gathered", 1, 1), ("reference", 4, 2), ("grouped", 4, 2), ("gathered", 4, 2),
    *(pytest.param(backend, 2, 2, marks=pytest.mark.slow) for backend in ("reference", "grouped", "gathered")),
])
def test_every_expert_backend_computes_the_block_and_the_ranks_parts_sum_to_the_whole(moe_model, backend, tp, ep):
    """The MoE block of layer 0 over 37 tokens: the ranks' partial sums, each rank with its slices
    and its experts, add up to one worker's block (the reference backend), in float32."""
    x = torch.randn(37, 64, generator=torch.Generator().manual_seed(tp))
    whole = load_model(moe_model, TPGroup(), torch.float32, torch.device("cpu"), with_mtp=False).layers["0"].mlp
    expected = whole(x)
    total = torch.zeros_like(expected)
    for rank in range(tp):
        model = load_model(moe_model, TPGroup(rank, tp), torch.float32, torch.device("cpu"), with_mtp=False,
                           expert_parallel=ep)
        block = model.layers["0"].mlp
        block.experts.backend = backend
        total += block(x)
    assert (total - expected).abs().max() <= 1e-5 * expected.abs().max()


def test_a_checkpoint_with_zero_experts_holds_them_as_holes_and_every_other_tensor_random(tmp_path):
    config = tiny_moe_config()
    kept = write_random_checkpoint(tmp_path, config, seed=3, experts="mixed", zero_experts=True)
    _, state = read_checkpoint(tmp_path)
    expected = fuse_experts(random_state_dict(config, seed=3, experts="mixed"))
    assert state.keys() == expected.keys()
    experts = [n for n in state if ".experts." in n]
    assert experts and all(not state[n].any() for n in experts)
    assert all(torch.equal(state[n], expected[n]) for n in state if n not in experts)
    assert all(not kept[n].any() for n in kept if ".experts." in n)
    file = (tmp_path / "model.safetensors").stat()
    expert_bytes = sum(t.nbytes for n, t in state.items() if n in experts)
    assert file.st_blocks * 512 < file.st_size - expert_bytes // 2  # most of the experts' bytes take no disk


def test_an_fp8_moe_checkpoint_is_checked_at_the_expert_parallel_degree_asked_for(tmp_path):
    # width 6: 4 ranks per expert cannot split it, 2 groups of 2 can (3 rows each)
    write_random_checkpoint(tmp_path, tiny_moe_config(moe_intermediate_size=6), seed=4, fp8=True, experts="per_expert")
    EngineConfig(model=str(tmp_path), local=4, ep=2).check_model_folder()
    with pytest.raises(ValueError, match="tensor-parallel degree 4 leaves 4 ranks per expert"):
        EngineConfig(model=str(tmp_path), local=4).check_model_folder()


def test_the_fused_kernels_take_the_shared_expert_only_at_one_token_with_16_bit_weights():
    """They read the shared expert's weights as they are: an FP8 projection (with its block scales
    elsewhere) stays out, as do more tokens than SHARED_TOKENS and a width other than the experts'."""
    from shardspec.layers.moe import SHARED_TOKENS, SparseMoE
    from shardspec.layers.quantization import QuantConfig

    block = SparseMoE(128, 8, 2, 128, 128, TPGroup()).to(torch.bfloat16)
    block.experts.backend = "fused"
    one, ids = torch.zeros(1, 128, dtype=torch.bfloat16), torch.zeros(1, 2, dtype=torch.long)
    gate = torch.ones(1, 1, dtype=torch.bfloat16)
    assert block.fused_shared(one, ids, gate) is not None
    many = torch.zeros(SHARED_TOKENS + 1, 128, dtype=torch.bfloat16)
    assert block.fused_shared(many, ids.expand(SHARED_TOKENS + 1, -1), gate.expand(SHARED_TOKENS + 1, -1)) is None
    fp8_shared = QuantConfig({"mlp.shared_expert.down_proj.weight": (128, 128)})
    quantised = SparseMoE(128, 8, 2, 128, 128, TPGroup(), quant=fp8_shared, prefix="mlp").to(torch.bfloat16)
    quantised.experts.backend = "fused"
    assert quantised.fused_shared(one, ids, gate) is None
    narrow = SparseMoE(128, 8, 2, 128, 64, TPGroup()).to(torch.bfloat16)
    narrow.experts.backend = "fused"
    assert narrow.fused_shared(one, ids, gate) is None
