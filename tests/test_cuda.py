"""The CUDA path (NCCL, bf16): skipped where there is no GPU; run on the GPU machine."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import queue
import random
import sys
import time
import traceback
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import shardspec
from shardspec import kernels
from shardspec.cli import BUNDLED_MODEL
from shardspec.layers.batch import BLOCK_TOKENS, Batch, CacheShape
from shardspec.layers.parallel import SymmetricReducer, TPGroup, use_symmetric_memory
from shardspec.models.loader import load_model
from shardspec.orchestrator.tokenizer import Tokenizer
from shardspec.orchestrator.workers import free_port
from shardspec.testing.agreement import top1_agreement
from shardspec.testing.random_checkpoint import tiny_config, write_random_checkpoint
from shardspec.testing.sizes import nine_b_config

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
PROMPTS = ["def fibonacci(n):", "class Stack:\n    def __init__(self):\n", "import os\n\n\ndef main():\n"]
CACHE = "1GiB"  # each worker's cache, as on a CPU: tests share the GPU (xdist, two stages), whose default is 90 % of it


def held_out_ids(count: int) -> list[int]:
    sys.path.insert(0, str(Path(__file__).parents[1] / "tools"))
    from train_tiny import is_held_out, stdlib_files

    text = "".join(p.read_text(errors="replace") for rel, p in stdlib_files() if is_held_out(rel))
    return Tokenizer.from_folder(BUNDLED_MODEL).encode(text)[:count]


def greedy(device: str, dtype: str, tp: int, mtp: bool, prompts: list[str] | list[list[int]] = PROMPTS, pp: int = 1,
           logs: list[str] | None = None, model: Path = BUNDLED_MODEL, **options) -> list[list[int]]:
    """The greedy outputs of `prompts`, generated together; `logs` receives the local workers' logs.
    The workers run with this test run's options (--worker-flags) and `options` on top."""
    async def run():
        async with shardspec.connect(model=str(model), local=tp * pp, pp=pp, tp=tp, device=device, dtype=dtype,
                                     mtp=mtp, cache_memory=CACHE,
                                     worker_options=dataclasses.replace(kernels.settings, **options)) as e:
            async def one(prompt):
                out = []
                async for chunk in e.generate(prompt, max_tokens=64, stop_at_eos=False):
                    out += chunk.token_ids
                return out

            outputs = await asyncio.gather(*(one(p) for p in prompts))
            if logs is not None:
                logs.extend(path.read_text(errors="replace") for path in e.group.local.logs)
            return outputs

    return asyncio.run(run())


def test_fp32_greedy_output_on_the_gpu_equals_the_cpu_output():
    assert greedy("cuda", "float32", 1, mtp=False) == greedy("cpu", "float32", 1, mtp=False)


@torch.inference_mode()
def test_bf16_logits_agree_with_the_fp32_reference_on_held_out_text():
    """Teacher-forced top-1 agreement over 256 held-out positions, through the serving paths: one
    prefill pass, a prefill in chunks (the later ones attend over the cache through the flash kernel,
    causal from the last key), and 256 one-token decode passes (the kernels that read the cache in place)."""
    ids = torch.tensor(held_out_ids(257))[None, :-1]
    cpu = load_model(BUNDLED_MODEL, TPGroup(), torch.float32, torch.device("cpu"), with_mtp=False)
    reference = cpu.lm_head.logits(cpu(ids, Batch.uncached(1, 256, ids.device)))[0].argmax(-1)
    model = load_model(BUNDLED_MODEL, TPGroup(), torch.bfloat16, torch.device("cuda"), with_mtp=False)
    x, slots = ids.cuda(), torch.tensor([0], device="cuda")
    positions = torch.arange(256, device="cuda")[None]
    model.allocate_caches(1, 256, torch.bfloat16, x.device)
    prefill = model(x, Batch(slots, positions, 256))
    model.reset_slots(slots)
    chunked = torch.cat([model(x[:, t : t + 96], Batch(slots, positions[:, t : t + 96], min(t + 96, 256), tail=True))
                         for t in range(0, 256, 96)], 1)
    model.reset_slots(slots)
    decode = torch.cat([model(x[:, t : t + 1], Batch(slots, positions[:, t : t + 1], t + 1)) for t in range(256)], 1)
    agreement = {name: (model.lm_head.logits(hidden)[0].argmax(-1).cpu() == reference).float().mean().item()
                 for name, hidden in (("prefill", prefill), ("chunked", chunked), ("decode", decode))}
    assert min(agreement.values()) >= 0.98, agreement


ODD_HEADS = {"head_dim": 48, "linear_key_head_dim": 24, "linear_value_head_dim": 40}  # the kernels pad each


