"""The decode floor's byte count (shardspec.testing.step_bytes) on the tiny config, against sums
written out by hand from its numbers: vocab 512, hidden 64, intermediate 128, layers 3 Gated DeltaNet
+ 1 attention; attention 8 heads of 16, 4 KV heads; GDN 4 key heads and 8 value heads of 16, conv 4."""

from __future__ import annotations

import math

import torch

from shardspec.layers.parallel import TPGroup
from shardspec.models.base import split_config
from shardspec.models.loader import load_model
from shardspec.models.qwen3_5 import Qwen3_5Config, Qwen3_5MoeConfig
from shardspec.testing.random_checkpoint import parameter_shapes, tiny_config, tiny_moe_config, write_random_checkpoint
from shardspec.testing.step_bytes import step_bytes

CONFIG = Qwen3_5Config.from_dict(tiny_config())
MLP = 3 * 128 * 64 + 2 * 64  # gate, up, down; the two layer norms
ATTENTION = 2 * 8 * 16 * 64 + 2 * 4 * 16 * 64 + 64 * 8 * 16 + 2 * 16 + MLP  # q|gate, k, v, o, q/k norms
GDN = 256 * 64 + 128 * 64 + 2 * 8 * 64 + 256 * 4 + 2 * 8 + 16 + 64 * 128 + MLP  # qkv, z, b, a, conv, dt/A, norm, out
WEIGHTS = 2 * (3 * GDN + ATTENTION + 64 + 512 * 64)  # + the final norm and the LM head, bf16
KV_POSITION = 2 * 4 * 16 * 2  # K and V, 4 heads of 16, bf16
STATE = 2 * 3 * (8 * 16 * 16 * 4 + 256 * 3 * 2)  # read + written, 3 layers: fp32 state, bf16 conv state (K-1 = 3)


def test_a_step_without_drafts_reads_the_weights_once_and_only_the_embedding_rows_it_looks_up():
    got = step_bytes(CONFIG, tp=1, batch=2, context=10, k=0)
    assert got.weights == WEIGHTS
    assert got.embedding_rows == 2 * 64 * 2
    assert got.mtp == got.draft_head == 0
    assert got.kv_cache == 1 * 2 * (10 + 1) * KV_POSITION  # one attention layer: 10 read, 1 written per row
    assert got.recurrent_state == 2 * STATE
    assert got.block_tables == 2 * 1 * 4  # one attention layer: each row's one int32 entry (11 positions)
    assert got.total == WEIGHTS + 256 + 2 * 11 * KV_POSITION + 2 * STATE + 8


def test_a_step_with_k_drafts_reads_the_mtp_module_and_the_draft_head_k_times():
    mtp_module = 2 * (2 * 64 * 64 + 3 * 64 + ATTENTION)  # fc, three norms, one attention layer
    fp8_head = 512 * 64 + 512 * 4  # one byte an element, an fp32 scale a row
    got = step_bytes(CONFIG, tp=1, batch=2, context=10, k=2, draft_head="fp8")
    assert got.weights == WEIGHTS
    assert got.embedding_rows == 2 * (3 + 3 + 1) * 64 * 2  # verify (k+1), MTP over the prefix (k+1), chain (k-1)
    assert got.mtp == 2 * mtp_module
    assert got.draft_head == 2 * fp8_head
    # the target's layer: 10 read + 3 written; the MTP layer: 13 for the prefix pass, 14 for the chained one
    assert got.kv_cache == 2 * (13 + 13 + 14) * KV_POSITION
    assert got.recurrent_state == 2 * STATE
    # each row's entries over those positions, blocks of 32: one each; two at 40 (33 + 7 = 40 positions)
    assert got.block_tables == 2 * (1 + 1 + 1) * 4
    assert step_bytes(CONFIG, tp=1, batch=2, context=30, k=2).block_tables == 2 * (2 + 2 + 2) * 4
    assert step_bytes(CONFIG, tp=1, batch=2, context=10, k=2, draft_head="bf16").draft_head == 2 * 2 * 512 * 64


def test_under_tensor_parallelism_a_rank_counts_its_shards_and_replicated_kv_heads():
    mlp = 3 * 64 * 64 + 2 * 64
    attention = 2 * 4 * 16 * 64 + 2 * 2 * 16 * 64 + 64 * 4 * 16 + 2 * 16 + mlp
    gdn = 128 * 64 + 64 * 64 + 2 * 4 * 64 + 128 * 4 + 2 * 4 + 16 + 64 * 64 + mlp
    got = step_bytes(CONFIG, tp=2, batch=1, context=10, k=0)
    assert got.weights == 2 * (3 * gdn + attention + 64 + 256 * 64)
    assert got.kv_cache == 11 * 2 * 2 * 16 * 2
    assert got.recurrent_state == 2 * 3 * (4 * 16 * 16 * 4 + 128 * 3 * 2)
    assert step_bytes(CONFIG, tp=8, batch=1, context=10, k=0).kv_cache == 11 * 2 * 1 * 16 * 2  # one KV head a rank


