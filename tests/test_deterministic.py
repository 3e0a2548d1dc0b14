"""Deterministic (batch-invariant) decoding: a sequence's result does not depend on what else is in
its steps, nor on MTP, in bfloat16 too."""

from __future__ import annotations

import asyncio
import random

import pytest
import torch
from conftest import pooled

import shardspec
from shardspec.cli import BUNDLED_MODEL
from shardspec.layers.parallel import TPGroup
from shardspec.models.loader import load_model
from shardspec.protocol.messages import PrefillSpec, StepRequest
from shardspec.shard_worker.decoder import Decoder
from shardspec.testing.grants import Grants

TOKENS = 12


def decode_logits(model, prompts: list[list[int]], draft_len: int, deterministic: bool,
                  device: str = "cpu") -> list[dict[int, torch.Tensor]]:
    """Greedy-decode the prompts together, TOKENS each: per prompt, the logits of every decode-step
    position whose input token was kept (the pending token and the accepted drafts). On a GPU the
    passes replay CUDA graphs, as in a worker."""
    device = torch.device(device)
    runner = Decoder(model, device, len(prompts), 128, 2048, draft_len, cuda_graphs=device.type == "cuda",
                         deterministic=deterministic)
    try:
        specs = [PrefillSpec(seq=i, length=len(p), max_tokens=TOKENS) for i, p in enumerate(prompts)]
        Grants(runner).step(StepRequest(prefill=specs), torch.tensor([t for p in prompts for t in p]))
        rows: list[dict[int, torch.Tensor]] = [{} for _ in prompts]
        while live := [i for i in range(len(prompts)) if not runner.sequences[i].finished]:
            starts = [runner.sequences[i].length for i in live]
            result = runner.step(StepRequest(decode=live, return_logits=True), torch.tensor([], dtype=torch.long))
            logits = result.logits[0].view(len(live), draft_len + 1, -1).cpu()
            for b, (i, start, emitted) in enumerate(zip(live, starts, result.tokens)):
                for j in range(len(emitted)):
                    rows[i][start + j] = logits[b, j]
        return rows
    finally:
        runner.close()


@pytest.fixture(scope="module")
def bf16_model(tiny_model):
    return load_model(tiny_model, TPGroup(), torch.bfloat16, torch.device("cpu"), with_mtp=True)


def prompts_of(lengths: list[int], seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [rng.choices(range(512), k=n) for n in lengths]


def test_deterministic_logits_are_the_same_bits_alone_in_a_batch_and_with_mtp_in_bf16(bf16_model):
    # two prompts of one length (prefilled together by default), short and long ones; random MTP
    # weights, so drafts are rejected and the states are rolled back
    prompts = prompts_of([5, 5, 1, 17, 40, 70], seed=3)
    together = decode_logits(bf16_model, prompts, draft_len=3, deterministic=True)
    for prompt, batched in zip(prompts, together):
        alone = decode_logits(bf16_model, [prompt], draft_len=0, deterministic=True)[0]
        assert alone.keys() == batched.keys()
        assert all(torch.equal(alone[pos], batched[pos]) for pos in alone)


def test_the_default_mode_is_not_batch_invariant_in_bf16_so_the_test_above_can_fail(bf16_model):
    prompts = prompts_of([5, 5, 1, 17, 40, 70], seed=3)
    together = decode_logits(bf16_model, prompts, draft_len=3, deterministic=False)
    alone = [decode_logits(bf16_model, [p], draft_len=0, deterministic=False)[0] for p in prompts]
    assert any(not torch.equal(a[pos], b[pos]) for a, b in zip(alone, together) for pos in a)


def test_deterministic_mode_computes_the_same_model_as_the_default_in_fp32(tiny_model):
    model = load_model(tiny_model, TPGroup(), torch.float32, torch.device("cpu"), with_mtp=True)
    prompts = prompts_of([3, 9, 70], seed=4)
    invariant = decode_logits(model, prompts, draft_len=0, deterministic=True)
    default = decode_logits(model, prompts, draft_len=0, deterministic=False)
    for a, b in zip(invariant, default):
        assert a.keys() == b.keys()
        for pos in a:
            assert (a[pos] - b[pos]).abs().max() <= 1e-5 * b[pos].abs().max()


@pytest.mark.slow
def test_64_concurrent_greedy_requests_in_bf16_at_tp_2_give_each_ones_solo_tokens_with_mtp_on_and_off():
    rng = random.Random(3)
    prompts = [rng.choices(range(1, 4096), k=rng.randint(3, 40)) for _ in range(64)]

    async def generate(engine, prompt) -> list[int]:
        tokens = []
        async for chunk in engine.generate(prompt, max_tokens=16, stop_at_eos=False):
            tokens += chunk.token_ids
        return tokens

    async def run() -> tuple[list, list, list, list]:
        options = dict(model=str(BUNDLED_MODEL), workers=pooled(2), dtype="bfloat16", max_seqs=64, deterministic=True)
        async with shardspec.connect(mtp=False, **options) as engine:
            alone = [await generate(engine, p) for p in prompts]
            together = await asyncio.gather(*(generate(engine, p) for p in prompts))
        async with shardspec.connect(mtp=True, **options) as engine:
            with_mtp = await asyncio.gather(*(generate(engine, p) for p in prompts))
            stats = await engine.stats()
        return alone, together, with_mtp, stats

    alone, together, with_mtp, stats = asyncio.run(run())
    assert together == alone
    assert with_mtp == alone
    assert 0 < stats[0].accepted_tokens < stats[0].draft_tokens  # drafts were really accepted (and others rolled back)
