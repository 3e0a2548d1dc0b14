"""The sharded model, run by real worker processes, against Hugging Face transformers."""

from __future__ import annotations

import asyncio
import random

import pytest
import torch
from conftest import full_blocks, pooled
from reference import hf_greedy, hf_logits, hf_model

import shardspec
from shardspec.protocol.messages import PrefillSpec, StepRequest

DECODE_STEPS = 32


async def sharded_logits(model_dir, tp: int, prompt: list[int], ep: int = 1) -> tuple[list[int], torch.Tensor]:
    """Greedy-decode DECODE_STEPS tokens with logits returned; -> (tokens, logits [len(prompt)+steps, V])."""
    async with shardspec.connect(model=str(model_dir), workers=pooled(tp), ep=ep, prefill_chunk=48,
                                 mtp=False) as engine:
        prefill = StepRequest(prefill=[PrefillSpec(seq=1, length=len(prompt), blocks=full_blocks(engine))],
                              return_logits=True)
        replies = await engine.group.call_all(prefill, tensors={"prompt_ids": torch.tensor(prompt)})
        tokens, logits = [replies[0][0].tokens[0][0]], [replies[0][1]["logits"]]
        decode = StepRequest(decode=[1], return_logits=True)
        for _ in range(DECODE_STEPS):
            replies = await engine.group.call_all(decode)
            assert all(reply.tokens == replies[0][0].tokens for reply, _ in replies)
            tokens.append(replies[0][0].tokens[0][0])
            logits.append(replies[0][1]["logits"])
    return tokens, torch.cat(logits)


# the multimodal layout differs in the loader only, which TP = 1 covers
@pytest.mark.parametrize(("layout", "tp"), [
    ("model", 1), ("model", 2), ("model", 4), ("language_model", 1),
    *(pytest.param("language_model", tp, marks=pytest.mark.slow) for tp in (2, 4)),
])
def test_sharded_logits_match_transformers_for_prefill_and_decode(tp, layout, tiny_model, tiny_model_vl):
    model_dir = tiny_model if layout == "model" else tiny_model_vl
    prompt = random.Random(tp).choices(range(512), k=70)  # 70 > 64: crosses a GDN chunk boundary
    tokens, logits = asyncio.run(sharded_logits(model_dir, tp, prompt))
    reference = hf_logits(hf_model(model_dir), prompt + tokens[:-1])
    assert logits.shape == reference.shape == (len(prompt) + DECODE_STEPS, 512)
    scale = reference.abs().max().item()
    assert (logits - reference).abs().max().item() <= 1e-4 * scale
    assert tokens == reference[len(prompt) - 1 :].argmax(-1).tolist()  # the greedy tokens fed back in


def test_greedy_generation_through_the_orchestrator_equals_transformers_generate(tiny_model):
    rng = random.Random(7)
    prompts = [rng.choices(range(512), k=n) for n in (1, 5, 17, 40)]
    reference = hf_model(tiny_model)
    expected = [hf_greedy(reference, prompt, 64) for prompt in prompts]

    async def run() -> list[list[int]]:
        async with shardspec.connect(model=str(tiny_model), workers=pooled(2)) as engine:
            async def one(prompt):
                out = []
                async for chunk in engine.generate(prompt, max_tokens=64):
                    out += chunk.token_ids
                return out
            return await asyncio.gather(*(one(p) for p in prompts))  # batched in shared steps

    assert asyncio.run(run()) == expected