def test_the_weights_with_the_embedding_table_and_the_mtp_module_are_the_checkpoint():
    """Cross-check with the checkpoint writer's parameter list, another account of the same shapes."""
    total = 2 * sum(math.prod(shape) for shape in parameter_shapes(tiny_config(), mtp=True).values())
    got = step_bytes(CONFIG, tp=1, batch=1, context=0, k=1)
    assert got.weights + 2 * 512 * 64 + got.mtp == total


def test_the_fp8_floor_reads_what_an_fp8_checkpoint_holds_fp8_weights_their_block_scales_and_the_16_bit_rest(
        tmp_path):
    """The FP8 floor against the bytes of a written FP8 checkpoint (bf16 where it keeps 16 bits)."""
    entries = write_random_checkpoint(tmp_path, tiny_config(), dtype=torch.bfloat16, fp8=True, keep=True)
    total = sum(t.nbytes for t in entries.values())
    assert any(t.dtype == torch.float8_e4m3fn for t in entries.values())
    got = step_bytes(CONFIG, tp=1, batch=1, context=0, k=1, fp8=True)
    assert got.weights + 2 * 512 * 64 + got.mtp == total
    assert got.weights < step_bytes(CONFIG, tp=1, batch=1, context=0, k=0).weights


MOE = Qwen3_5MoeConfig.from_dict(tiny_moe_config())  # 8 experts, top 3, expert width 32, shared 48
EXPERT = 3 * 32 * 64  # gate, up, down of one expert
MOE_FIXED = 8 * 64 + 64 + 3 * 48 * 64  # router, shared gate, shared expert: read whatever the routing
MOE_ATTENTION = ATTENTION - MLP  # the mixer and its norms: as in the dense model
MOE_GDN = GDN - MLP


def test_a_moe_layer_reads_its_fixed_part_and_only_the_experts_a_token_routes_to():
    got = step_bytes(MOE, tp=1, batch=1, context=10, k=0)
    # one token: exactly top-k = 3 experts in each of the 4 layers; the norms (2 a layer) as in MLP
    layer = MOE_FIXED + 3 * EXPERT + 2 * 64
    assert got.weights == 2 * (3 * (MOE_GDN + layer) + MOE_ATTENTION + layer + 64 + 512 * 64)


def test_under_expert_parallelism_a_rank_reads_the_share_of_its_whole_experts_that_is_hit():
    # TP 2 in 2 expert groups: a rank holds 4 whole experts, of which N tokens hit 4 · (1 − (5/8)^N) on average
    ep2 = split_config(MOE, 2, 2)
    one, four = (step_bytes(ep2, tp=2, batch=n, context=10, k=0).weights for n in (1, 4))
    hit = [4 * (1 - (5 / 8) ** n) for n in (1, 4)]
    assert abs((four - one) - 2 * 4 * (hit[1] - hit[0]) * EXPERT) < 2  # 4 layers, bf16; the rest is the same
    # at EP = 1 a rank holds half of each of the 8 experts: twice the experts, half the bytes, the same mean
    assert abs(step_bytes(split_config(MOE, 2, 1), tp=2, batch=4, context=10, k=0).weights - four) < 2


def test_many_tokens_read_nearly_every_expert_and_the_mtp_layer_counts_its_passes_tokens():
    every = step_bytes(MOE, tp=1, batch=512, context=10, k=0).weights
    layer = MOE_FIXED + 8 * EXPERT + 2 * 64
    assert abs(every - 2 * (3 * (MOE_GDN + layer) + MOE_ATTENTION + layer + 64 + 512 * 64)) < 1
    got = step_bytes(MOE, tp=1, batch=1, context=10, k=2)
    hit = [8 * (1 - (5 / 8) ** n) for n in (3, 1)]  # the prefix pass over 3 tokens, one chained pass of 1
    mtp_layer = [MOE_ATTENTION + MOE_FIXED + h * EXPERT + 2 * 64 for h in hit]
    assert got.mtp == round(2 * sum(2 * 64 * 64 + 3 * 64 + m for m in mtp_layer))


def test_the_fp8_floor_of_a_moe_model_counts_its_routed_experts_in_16_bits_as_the_loader_holds_them(tmp_path):
    """FP8 experts are dequantised at load (they are not Linear layers): the floor's expert bytes are
    those of the bf16 model, only the other projections are FP8."""
    write_random_checkpoint(tmp_path, tiny_moe_config(), dtype=torch.bfloat16, fp8=True, experts="per_expert")
    model = load_model(tmp_path, TPGroup(), torch.bfloat16, torch.device("cpu"), fp8_native=True, with_mtp=False)
    assert model.layers["0"].mlp.experts.gate_up_proj.dtype == torch.bfloat16
    assert model.layers["0"].mlp.shared_expert.down_proj.weight.dtype == torch.float8_e4m3fn

    def experts_read(fp8: bool) -> float:  # every expert hit less exactly the top 3: 5 experts a layer
        return (step_bytes(MOE, tp=1, batch=512, context=10, k=0, fp8=fp8).weights
                - step_bytes(MOE, tp=1, batch=1, context=10, k=0, fp8=fp8).weights)

    assert experts_read(fp8=True) == experts_read(fp8=False) == 2 * 4 * 5 * EXPERT
    assert step_bytes(MOE, tp=1, batch=1, context=10, k=0, fp8=True).weights < step_bytes(
        MOE, tp=1, batch=1, context=10, k=0).weights
