"""The model interface and registry: families are found by config.json, stages hold only their
layers, and a family the engine does not know by name runs through workers and orchestrator."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

import pytest
import torch
import toy_family

import shardspec
from shardspec.layers.batch import Batch
from shardspec.layers.parallel import TPGroup
from shardspec.models import registry
from shardspec.models.base import Stage, split_layers
from shardspec.models.checkpoint import checkpoint_files
from shardspec.models.config import ConfigError
from shardspec.models.loader import checkpoint_keys, load_model
from shardspec.testing.random_checkpoint import tiny_config, write_random_checkpoint

CPU = torch.device("cpu")


@pytest.mark.parametrize("raw", [
    {"architectures": ["Qwen3NextForCausalLM"], "model_type": "qwen3_next"},
    {"model_type": "llama"},
    {},
])
def test_the_registry_refuses_an_unsupported_model_and_names_the_supported_ones(raw):
    with pytest.raises(ConfigError) as info:
        registry.resolve(raw)
    message = str(info.value)
    assert "unsupported model" in message and "Qwen3_5ForCausalLM" in message
    assert all(name in message for name in raw.get("architectures", []))


def test_the_registry_finds_qwen3_5_by_architecture_or_model_type():
    assert registry.resolve({"architectures": ["Qwen3_5ForConditionalGeneration"]}).name == "qwen3_5"
    assert registry.resolve({"model_type": "qwen3_5", "text_config": {"model_type": "qwen3_5_text"}}).name == "qwen3_5"


def test_layers_split_evenly_or_as_given_and_bad_splits_are_refused():
    assert [(s.start, s.end) for s in split_layers(7, 3)] == [(0, 3), (3, 5), (5, 7)]
    assert [(s.start, s.end) for s in split_layers(8, 2, [3, 5])] == [(0, 3), (3, 8)]
    for stages, split in [(2, [4, 5]), (2, [8, 0]), (3, [4, 4]), (9, None)]:
        with pytest.raises(ConfigError):
            split_layers(8, stages, split)


@pytest.fixture(scope="module")
def four_layer_model(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("four-layers")
    write_random_checkpoint(path, tiny_config(num_hidden_layers=4), seed=3, layout="model")
    return path


def test_a_stage_holds_only_its_layers_and_reads_only_their_tensors(four_layer_model):
    whole = load_model(four_layer_model, TPGroup(), torch.float32, CPU, with_mtp=True)
    first = load_model(four_layer_model, TPGroup(), torch.float32, CPU, with_mtp=True, stage=Stage(0, 1, 4))
    last = load_model(four_layer_model, TPGroup(), torch.float32, CPU, with_mtp=True, stage=Stage(1, 4, 4))
    keys = {m: checkpoint_keys(m) for m in (whole, first, last)}
    assert keys[first] | keys[last] == keys[whole] <= set(checkpoint_files(four_layer_model))
    assert {k for k in keys[first] if ".layers." in k} == {k for k in keys[whole] if k.startswith("model.layers.0.")}
    assert not any(k.startswith(("lm_head", "mtp.", "model.norm", "model.layers.1.")) for k in keys[first])
    assert not first.has_mtp and last.has_mtp and last.lm_head is not None and first.lm_head is None
    assert "model.embed_tokens.weight" in keys[last]  # the MTP module embeds the token it drafts from
    size = {m: sum(p.nbytes for p in m.parameters()) for m in (whole, first, last)}
    assert size[first] < size[whole] and size[last] < size[whole]


def test_stages_run_one_after_the_other_equal_the_whole_model(four_layer_model):
    stages = split_layers(4, 2, [1, 3])
    whole = load_model(four_layer_model, TPGroup(), torch.float32, CPU, with_mtp=False)
    parts = [load_model(four_layer_model, TPGroup(), torch.float32, CPU, with_mtp=False, stage=s) for s in stages]
    ids = torch.randint(0, 512, (2, 9), generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        expected = whole(ids, Batch.uncached(2, 9, CPU))
        hidden = parts[1](parts[0](ids, Batch.uncached(2, 9, CPU)), Batch.uncached(2, 9, CPU))
    assert torch.equal(hidden, expected)


@pytest.fixture
def toy_model(tmp_path, monkeypatch) -> Path:
    """A checkpoint of the test-only family, with the family importable by spawned workers."""
    tests = str(Path(__file__).parent)
    monkeypatch.setenv(registry.PLUGINS_ENV, "toy_family")
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [tests, os.environ.get("PYTHONPATH")])))
    return toy_family.write_checkpoint(tmp_path / "toy", toy_family.ToyConfig())


def reference_greedy(model_dir: Path, prompt: list[int], n: int) -> list[int]:
    """Greedy decoding in this process, recomputing the whole sequence for every token (no cache)."""
    model = load_model(model_dir, TPGroup(), torch.float32, CPU, with_mtp=False)
    ids = list(prompt)
    with torch.inference_mode():
        for _ in range(n):
            hidden = model(torch.tensor([ids]), Batch.uncached(1, len(ids), CPU))
            ids.append(int(model.lm_head.argmax(hidden[:, -1])[0]))
    return ids[len(prompt):]


@pytest.mark.parametrize("tp", [1, pytest.param(2, marks=pytest.mark.slow)])
def test_a_second_model_family_generates_through_workers_and_engine(toy_model, tp):
    prompts = [[5, 17, 3, 60, 2], [9, 9, 41]]
    expected = [reference_greedy(toy_model, p, 12) for p in prompts]

    async def run(mtp: bool) -> tuple[list[list[int]], float]:
        async with shardspec.connect(model=str(toy_model), local=tp, mtp=mtp, max_seqs=2) as engine:
            async def one(prompt):
                tokens, final = [], None
                async for chunk in engine.generate(prompt, max_tokens=12, temperature=0, stop_at_eos=False):
                    tokens += chunk.token_ids
                    final = chunk
                return tokens, final.stats

            results = await asyncio.gather(*(one(p) for p in prompts))
            assert engine.load_info.draft_tokens == (3 if mtp else 0)
            return [tokens for tokens, _ in results], sum(s.get("drafts", 0) for _, s in results)

    with_mtp, drafts = asyncio.run(run(True))
    without, _ = asyncio.run(run(False))
    assert with_mtp == without == expected
    assert drafts > 0  # the family's MTP module drafted, and the verify pass judged its drafts


@pytest.mark.parametrize("chunk", [64, 32, 16, 7])
def test_the_chunked_delta_rule_at_any_chunk_size_equals_the_token_by_token_recurrence(chunk, monkeypatch):
    """layers.gdn.CHUNK (what train_tiny.py --gdn-chunk sets) changes the work's shape, not the result:
    output and final state equal the recurrence's, for a length that no chunk size divides."""
    from shardspec.layers import gdn

    generator = torch.Generator().manual_seed(0)
    B, H, T, dk, dv = 2, 3, 45, 8, 6

    def rand(*shape):
        return torch.randn(*shape, generator=generator, dtype=torch.float64)

    q, k = (torch.nn.functional.normalize(rand(B, H, T, dk), dim=-1) for _ in range(2))
    v, state = rand(B, H, T, dv), rand(B, H, dk, dv)
    g, beta = -torch.rand(B, H, T, generator=generator, dtype=torch.float64), torch.rand(B, H, T, generator=generator,
                                                                                         dtype=torch.float64)
    expected, expected_state, _ = gdn.recurrent_delta_rule(q, k, v, g, beta, state)
    monkeypatch.setattr(gdn, "CHUNK", chunk)
    solve, systems = torch.linalg.solve_triangular, []
    monkeypatch.setattr(torch.linalg, "solve_triangular", lambda a, *args, **kw: systems.append(a.shape) or solve(
        a, *args, **kw))
    out, final = gdn.chunked_delta_rule(q, k, v, g, beta, state)
    size = min(chunk, T)  # a chunk longer than the input is the input
    assert systems and all(shape[-2:] == (size, size) for shape in systems)  # it ran chunks of that size
    torch.testing.assert_close(out, expected, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(final, expected_state, rtol=1e-10, atol=1e-10)
