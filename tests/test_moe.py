"""Qwen3.5 mixture of experts: the sharded model against transformers' Qwen3_5MoeForCausalLM, in
both expert layouts, under tensor and expert parallelism; MTP; the splits that are refused."""

from __future__ import annotations

import asyncio
import random

import pytest
import torch
from reference import hf_greedy, hf_logits, hf_model
from test_deterministic import decode_logits, prompts_of
from test_model_equivalence import DECODE_STEPS, sharded_logits
from test_spec_decode import generate_all

import shardspec
from shardspec.layers.parallel import TPGroup
from shardspec.models.loader import load_model
from shardspec.models.random_checkpoint import tiny_moe_config, write_random_checkpoint


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


@pytest.mark.parametrize(("layout", "tp", "ep"), [
    ("mixed", 1, 1), ("mixed", 2, 1), ("per_expert", 4, 1), ("mixed", 4, 2), ("per_expert", 2, 2),
    *(pytest.param(*case, marks=pytest.mark.slow) for case in [("per_expert", 1, 1), ("mixed", 4, 1),
                                                                ("mixed", 4, 4)]),
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


def test_moe_greedy_generation_through_the_orchestrator_equals_transformers_generate(moe_model):
    rng = random.Random(8)
    prompts = [rng.choices(range(512), k=n) for n in (1, 9, 40)]
    reference = hf_model(moe_model)
    expected = [hf_greedy(reference, prompt, 32) for prompt in prompts]

    async def run() -> list[list[int]]:
        async with shardspec.connect(model=str(moe_model), local=2, ep=2) as engine:
            return await generate_all(engine, prompts, max_tokens=32)  # batched in shared steps

    assert asyncio.run(run()) == expected


@pytest.mark.parametrize(("tp", "ep"), [(1, 1), (2, 2)])
def test_moe_greedy_output_with_mtp_equals_output_without(moe_small_vocab_model, tp, ep):
    rng = random.Random(tp)
    prompts = [rng.choices(range(16), k=rng.randint(1, 30)) for _ in range(4)]

    async def run(mtp: bool) -> tuple[list[list[int]], object]:
        # deterministic: equal outputs are guaranteed whatever shares a step and with MTP on or off
        async with shardspec.connect(model=str(moe_small_vocab_model), local=tp, ep=ep, mtp=mtp, max_slots=8,
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