@pytest.fixture(scope="module")
def odd_heads_model(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("odd-heads")
    write_random_checkpoint(path, tiny_config(**ODD_HEADS), seed=3)
    return path


def cached_logits(model, ids: torch.Tensor) -> torch.Tensor:
    """Logits over ids [B, T ≤ 64] on the model's device: a cached prefill of 2/3 of the tokens, five
    one-token decode passes, then verify-sized passes of three; the rows in slots B..1 (not in order)."""
    device = next(model.parameters()).device
    dtype = next(model.parameters()).dtype
    (B, T), prefill = ids.shape, ids.shape[1] * 2 // 3
    model.allocate_caches(B + 1, 64, dtype, device)
    x, slots = ids.to(device), torch.arange(B, 0, -1, device=device)
    positions = torch.arange(T, device=device).expand(B, -1)
    spans = [(0, prefill), *((t, t + 1) for t in range(prefill, prefill + 5)),
             *((t, min(t + 3, T)) for t in range(prefill + 5, T, 3))]
    hidden = torch.cat([model(x[:, a:b], Batch(slots, positions[:, a:b], b)) for a, b in spans], 1)
    return model.lm_head.logits(hidden).float().cpu()


def cpu_logits(model_dir, ids: torch.Tensor) -> torch.Tensor:
    """The fp32 CPU model's logits over ids in one uncached pass: the reference of the GPU paths."""
    cpu = load_model(model_dir, TPGroup(), torch.float32, torch.device("cpu"), with_mtp=False)
    return cpu.lm_head.logits(cpu(ids, Batch.uncached(*ids.shape, ids.device)))


@torch.inference_mode()
def test_head_dims_that_are_not_powers_of_two_give_the_cpu_logits_through_the_kernels(odd_heads_model):
    """fp32, head dim 48, linear key dim 24, value dim 40: a cached prefill, one-token decode passes
    and a three-token (verify-sized) pass through the GPU kernels give the CPU's whole-sequence logits."""
    ids = torch.randint(0, 512, (2, 24), generator=torch.Generator().manual_seed(0))
    model = load_model(odd_heads_model, TPGroup(), torch.float32, torch.device("cuda"), with_mtp=False)
    torch.testing.assert_close(cached_logits(model, ids), cpu_logits(odd_heads_model, ids), rtol=1e-4, atol=1e-4)


def test_head_dims_that_are_not_powers_of_two_give_the_same_greedy_tokens_with_and_without_kernels(
        odd_heads_model):
    """The engine on the GPU, fp32: kernels (with MTP too: verify passes), the PyTorch path
    (the option kernels off) and the CPU all give the same greedy tokens."""
    prompts = [[5, 17, 300, 42, 9], [101, 7, 7, 250]]
    kernels = greedy("cuda", "float32", 1, mtp=False, prompts=prompts, model=odd_heads_model)
    with_mtp = greedy("cuda", "float32", 1, mtp=True, prompts=prompts, model=odd_heads_model)
    plain = greedy("cuda", "float32", 1, mtp=False, prompts=prompts, model=odd_heads_model, kernels=False)
    assert kernels == plain == with_mtp == greedy("cpu", "float32", 1, mtp=False, prompts=prompts,
                                                  model=odd_heads_model)


@pytest.fixture(scope="module")
def nine_b_heads_model(tmp_path_factory) -> Path:
    """The 9B's heads (attention 16 × 256 over 4 KV heads, Gated DeltaNet 16 key and 32 value heads
    of 128) in 4 layers with a narrow MLP and vocabulary: the kernels at the 9B's shapes, in 0.8 GB."""
    path = tmp_path_factory.mktemp("9b-heads")
    config = nine_b_config() | {"num_hidden_layers": 4, "layer_types": tiny_config()["layer_types"],
                                "intermediate_size": 2048, "vocab_size": 4096, "eos_token_id": None}
    write_random_checkpoint(path, config, seed=9, dtype=torch.bfloat16, mtp=False)
    return path


def paged_logits(model, ids: torch.Tensor) -> torch.Tensor:
    """Logits over ids [B, T] on the model's device: a prefill of the first half, one-token decode
    passes, then verify-sized passes of four; each row's K/V in blocks scattered over the pool."""
    device = next(model.parameters()).device
    (B, T), prefill = ids.shape, ids.shape[1] // 2
    per = -(-T // BLOCK_TOKENS)
    order = torch.randperm(B * per, generator=torch.Generator().manual_seed(2))
    tables = order.view(B, per).int().to(device)
    model.allocate_paged(CacheShape(B, B * per, tables), next(model.parameters()).dtype, device)
    x, slots = ids.to(device), torch.arange(B, device=device)
    positions = torch.arange(T, device=device).expand(B, -1)
    spans = [(0, prefill), *((t, t + 1) for t in range(prefill, prefill + 6)),
             *((t, min(t + 4, T)) for t in range(prefill + 6, T, 4))]
    hidden = torch.cat([model(x[:, a:b], Batch(slots, positions[:, a:b], b)) for a, b in spans], 1)
    return model.lm_head.logits(hidden).float().cpu()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@torch.inference_mode()
def test_the_paged_attention_kernels_at_the_9b_heads_agree_with_the_pytorch_path(nine_b_heads_model, dtype,
                                                                                   monkeypatch):
    """Teacher-forced over 160 positions (5 blocks a row, the tables shuffled): decode and verify passes
    through the Triton kernels against the PyTorch path (the option kernels off) on the same weights.
    fp32: the same logits; bf16: top-1 agreement ≥ 99 % where the margin is past the noise
    (testing.agreement: random weights give flat logits)."""
    ids = torch.randint(0, 4096, (3, 160), generator=torch.Generator().manual_seed(4))
    model = load_model(nine_b_heads_model, TPGroup(), dtype, torch.device("cuda"), with_mtp=False)
    through_kernels = paged_logits(model, ids)
    monkeypatch.setattr(kernels, "settings", dataclasses.replace(kernels.settings, kernels=False))
    pytorch = paged_logits(model, ids)
    if dtype == torch.float32:
        torch.testing.assert_close(through_kernels, pytorch, rtol=1e-4, atol=1e-4)
    else:
        agreement = top1_agreement(through_kernels, pytorch)
        assert agreement["confident_top1_agreement"] >= 0.99 and agreement["confident_share"] > 0.5, agreement


@pytest.mark.parametrize("launch_ahead", ["off", "auto"])
def test_prefix_cache_hits_with_mtp_under_cuda_graphs_give_the_greedy_tokens_of_the_cache_off(small_vocab_model,
                                                                                               launch_ahead):
    """fp32 on the GPU, CUDA graphs, MTP on: a five-turn chat and two chats that share its system prompt,
    with the prefix cache on and off (test_prefix_cache's trace). A hit restores saved recurrent states
    and the target's hidden state for MTP and copies its boundary block; verify passes cap the drafts
    and write the last hidden state inside the graphs. Launch ahead off: the ends of finished
    sequences are saved, so each later turn hits partway through a block; auto: the workers keep no
    finished state and the turns hit the blocks of their prompts. fla off: prefills of both runs
    take shardspec's kernels, whose fp32 is full fp32."""
    from test_prefix_cache import BT, conversation

    seed, logs = 11, []
    system = random.Random(seed).choices(range(16), k=75)
    options = dataclasses.replace(kernels.settings, launch_ahead=launch_ahead, fla=False, tail_graphs=True)

    async def run(prefix_cache: bool):
        async with shardspec.connect(model=str(small_vocab_model), local=1, device="cuda", dtype="float32", mtp=True,
                                     max_seq_len=512, max_seqs=2, prefix_cache=prefix_cache, cache_memory=CACHE,
                                     worker_options=options) as engine:
            turns = await conversation(engine, random.Random(seed), system, 5, 12)
            logs.extend(path.read_text(errors="replace") for path in engine.group.local.logs)
            return turns

    cached, plain = asyncio.run(run(True)), asyncio.run(run(False))
    assert all("captured" in log for log in logs), "a worker ran without CUDA graphs"
    assert [tokens for tokens, _ in cached] == [tokens for tokens, _ in plain]
    hits = [hit for _, hit in cached]
    assert hits[0] == 0 and all(h > 0 for h in hits[1:5]), hits
    if launch_ahead == "off":
        assert all(h % BT for h in hits[1:5]), hits  # each turn after the first: mid-block, the last turn's end
    assert hits[5] == 0 and hits[6] == 64, hits  # the shared system prompt: saved by the second, hit by the third


@pytest.mark.parametrize(("tail", "saves", "pieces"),
                         [(9, [], 1), (20, [64], 1), (60, [64, 96], 3), (100, [], 1), (200, [64], 1)],
                         ids=["one-piece", "a-save-within-it", "two-saves-split-it", "a-piece-of-the-largest-bucket",
                              "a-long-piece-eagerly"])
def test_a_cached_turn_prefilled_from_tail_graphs_equals_it_prefilled_eagerly(small_vocab_model, tail, saves,
                                                                              pieces, monkeypatch):
    """fp32 on the GPU, MTP on: the tokens, the first drafts, the states after the prefill and those saved
    within it, with a turn's short pieces replayed from the runner's tail graphs (tails.TailPasses) and
    with none (test_prefix_cache's padded pieces run eagerly on the CPU)."""
    from test_prefix_cache import cached_turn

    monkeypatch.setattr(kernels, "settings", dataclasses.replace(kernels.settings, tail_graphs=True))
    model = load_model(small_vocab_model, TPGroup(), torch.float32, torch.device("cuda"), with_mtp=True)
    tokens, drafts, states, saved, _ = cached_turn(model, 45, tail, saves, "off", device="cuda")
    tokens_g, drafts_g, states_g, saved_g, replays = cached_turn(model, 45, tail, saves, "graphs", device="cuda")
    assert replays == pieces
    assert (tokens_g, drafts_g) == (tokens, drafts)
    for got, expected in zip(states_g + saved_g, states + saved):
        for a, b in zip(got, expected):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("tp", [1, 2])
def test_bf16_greedy_with_mtp_equals_without_on_the_gpu(tp):
    if torch.cuda.device_count() < tp:
        pytest.skip(f"needs {tp} GPUs")
    assert greedy("cuda", "bfloat16", tp, mtp=True) == greedy("cuda", "bfloat16", tp, mtp=False)


@pytest.mark.parametrize("mtp", [False, True])
def test_greedy_with_passes_launched_ahead_equals_greedy_without_on_the_gpu(mtp):
    """Launch ahead is on by default on a GPU (runner.py): each step's pass queued behind the one
    before it. Budgets that end the sequences at different steps, so that launched passes carry rows
    of sequences that have finished; deterministic fp32, where no batch shape changes a token."""
    async def run(launch_ahead: str):
        options = dataclasses.replace(kernels.settings, launch_ahead=launch_ahead)
        async with shardspec.connect(model=str(BUNDLED_MODEL), local=1, device="cuda", dtype="float32", mtp=mtp,
                                     deterministic=True, cache_memory=CACHE, worker_options=options) as e:
            async def one(prompt, max_tokens):
                return [t async for chunk in e.generate(prompt, max_tokens=max_tokens, stop_at_eos=False)
                        for t in chunk.token_ids]

            outputs = await asyncio.gather(*(one(p, 16 + 24 * i) for i, p in enumerate(PROMPTS)))
            return outputs, sum(s.launched_ahead for s in await e.stats())

    ahead, launched = asyncio.run(run("auto"))
    plain, none = asyncio.run(run("off"))
    assert ahead == plain and launched > 0 and none == 0


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_greedy_at_pp_2_with_graphs_on_both_stages_of_one_gpu_equals_pp_1(dtype):
    """Two stage workers on one GPU, both replaying CUDA graphs: the last stage's fused pass reads
    the received hidden states from its bucket's buffer, stage 0's verify pass ends at its layers'
    output and its commit waits for the record. Four sequences in two micro-batches of one bucket,
    so two of stage 0's steps await their records at once, each in its own graph copy. MTP on; the
    same greedy tokens as one worker (whose batch of four is another bucket's shapes)."""
    prompts = [*PROMPTS, "for i in range(10):\n"]
    logs: list[str] = []
    staged = greedy("cuda:0", dtype, 1, mtp=True, prompts=prompts, pp=2, logs=logs)
    assert all("captured" in log for log in logs), "a stage ran without CUDA graphs"
    assert staged == greedy("cuda:0", dtype, 1, mtp=True, prompts=prompts)


@pytest.fixture(scope="module")
def nine_b_widths_model(tmp_path_factory) -> Path:
    """The 9B's widths (hidden 4096, MLP 12288, its attention and Gated DeltaNet heads) in 8 layers, a
    full-attention layer in each stage's half, over a 4096-token vocabulary: 3.7 GB in bf16 with MTP."""
    path = tmp_path_factory.mktemp("9b-widths")
    config = nine_b_config() | {"num_hidden_layers": 8, "layer_types": tiny_config(num_hidden_layers=8)["layer_types"],
                                "vocab_size": 4096, "eos_token_id": None}
    write_random_checkpoint(path, config, seed=9, dtype=torch.bfloat16, keep=False)
    return path


GENERATE_BOUND_S = 120  # one generation of at most 64 tokens, its prefill's first kernel compiles included


def warm_up_then_time(model: Path, pp: int, prompt: list[int]) -> list[list[int]]:
    """bench/decode.py's batch-1 row on cuda:0: one sequence at a time (max_seqs 1: a pool of one
    sequence's blocks and one saved state), a warm-up of 4 tokens, then 64 of the same prompt."""
    async def run():
        async with shardspec.connect(model=str(model), local=pp, pp=pp, device="cuda:0", mtp=True, max_seqs=1,
                                     max_seq_len=200, cache_memory=CACHE, worker_options=kernels.settings) as e:
            async def one(max_tokens: int) -> list[int]:
                return [t async for chunk in e.generate(prompt, max_tokens=max_tokens, stop_at_eos=False)
                        for t in chunk.token_ids]

            return [await asyncio.wait_for(one(n), GENERATE_BOUND_S) for n in (4, 64)]

    return asyncio.run(run())


def test_pp_2_at_the_9b_widths_on_one_gpu_generates_the_pp_1_tokens_within_a_bound(nine_b_widths_model):
    """Two stages on one GPU at the 9B's widths (bf16, CUDA graphs on both, MTP on), driven as
    bench/decode.py drives them: each generation ends within its bound (the timed one waited forever
    for the blocks its own prompt's cached blocks held: prefix.PrefixCache.admit) with one worker's tokens."""
    prompt = random.Random(1).choices(range(4096), k=128)
    staged = warm_up_then_time(nine_b_widths_model, 2, prompt)
    assert staged[1][:4] == staged[0]
    assert staged == warm_up_then_time(nine_b_widths_model, 1, prompt)


def test_the_all_reduce_fused_with_the_norm_equals_all_reduce_then_norm():
    """Two GPUs, the fused kernel against NCCL's all-reduce then the add + norm kernel, bit for bit:
    eagerly at a decode's and a verify's row counts, then from a CUDA graph of 48 back-to-back calls
    of mixed row counts, replayed with new inputs while one rank starts late: the ranks run apart
    by up to a call, so a rank writes a row's next slot while its peer still reads the last one."""
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs")
    context = torch.multiprocessing.get_context("spawn")
    results = context.Queue()
    address = f"tcp://127.0.0.1:{free_port()}"
    ranks = [context.Process(target=_fused_norm_rank, args=(rank, address, results)) for rank in range(2)]
    for process in ranks:
        process.start()
    reports: dict[int, str] = {}
    deadline = time.monotonic() + 300
    try:
        while len(reports) < 2 and "ok" == reports.get(0, "ok") == reports.get(1, "ok"):
            rank, report = results.get(timeout=max(1.0, deadline - time.monotonic()))
            reports[rank] = report
    except queue.Empty:
        pass
    finally:  # a rank whose peer failed waits in a collective: stop it
        for process in ranks:
            process.join(timeout=10)
            if process.is_alive():
                process.kill()
    failures = {rank: report for rank, report in reports.items() if report != "ok"}
    assert not failures, "\n".join(failures.values())
    assert len(reports) == 2, f"rank(s) {sorted({0, 1} - set(reports))} hung waiting for the peer"


def _fused_norm_rank(rank: int, address: str, results) -> None:
    try:
        _fused_norm_checks(rank, address)
        results.put((rank, "ok"))
    except BaseException:
        results.put((rank, traceback.format_exc()))


@torch.inference_mode()
def _fused_norm_checks(rank: int, address: str) -> None:
    from shardspec.kernels.norm import rms_norm

    device = torch.device("cuda", rank)
    torch.cuda.set_device(device)
    dist.init_process_group("nccl", init_method=address, rank=rank, world_size=2, device_id=device)
    D, eps = 4096, 1e-6
    weight = torch.randn(D, generator=torch.Generator().manual_seed(0)).to(device, torch.bfloat16)

    def inputs(rows: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's partial sum, and a residual that is the same on both ranks."""
        generator = torch.Generator().manual_seed(seed)
        residual, parts = torch.randn(rows, D, generator=generator), torch.randn(2, rows, D, generator=generator)
        return parts[rank].to(device, torch.bfloat16), residual.to(device, torch.bfloat16)

    def check(x: torch.Tensor, residual: torch.Tensor, fused: tuple[torch.Tensor, torch.Tensor]) -> None:
        summed = x.clone()
        dist.all_reduce(summed)
        expected = rms_norm(summed, weight, eps, residual)
        assert torch.equal(fused[1], expected[1]) and torch.equal(fused[0], expected[0]), (rank, x.shape)

    assert use_symmetric_memory(device, 2)  # two GPUs of one host: the default (allreduce auto) takes it
    reducer = SymmetricReducer(None)
    x, residual = inputs(1, 0)
    check(x, residual, reducer.rms_norm(x, residual, weight, eps))
    most = reducer.norm_rings[torch.bfloat16, D].rows
    assert most >= 128, most  # a verify pass of 32 sequences with 3 drafts
    for seed, rows in enumerate([3, 8, 32, 128, most, 1, 1], 1):
        x, residual = inputs(rows, seed)
        check(x, residual, reducer.rms_norm(x, residual, weight, eps))
    assert reducer.rms_norm(*inputs(most + 1, 9), weight, eps) is None

    static = [inputs(rows, 10 + i) for i, rows in enumerate([1, 4, 1, 32, 8, 1] * 8)]
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for x, residual in static:
            reducer.rms_norm(x, residual, weight, eps)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outputs = [reducer.rms_norm(x, residual, weight, eps) for x, residual in static]
    for replay in range(10):
        for i, (x, residual) in enumerate(static):
            new_x, new_residual = inputs(x.shape[0], 100 * replay + i)
            x.copy_(new_x)
            residual.copy_(new_residual)
        if rank == 1:
            torch.cuda._sleep(100_000 * (replay % 4))  # start late: up to ~0.15 ms
        graph.replay()
        for (x, residual), fused in zip(static, outputs):
            check(x, residual, fused)
        if replay % 3 == 0:  # an eager call between replays shifts row 0's and row 1's slots again
            x, residual = inputs(2, 7 * replay)
            check(x, residual, reducer.rms_norm(x, residual, weight, eps))
    dist.destroy_process_group()


def test_tp2_greedy_output_with_the_fused_symmetric_all_reduce_equals_the_nccl_output():
    """End to end: the same tokens whichever all-reduce the workers use (the fused kernel sums as
    NCCL does for two ranks, so the hidden states agree bit for bit)."""
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs")
    nccl = greedy("cuda", "bfloat16", 2, mtp=True, allreduce="nccl")
    assert greedy("cuda", "bfloat16", 2, mtp=True, allreduce="symm") == nccl


@torch.inference_mode()
def test_every_graph_a_step_replays_is_captured_at_load():
    """A batch shrinks as its sequences finish, to smaller buckets, and sampled sequences take the
    verify + draft graphs where greedy ones take the fused one: no step may stop to capture."""
    from shardspec.protocol.messages import PrefillSpec, SamplingParams, StepRequest
    from shardspec.shard_worker.decoder import Decoder
    from shardspec.testing.grants import Grants

    if not kernels.active():
        pytest.skip("graphs are captured per context bucket on first use without the kernels")
    model = load_model(BUNDLED_MODEL, TPGroup(), torch.bfloat16, torch.device("cuda"), with_mtp=True)
    runner = Decoder(model, torch.device("cuda"), max_seqs=6, max_seq_len=128, prefill_chunk=128, draft_len=2)
    captured = {key: set(bucket.graphs) for key, bucket in runner.passes.buckets.items()}
    assert sorted(size for size, _, _ in captured) == [1, 2, 4, 8]
    assert all(names == {"fused", "verify", "draft"} for names in captured.values())
    prompt = torch.tensor(Tokenizer.from_folder(BUNDLED_MODEL).encode(PROMPTS[0]))
    sampled = 5  # the longest-lived: mixed steps at every size, greedy-only steps of up to 5 rows
    specs = [PrefillSpec(seq=i, length=len(prompt), max_tokens=4 + 3 * i,
                         sampling=SamplingParams(temperature=0.8 if i == sampled else 0.0, seed=i)) for i in range(6)]
    Grants(runner).step(StepRequest(prefill=specs), prompt.repeat(6))
    while live := [s for s, seq in runner.sequences.items() if not seq.finished]:
        runner.step(StepRequest(decode=live), torch.empty(0, dtype=torch.long))
        runner.step(StepRequest(decode=[s for s in live if s != sampled]), torch.empty(0, dtype=torch.long))
    assert {key: set(bucket.graphs) for key, bucket in runner.passes.buckets.items()} == captured
    runner.close()


def test_deterministic_logits_on_the_gpu_are_the_same_bits_alone_in_a_batch_and_with_mtp_in_bf16(tiny_model):
    from test_deterministic import decode_logits, prompts_of

    model = load_model(tiny_model, TPGroup(), torch.bfloat16, torch.device("cuda"), with_mtp=True)
    prompts = prompts_of([5, 5, 1, 17, 40, 70], seed=3)
    together = decode_logits(model, prompts, draft_len=3, deterministic=True, device="cuda")
    for prompt, batched in zip(prompts, together):
        alone = decode_logits(model, [prompt], draft_len=0, deterministic=True, device="cuda")[0]
        assert alone.keys() == batched.keys()
        assert all(torch.equal(alone[pos], batched[pos]) for pos in alone)


def test_deterministic_greedy_output_on_the_gpu_is_the_same_alone_and_among_others_with_mtp_on_and_off():
    prompts = [[(7 * i + 3 * j) % 4000 + 1 for j in range(3 + i % 37)] for i in range(32)]

    async def run(mtp: bool, together: bool) -> list[list[int]]:
        async with shardspec.connect(model=str(BUNDLED_MODEL), local=1, device="cuda", dtype="bfloat16", mtp=mtp,
                                     max_seqs=32, deterministic=True, cache_memory=CACHE) as engine:
            async def one(prompt):
                tokens = []
                async for chunk in engine.generate(prompt, max_tokens=24, stop_at_eos=False):
                    tokens += chunk.token_ids
                return tokens
            if together:
                return await asyncio.gather(*(one(p) for p in prompts))
            return [await one(p) for p in prompts]

    alone = asyncio.run(run(False, together=False))
    assert asyncio.run(run(False, together=True)) == alone
    assert asyncio.run(run(True, together=True)) == alone


SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                          "kind": {"enum": ["cat", "dog", "owl"]},
                                          "age": {"type": "integer", "minimum": 0, "maximum": 120}},
          "required": ["name", "kind", "age"], "additionalProperties": False}


def test_greedy_json_under_cuda_graphs_with_mtp_equals_without_and_parses():
    """Constrained steps replay the verify pass's graph and draft eagerly under the masks; in
    deterministic mode the constrained greedy outputs, several in one batch beside a free one, are the
    same with MTP and without, and parse as the schema's JSON."""
    async def run(mtp: bool) -> list[str]:
        async with shardspec.connect(model=str(BUNDLED_MODEL), local=1, device="cuda", dtype="bfloat16", mtp=mtp,
                                     max_seqs=8, deterministic=True, cache_memory=CACHE) as engine:
            async def one(prompt: str, constrained: bool) -> str:
                options = {"structured_output": {"json": SCHEMA}} if constrained else {}
                return "".join([c.text async for c in engine.generate(prompt, max_tokens=64, **options)])
            return await asyncio.gather(*(one(p, True) for p in PROMPTS), one(PROMPTS[0], False))

    with_mtp, without = asyncio.run(run(True)), asyncio.run(run(False))
    assert with_mtp == without
    for text in with_mtp[:-1]:
        value = json.loads(text)
        assert set(value) == {"name", "kind", "age"} and value["kind"] in ("cat", "dog", "owl")


@pytest.mark.parametrize("mtp", [False, True])
def test_sampled_and_constrained_steps_launched_ahead_under_cuda_graphs_equal_those_without(mtp):
    """Steps the host decides (sampled, seeded) launch the next verify ahead, and greedy steps under a
    grammar without MTP choose their tokens under the masks on the device and launch ahead; both
    under the graphs give the outputs of launch ahead off (deterministic fp32)."""
    async def run(launch_ahead: str):
        options = dataclasses.replace(kernels.settings, launch_ahead=launch_ahead)
        async with shardspec.connect(model=str(BUNDLED_MODEL), local=1, device="cuda", dtype="float32", mtp=mtp,
                                     max_seqs=8, deterministic=True, cache_memory=CACHE, worker_options=options) as e:
            async def one(prompt: str, **options) -> str:
                return "".join([c.text async for c in e.generate(prompt, max_tokens=64, **options)])
            sampled = [one(p, temperature=0.8, seed=i + 1) for i, p in enumerate(PROMPTS)]
            constrained = [one(p, temperature=0, structured_output={"json": SCHEMA}) for p in PROMPTS]
            outputs = await asyncio.gather(*sampled)  # (apart: a batch of sampled rows, then one of greedy ones)
            outputs += await asyncio.gather(*constrained)
            return outputs, sum(s.launched_ahead for s in await e.stats())

    ahead, launched = asyncio.run(run("auto"))
    plain, none = asyncio.run(run("off"))
    assert ahead == plain and launched > 0 and none == 0
    assert all(set(json.loads(text)) == {"name", "kind", "age"} for text in plain[len(PROMPTS):])


@pytest.fixture(scope="module")
def moe_model(tmp_path_factory) -> Path:
    """A tiny random mixture of experts (8 experts, top 3), fused experts in the layers and per expert in the
    MTP layer."""
    from shardspec.testing.random_checkpoint import tiny_moe_config

    path = tmp_path_factory.mktemp("tiny-moe")
    write_random_checkpoint(path, tiny_moe_config(), seed=2, experts="mixed")
    return path


@torch.inference_mode()
def test_moe_fp32_on_the_gpu_gives_the_cpu_logits(moe_model):
    ids = torch.randint(0, 512, (2, 24), generator=torch.Generator().manual_seed(0))
    reference = cpu_logits(moe_model, ids)
    gpu = load_model(moe_model, TPGroup(), torch.float32, torch.device("cuda"), with_mtp=False)
    for backend in ("gathered", "grouped"):  # gathered: the fp32 default; grouped: where the GPU's kernel takes fp32
        for module in gpu.modules():
            if hasattr(module, "backend"):
                module.backend = backend
        try:
            logits = cached_logits(gpu, ids)
        except RuntimeError as exc:  # torch's grouped_mm takes bf16 only on some builds
            assert backend == "grouped", exc
            continue
        torch.testing.assert_close(logits, reference, rtol=1e-4, atol=1e-4 * reference.abs().max().item())


@torch.inference_mode()
def test_moe_bf16_logits_agree_with_the_fp32_reference_teacher_forced(moe_model):
    # at the positions where the reference's top-1 margin is beyond bf16's noise: elsewhere a random
    # model's near-ties flip under any rounding (shardspec.testing.agreement)
    ids = torch.randint(0, 512, (4, 48), generator=torch.Generator().manual_seed(1))
    reference = cpu_logits(moe_model, ids)
    gpu = load_model(moe_model, TPGroup(), torch.bfloat16, torch.device("cuda"), with_mtp=False)
    experts, x = gpu.layers["0"].mlp.experts, torch.empty(1, device="cuda", dtype=torch.bfloat16)
    assert (experts.pick(x, 4 * 32 * 3), experts.pick(x, 4 * 3)) == ("grouped", "fused")  # prefill; decode
    agreement = top1_agreement(cached_logits(gpu, ids).cpu(), reference)
    assert agreement["confident_share"] >= 0.25, agreement  # enough positions for the check to mean something
    assert agreement["confident_top1_agreement"] >= 0.98, agreement


@torch.inference_mode()
@pytest.mark.parametrize("backend", ["grouped", "gathered", "fused"])
def test_moe_routing_and_experts_run_in_a_cuda_graph_without_host_syncs(backend):
    """The block at the 35B-A3B MoE shape (hidden 2048, top 8 of 256, width 512), bf16: captured in a
    CUDA graph (a host sync would fail the capture), replayed on new tokens, it gives the eager result;
    and it agrees with the fp32 reference loop."""
    from shardspec.layers.moe import SparseMoE

    torch.manual_seed(0)
    block = SparseMoE(2048, 256, 8, 512, 512, TPGroup()).cuda()
    for param in block.parameters():
        param.data.normal_(0, 2048 ** -0.5)
    reference = SparseMoE(2048, 256, 8, 512, 512, TPGroup()).cuda()
    reference.load_state_dict(block.state_dict())
    block, reference.experts.backend, block.experts.backend = block.bfloat16(), "reference", backend
    x = torch.randn(32, 2048, device="cuda", dtype=torch.bfloat16)
    block(x)  # warm-up (kernel choice, allocations) before the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = block(x)
    x.copy_(torch.randn(32, 2048, device="cuda", dtype=torch.bfloat16))
    graph.replay()
    torch.testing.assert_close(out, block(x), rtol=0, atol=0)
    exact = reference(x.float())
    # tokens whose top 8 the bf16 logits keep (a near-tie at the 8th place may flip: no bug): most
    same = [set(a) == set(b) for a, b in zip(torch.topk(block.router(x)[0], 8).indices.tolist(),
                                               torch.topk(reference.router(x.float())[0], 8).indices.tolist())]
    assert sum(same) >= 0.75 * len(same)
    kept = torch.tensor(same, device="cuda")
    assert (out.float() - exact)[kept].abs().max() <= 2e-2 * exact.abs().max()


@torch.inference_mode()
@pytest.mark.parametrize("ep", [1, 2])
def test_the_fused_experts_equal_the_grouped_gemm_at_decode_shapes(ep):
    """35B-A3B experts (hidden 2048, top 8 of 256, width 512), bf16, 1 to 32 tokens (8 to 256 rows, the
    auto choice's range of the fused kernels) and 33, rank 1 of ep: the fused kernels round where the
    grouped path does, so the two agree to bf16 noise; both are checked against the fp32 loop."""
    from shardspec.layers.moe import FUSED_ROWS, Experts, route

    torch.manual_seed(0)
    experts = Experts(256, 2048, 512, TPGroup(ep - 1, ep), ep).cuda()
    experts.gate_up_proj.data.normal_(0, 2048 ** -0.5)
    experts.down_proj.data.normal_(0, 512 ** -0.5)
    exact = Experts(256, 2048, 512, TPGroup(ep - 1, ep), ep).cuda()
    exact.load_state_dict(experts.state_dict())
    experts, exact.backend = experts.bfloat16(), "reference"
    for N in (1, 2, 8, 32, 33):
        x = torch.randn(N, 2048, device="cuda", dtype=torch.bfloat16)
        weights, ids = route(torch.randn(N, 256, device="cuda", dtype=torch.bfloat16), 8)
        experts.backend = "auto"  # the loop below fixes one backend after the other
        assert experts.pick(x, ids.numel()) == ("fused" if N * 8 <= FUSED_ROWS else "grouped")
        out = {}
        for backend in ("fused", "grouped"):
            experts.backend = backend
            out[backend] = experts(x, weights, ids).float()
        reference = exact(x.float(), weights.float(), ids)
        scale = reference.abs().max()
        torch.testing.assert_close(out["fused"], out["grouped"], rtol=2**-7, atol=2**-7 * scale.item())
        for result in out.values():
            assert (result - reference).abs().max() <= 2**-6 * scale


def test_moe_greedy_on_the_gpu_with_cuda_graphs_equals_the_cpu_in_fp32(moe_model):
    prompts = [[5, 17, 300, 42, 9], [101, 7, 7, 250]]
    assert greedy("cuda", "float32", 1, mtp=False, prompts=prompts, model=moe_model) == \
        greedy("cpu", "float32", 1, mtp=False, prompts=prompts, model=moe_model)


def test_moe_deterministic_logits_on_the_gpu_are_the_same_bits_alone_in_a_batch_and_with_mtp_in_bf16(moe_model):
    from test_deterministic import decode_logits, prompts_of

    model = load_model(moe_model, TPGroup(), torch.bfloat16, torch.device("cuda"), with_mtp=True)
    prompts = prompts_of([5, 5, 1, 17, 70], seed=3)
    together = decode_logits(model, prompts, draft_len=3, deterministic=True, device="cuda")
    for prompt, batched in zip(prompts, together):
        alone = decode_logits(model, [prompt], draft_len=0, deterministic=True, device="cuda")[0]
        assert alone.keys() == batched.keys()
        assert all(torch.equal(alone[pos], batched[pos]) for pos in alone)


# --- FP8 checkpoints (block-wise e4m3, 128 × 128 scales) ---------------------------------------------

def _fp8_reference_inputs(M: int, N: int, K: int):
    gen = torch.Generator().manual_seed(M * 7 + N)
    x = torch.randn(M, K, generator=gen).to(torch.bfloat16)
    weight = (torch.randn(N, K, generator=gen) * 3).clamp(-448, 448).to(torch.float8_e4m3fn)
    scale = torch.rand(-(-N // 128), -(-K // 128), generator=gen) * 0.01 + 0.001
    return x, weight, scale


@pytest.mark.parametrize("M", [1, 7, 64, 65, 77, 300])
@pytest.mark.parametrize(("N", "K"), [(384, 512), (200, 320), (1024, 1536)])  # ragged last blocks: 200 × 320
@pytest.mark.parametrize("prefill", ["triton", "cublas"])
@pytest.mark.parametrize("decode", ["w8a8", "weight-only"])
def test_the_fp8_gemms_match_the_dequantised_weight(M, N, K, prefill, decode, monkeypatch):
    """Against x @ (W8 · scale)^T in fp32, each output within what its path can round (bf16 out:
    2^-8 of it): weight-only decode rows (≤ 64, bf16 activations) to fp32 accumulation; W8A8 rows
    (prefill, and decode in that mode) within the e4m3 rounding bound of the activations
    (fp8_reference.rounding_bound), on cuBLAS (any row count: padded to 16) or our kernels."""
    from fp8_reference import rounding_bound

    from shardspec.kernels import fp8 as kernel_fp8
    from shardspec.layers.fp8 import dequantize

    monkeypatch.setattr(kernels, "settings", dataclasses.replace(kernels.settings, fp8_decode=decode))

    x, weight, scale = _fp8_reference_inputs(M, N, K)
    w = dequantize(weight, scale, torch.float32)
    cuda = torch.device("cuda")
    cublas = kernel_fp8.cublas_layout(weight.to(cuda), scale.to(cuda)) if prefill == "cublas" else None
    if prefill == "cublas" and M > kernel_fp8.DECODE_ROWS and cublas is None:
        pytest.skip("no block-scaled FP8 in this cuBLAS, or not this shape")
    got = kernel_fp8.linear(x.to(cuda), weight.to(cuda), scale.to(cuda), cublas_scale=cublas).float().cpu()
    expected = x.float() @ w.T
    terms = x.float().abs() @ w.abs().T
    weight_only = M <= kernel_fp8.DECODE_ROWS and decode == "weight-only"
    rounding = 2**-12 * terms if weight_only else rounding_bound(x, w) + 2**-9 * terms
    assert ((got - expected).abs() <= 2**-8 * expected.abs() + rounding).all()
    invariant = kernel_fp8.linear(x.to(cuda), weight.to(cuda), scale.to(cuda), invariant=True).float().cpu()
    one_row = kernel_fp8.linear(x[:1].to(cuda), weight.to(cuda), scale.to(cuda), invariant=True).float().cpu()
    assert torch.equal(invariant[:1], one_row)  # batch-invariant: a row's result depends on that row alone


@pytest.mark.parametrize("quantize", [False, True])
def test_the_fp8_decode_gemv_inside_a_cuda_graph_gives_the_eager_result(quantize):
    """The split-K counters reset themselves: replays of a captured GEMV (down_proj's shape at
    batch 1 and 8) give the eager result bit for bit."""
    from shardspec.kernels import fp8 as kernel_fp8

    cuda = torch.device("cuda")
    kernel_fp8.prepare(cuda)
    for M in (1, 8):
        x, weight, scale = (t.to(cuda) for t in _fp8_reference_inputs(M, 4096, 12288))
        assert kernel_fp8.plan(M, 4096, 12288, torch.cuda.get_device_properties(cuda).multi_processor_count).split > 1
        eager = kernel_fp8.decode(x, weight, scale, quantize=quantize)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            captured = kernel_fp8.decode(x, weight, scale, quantize=quantize)
        for _ in range(3):
            graph.replay()
            torch.cuda.synchronize()
            assert torch.equal(captured, eager)


@pytest.fixture(scope="module")
def fp8_model(tmp_path_factory) -> Path:
    from test_fp8 import ALIGNED  # whole 128 × 128 blocks at TP = 1 and 2

    path = tmp_path_factory.mktemp("fp8-aligned")
    write_random_checkpoint(path, ALIGNED, seed=2, fp8=True, dtype=torch.bfloat16)
    return path


@torch.inference_mode()
def test_an_fp8_checkpoint_kept_fp8_on_the_gpu_gives_the_cpu_logits_in_fp32(fp8_model):
    """fp32 (the weight-only kernel at every row count): a cached prefill of 80 tokens, one-token
    decode passes and a three-token (verify-sized) pass with the FP8 weights in GPU memory give the
    logits of the weights dequantised at load on the CPU."""
    from shardspec.layers.fp8 import Fp8LinearMethod

    ids = torch.randint(0, 512, (2, 90), generator=torch.Generator().manual_seed(0))
    cpu = load_model(fp8_model, TPGroup(), torch.float32, torch.device("cpu"), with_mtp=False)
    reference = cpu.lm_head.logits(cpu(ids, Batch.uncached(2, 90, ids.device)))
    model = load_model(fp8_model, TPGroup(), torch.float32, torch.device("cuda"), with_mtp=False)
    assert isinstance(model.layers["0"].mlp.down_proj.method, Fp8LinearMethod)
    assert model.layers["0"].mlp.down_proj.weight.dtype == torch.float8_e4m3fn
    model.allocate_caches(3, 128, torch.float32, torch.device("cuda"))
    x, slots = ids.cuda(), torch.tensor([2, 0], device="cuda")
    positions = torch.arange(90, device="cuda").expand(2, -1)
    spans = [(0, 80), *((t, t + 1) for t in range(80, 87)), (87, 90)]
    hidden = torch.cat([model(x[:, a:b], Batch(slots, positions[:, a:b], b)) for a, b in spans], 1)
    torch.testing.assert_close(model.lm_head.logits(hidden).cpu(), reference, rtol=1e-4, atol=1e-4)


def _relative_rms(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).pow(2).mean() / b.float().pow(2).mean()).sqrt().item()


@torch.inference_mode()
def test_the_fp8_w8a8_passes_deviate_only_by_their_activation_rounding(fp8_model, monkeypatch):
    """bf16 on the GPU against the fp32 logits of the same FP8 checkpoint on the CPU: one-token
    weight-only decode passes (bf16 activations) stay closer than the e4m3 rounding of the
    activations moves the logits (measured on the CPU: every FP8 projection's input through the
    W8A8 quantisation, fp8_reference), and a prefill pass and one-token W8A8 decode passes deviate
    no more than that rounding and the bf16 noise together explain (their root sum of squares,
    1.5×): their gap is the W8A8 scheme's, not our kernels'."""
    import fp8_reference

    from shardspec.layers import fp8 as layer_fp8

    ids = torch.randint(0, 512, (2, 96), generator=torch.Generator().manual_seed(1))
    cpu = load_model(fp8_model, TPGroup(), torch.float32, torch.device("cpu"), with_mtp=False, fp8_native=True)
    exact = cpu.lm_head.logits(cpu(ids, Batch.uncached(2, 96, ids.device)))
    plain = layer_fp8.fp8_linear
    monkeypatch.setattr(layer_fp8, "fp8_linear", lambda x, *args: plain(fp8_reference.quantised_activations(x), *args))
    w8a8 = cpu.lm_head.logits(cpu(ids, Batch.uncached(2, 96, ids.device)))
    monkeypatch.undo()
    model = load_model(fp8_model, TPGroup(), torch.bfloat16, torch.device("cuda"), with_mtp=False)
    x, slots = ids.cuda(), torch.arange(2, device="cuda")
    positions = torch.arange(96, device="cuda").expand(2, -1)
    model.allocate_caches(2, 96, torch.bfloat16, x.device)
    prefill = model.lm_head.logits(model(x, Batch(slots, positions, 96))).cpu()

    def decode(mode: str) -> torch.Tensor:
        monkeypatch.setattr(kernels, "settings", dataclasses.replace(kernels.settings, fp8_decode=mode))
        model.reset_slots(slots)
        return model.lm_head.logits(torch.cat([model(x[:, t : t + 1], Batch(slots, positions[:, t : t + 1], t + 1))
                                               for t in range(96)], 1)).cpu()

    rounding, noise = _relative_rms(w8a8, exact), _relative_rms(decode("weight-only"), exact)
    assert noise < rounding, (noise, rounding)
    for logits in (prefill, decode("w8a8")):
        deviation = _relative_rms(logits, exact)
        assert deviation <= 1.5 * (rounding**2 + noise**2) ** 0.5, (deviation, rounding, noise)


def test_an_fp8_checkpoint_through_the_engine_on_the_gpu_gives_the_cpu_greedy_output(fp8_model):
    """fp32, the engine's CUDA graphs, MTP on and off (verify passes of k + 1 rows), against the
    CPU path, which dequantises at load."""
    prompts = [[5, 17, 300, 42, 9], [101, 7, 7, 250]]
    cpu = greedy("cpu", "float32", 1, mtp=False, prompts=prompts, model=fp8_model)
    assert greedy("cuda", "float32", 1, mtp=False, prompts=prompts, model=fp8_model) == cpu
    assert greedy("cuda", "float32", 1, mtp=True, prompts=prompts, model=fp8_model) == cpu


def test_an_fp8_checkpoint_at_tp_2_on_the_gpu_gives_the_tp_1_greedy_output(fp8_model):
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs")
    prompts = [[5, 17, 300, 42, 9], [101, 7, 7, 250]]
    assert greedy("cuda", "float32", 2, mtp=False, prompts=prompts, model=fp8_model) == \
        greedy("cuda", "float32", 1, mtp=False, prompts=prompts, model=fp8_model)
