"""The Triton kernels of the CUDA path against the PyTorch reference they replace.

On a machine with a GPU the kernels run on it; elsewhere they run on the CPU through Triton's
interpreter (TRITON_INTERPRET=1), which checks the same code. float32 must agree to float32
rounding; bfloat16 within two bf16 ulps (the interpreter rounds float32 -> bfloat16 by truncation,
the GPU to nearest).
"""

from __future__ import annotations

import itertools
import json
import os
import subprocess
import sys

import pytest
import torch

GPU = torch.cuda.is_available()
if not GPU:
    os.environ.setdefault("TRITON_INTERPRET", "1")
triton = pytest.importorskip("triton", reason="Triton is not installed (it comes with CUDA builds of torch)")

from shardspec import kernels
from shardspec.kernels import gdn as kernel_gdn
from shardspec.kernels import norm as kernel_norm
from shardspec.layers import gdn as reference_gdn
from shardspec.layers.attention import exact_length_attention
from shardspec.layers.batch import Batch, CacheShape
from shardspec.layers.norm import GatedRMSNorm, RMSNorm
from shardspec.layers.parallel import TPGroup
from shardspec.models.qwen3_5 import Qwen3_5Config, Qwen3_5Model, mixer
from shardspec.protocol.messages import WorkerOptions
from shardspec.testing.random_checkpoint import tiny_config

DEVICE = torch.device("cuda" if GPU else "cpu")
# bf16 through the interpreter (which emulates it op by op) takes most of this file's time on a CPU:
# there it runs with the slow tests; on a GPU it runs always
DTYPES = [torch.float32, torch.bfloat16 if GPU else pytest.param(torch.bfloat16, marks=pytest.mark.slow)]


@pytest.fixture(autouse=True)
def interpreter_scalars(monkeypatch):
    """Triton 3.6's interpreter turns a loaded scalar into a Python int with int(array of shape
    (1,)), which numpy >= 2.4 refuses; loop bounds read from memory need it."""
    if GPU:
        return
    from triton.runtime import interpreter

    original = interpreter._patch_lang_tensor

    def patched(tensor, scope):
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    monkeypatch.setattr(interpreter, "_patch_lang_tensor", patched)



def assert_agree(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype, bf16_tol: float = 2**-6) -> None:
    tol = 2e-5 if dtype == torch.float32 else bf16_tol  # bf16: two ulps, relative
    torch.testing.assert_close(actual.cpu().float(), expected.cpu().float(), rtol=tol, atol=tol)


@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_with_and_without_the_residual_add_matches_the_reference(dtype):
    norm = RMSNorm(96, 1e-6)
    norm.weight.data.normal_(0, 0.2)
    norm = norm.to(dtype)
    x, residual = torch.randn(2, 5, 96, dtype=dtype), torch.randn(2, 5, 96, dtype=dtype)
    weight = norm.weight.to(DEVICE)
    assert_agree(kernel_norm.rms_norm(x.to(DEVICE), weight, 1e-6), norm(x), dtype)
    y, total = kernel_norm.rms_norm(x.to(DEVICE), weight, 1e-6, residual.to(DEVICE))
    expected_y, expected_total = norm(x, residual)
    assert_agree(y, expected_y, dtype)
    assert_agree(total, expected_total, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_gated_rms_norm_and_silu_mul_match_the_reference(dtype):
    torch.manual_seed(0)
    norm = GatedRMSNorm(32, 1e-6)
    norm.weight.data.normal_(1, 0.2)
    norm = norm.to(dtype)
    # z and the gate/up halves are slices of one merged projection's output, as in the layers
    x, projected = torch.randn(3, 2, 4, 32, dtype=dtype), torch.randn(3, 2, 4 * 32 + 8, dtype=dtype)
    z = projected[..., 8:].view(3, 2, 4, 32)
    # three roundings to bf16 (x̂, w·x̂, the gated product): each truncates in the interpreter, so up
    # to three ulps there (2.3 % at worst over 300 seeds); two on the GPU, which rounds to nearest
    assert_agree(kernel_norm.gated_rms_norm(x.to(DEVICE), projected.to(DEVICE)[..., 8:].view(3, 2, 4, 32),
                                            norm.weight.to(DEVICE), 1e-6), norm(x, z), dtype,
                 bf16_tol=2**-6 if GPU else 2**-5)
    gate_up = torch.randn(3, 2, 3000, dtype=dtype)
    gate, up = gate_up.split(1500, -1)
    assert_agree(kernel_norm.silu_mul(*gate_up.to(DEVICE).split(1500, -1)), torch.nn.functional.silu(gate) * up, dtype)


def gdn_inputs(dtype, T, DK=16, DV=32):
    torch.manual_seed(T)
    B, HK, HV, slots = 3, 2, 4, 5
    C = 2 * HK * DK + HV * DV
    return dict(
        x=torch.randn(B, T, C, dtype=dtype),
        conv_state=torch.randn(slots, C, 3, dtype=dtype),
        conv_weight=(torch.randn(C, 1, 4) * 0.3).to(dtype),
        a=torch.randn(B, T, HV, dtype=dtype),
        b=torch.randn(B, T, HV, dtype=dtype),
        A_log=torch.randn(HV) * 0.5,
        dt_bias=torch.randn(HV) * 0.5,
        state=torch.randn(slots, HV, DK, DV) * 0.1,
        slots=torch.tensor([3, 0, 2]),
        k_heads=HK,
        dk=DK,
    )


def on(device, tensors: dict) -> dict:
    return {k: v.to(device).clone() if isinstance(v, torch.Tensor) else v for k, v in tensors.items()}


def run_gdn(ops, t: dict, **flags):
    """Convolution then delta rule, as GatedDeltaNet runs them; returns (output, conv state, state)."""
    mixed = ops.causal_conv(t["x"], t["conv_state"], t["conv_weight"], t["slots"], write_state=flags["write"])
    out = ops.delta_rule(mixed, t["a"], t["b"], t["A_log"], t["dt_bias"], t["state"], t["slots"], t["k_heads"],
                         t["dk"], write_state=flags["write"])
    return out, mixed


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("T", "dims"), [(1, {}), (4, {}), (9, {}), (3, {"DK": 24, "DV": 40})],
                         ids=["T1", "T4", "T9", "T3-dk24-dv40"])
def test_gated_deltanet_kernels_match_the_reference_and_update_states_in_place(dtype, T, dims):
    """Also at key head dim 24 and value head dim 40 (padded to 32 and 64, masked), with a value
    tile (16) that does not divide 40."""
    inputs = gdn_inputs(dtype, T, **dims)
    ref, dev = on("cpu", inputs), on(DEVICE, inputs)
    out, _ = run_gdn(reference_gdn, ref, write=True)
    out_k, _ = run_gdn(kernel_gdn, dev, write=True)
    assert_agree(out_k, out, dtype)
    assert_agree(dev["conv_state"], ref["conv_state"], dtype)
    assert_agree(dev["state"], ref["state"], torch.float32 if dtype == torch.float32 else dtype)
    untouched = [1, 4]  # slots no row uses
    assert torch.equal(dev["state"][untouched].cpu(), inputs["state"][untouched])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("T", [2, 37])
def test_the_convolution_over_several_token_blocks_matches_the_reference(dtype, T):
    """A prefill chunk's convolution runs its tokens in parallel blocks: every block reads its own
    window, only the first reads the old state, and the new state is the chunk's last K-1 inputs
    (for T < K-1, old state and input together). x is a slice of a wider projection, as in the layer."""
    assert T < 3 or T > 2 * kernel_gdn.CONV_TOKENS
    inputs = gdn_inputs(dtype, T)
    C = inputs["x"].shape[-1]
    wide = torch.cat([inputs["x"], torch.randn(3, T, 40, dtype=dtype)], -1)
    ref, dev = on("cpu", inputs), on(DEVICE, inputs)
    ref["x"], dev["x"] = wide[..., :C], wide.to(DEVICE)[..., :C]
    expected = reference_gdn.causal_conv(ref["x"], ref["conv_state"], ref["conv_weight"], ref["slots"])
    actual = kernel_gdn.causal_conv(dev["x"], dev["conv_state"], dev["conv_weight"], dev["slots"])
    assert_agree(actual, expected, dtype)
    assert_agree(dev["conv_state"], ref["conv_state"], dtype)
    assert torch.equal(dev["conv_state"][[1, 4]].cpu(), inputs["conv_state"][[1, 4]])  # slots no row uses


def test_the_delta_rule_gives_the_same_result_at_every_tile_shape():
    """bench/gdn_tiles.py times other (block_v, warps) tiles: each must compute the same thing."""
    inputs = gdn_inputs(torch.float32, 4)
    mixed = reference_gdn.causal_conv(inputs["x"], None, inputs["conv_weight"], inputs["slots"]).contiguous()
    results = []
    for block_v, warps in [(16, 2), (32, 4)]:
        t = on(DEVICE, inputs)
        out = kernel_gdn.delta_rule(mixed.to(DEVICE), t["a"], t["b"], t["A_log"], t["dt_bias"], t["state"], t["slots"],
                                    t["k_heads"], t["dk"], block_v=block_v, num_warps=warps)
        results.append((out.cpu(), t["state"].cpu()))
    for actual, expected in zip(results[1], results[0]):
        assert_agree(actual, expected, torch.float32)


def reference_of_row(inputs: dict, row: int, n: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The reference over row `row`'s first n tokens alone: its output [1, n, HV, DV], and the conv
    state and recurrent state it leaves in the row's slot."""
    ref = on("cpu", inputs)
    ref["slots"] = inputs["slots"][row : row + 1]
    for key in ("x", "a", "b"):
        ref[key] = inputs[key][row : row + 1, :n]
    expected, _ = run_gdn(reference_gdn, ref, write=True)
    slot = int(inputs["slots"][row])
    return expected, ref["conv_state"][slot], ref["state"][slot]


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_speculative_pass_leaves_states_alone_and_its_replay_commits_the_accepted_prefix(dtype):
    inputs = gdn_inputs(dtype, 4)
    lengths = torch.tensor([1, 4, 2])  # accepted tokens + 1 per row
    dev = on(DEVICE, inputs)
    _, mixed = run_gdn(kernel_gdn, dev, write=False)
    assert torch.equal(dev["conv_state"].cpu(), inputs["conv_state"])
    assert torch.equal(dev["state"].cpu(), inputs["state"])
    kernel_gdn.causal_conv(dev["x"], dev["conv_state"], dev["conv_weight"], dev["slots"], write_out=False,
                           lengths=lengths.to(DEVICE))
    kernel_gdn.delta_rule(mixed, dev["a"], dev["b"], dev["A_log"], dev["dt_bias"], dev["state"], dev["slots"],
                          dev["k_heads"], dev["dk"], write_out=False, lengths=lengths.to(DEVICE))
    for row, n in enumerate(lengths.tolist()):  # the states after the row's first n tokens, token by token
        _, conv_state, state = reference_of_row(inputs, row, n)
        slot = int(inputs["slots"][row])
        assert_agree(dev["conv_state"][slot], conv_state, dtype)
        assert_agree(dev["state"][slot], state, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_padded_prefill_outputs_and_keeps_the_states_of_each_rows_own_tokens(dtype):
    """A prefill padded past its tokens (Batch.lengths, tails.TailPasses): the convolution and the delta
    rule give each row's first n outputs and leave its slot's states after token n - 1, as the reference
    does over those n tokens alone; the delta rule's outputs past them are zeros."""
    T = 20  # two of the convolution's token blocks
    inputs = gdn_inputs(dtype, T)
    lengths = torch.tensor([1, 20, 13])
    dev = on(DEVICE, inputs)
    mixed = kernel_gdn.causal_conv(dev["x"], dev["conv_state"], dev["conv_weight"], dev["slots"],
                                   lengths=lengths.to(DEVICE))
    out = kernel_gdn.delta_rule(mixed, dev["a"], dev["b"], dev["A_log"], dev["dt_bias"], dev["state"], dev["slots"],
                                dev["k_heads"], dev["dk"], lengths=lengths.to(DEVICE))
    for row, n in enumerate(lengths.tolist()):
        expected, conv_state, state = reference_of_row(inputs, row, n)
        slot = int(inputs["slots"][row])
        assert_agree(out[row, :n], expected[0], dtype)
        assert not out[row, n:].any()
        assert_agree(dev["conv_state"][slot], conv_state, dtype)
        assert_agree(dev["state"][slot], state, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_padded_prefill_saves_the_states_after_each_rows_first_tokens_to_the_rows_it_names(dtype):
    """A prefix cache's save within a padded prefill (Batch.state_saves): the convolution and the delta
    rule, kernels and reference, also write the states after row b's first save_at[b] tokens to row
    rows[b], as the reference leaves them after those tokens alone; the outputs and the slots' states
    are the pass's without the save."""
    T = 20
    inputs = gdn_inputs(dtype, T)
    for key in ("conv_state", "state"):  # three rows more, for the saves
        inputs[key] = torch.cat([inputs[key], torch.randn_like(inputs[key][:3])])
    lengths, save_at, rows = torch.tensor([1, 20, 13]), torch.tensor([1, 17, 2]), torch.tensor([5, 6, 7])
    results = {}
    for ops, device in ((kernel_gdn, DEVICE), (reference_gdn, "cpu")):
        for saving in (False, True):
            t = on(device, inputs)
            saves = (save_at.to(device), rows.to(device)) if saving else None
            mixed = ops.causal_conv(t["x"], t["conv_state"], t["conv_weight"], t["slots"], lengths=lengths.to(device),
                                    saves=saves)
            out = ops.delta_rule(mixed, t["a"], t["b"], t["A_log"], t["dt_bias"], t["state"], t["slots"], t["k_heads"],
                                 t["dk"], lengths=lengths.to(device), saves=saves)
            results[ops, saving] = (out.cpu(), t["conv_state"].cpu(), t["state"].cpu())
    for row, (n, r) in enumerate(zip(save_at.tolist(), rows.tolist())):
        _, expected_conv, expected_state = reference_of_row(inputs, row, n)
        for ops in (kernel_gdn, reference_gdn):
            _, conv_state, state = results[ops, True]
            assert_agree(conv_state[r], expected_conv, dtype)
            assert_agree(state[r], expected_state, dtype)
    for ops in (kernel_gdn, reference_gdn):
        (out, conv_state, state), (plain_out, plain_conv, plain_state) = results[ops, True], results[ops, False]
        assert torch.equal(out, plain_out)
        assert torch.equal(conv_state[:5], plain_conv[:5]) and torch.equal(state[:5], plain_state[:5])


def attention_pass_with_and_without_kernels(monkeypatch, dtype, head_dim: int, blocks: int, positions: torch.Tensor,
                                           kv_len: int, lengths: torch.Tensor | None = None):
    """A full-attention layer's pass over two rows at `positions` after a 37-token prefill of each (never
    the kernels), with the reference ops on the CPU and with the kernels: for each, (output, K cache, V
    cache). Each slot's `blocks` blocks of 32 positions lie scattered over the pool, in no order."""
    config = Qwen3_5Config.from_dict(tiny_config(head_dim=head_dim))
    torch.manual_seed(0)
    layer = mixer(config, "full_attention", TPGroup(), None, "model.layers.0")
    for p in layer.parameters():
        p.data.normal_(0, 0.3)
    layer = layer.to(dtype)
    slots = torch.tensor([2, 0])
    prompt = torch.randn(2, 37, config.hidden_size, dtype=dtype)
    step = torch.randn(2, positions.shape[1], config.hidden_size, dtype=dtype)
    outputs = []
    for use_kernels, device in ((False, "cpu"), (True, DEVICE)):
        monkeypatch.setattr(kernels, "enabled", lambda x, on=use_kernels: on)
        tables = torch.randperm(3 * blocks, generator=torch.Generator().manual_seed(1)).view(3, blocks).int().to(device)
        layer.to(device).allocate(CacheShape(3, 3 * blocks, tables), dtype, torch.device(device))
        s = slots.to(device)
        layer(prompt.to(device), Batch(s, torch.arange(37, device=device).expand(2, -1), 37))
        out = layer(step.to(device), Batch(s, positions.to(device), kv_len,
                                           lengths=None if lengths is None else lengths.to(device)))
        outputs.append((out, layer.k_cache.clone(), layer.v_cache.clone()))
    return outputs


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_long_padded_pass_attends_through_the_token_tiled_kernel_as_the_reference(dtype, monkeypatch):
    """A padded prefill of 40 tokens a row (Batch.lengths: the kernels, past KERNEL_MAX_TOKENS) takes the
    kernel that reads each key tile once for a block of tokens (kernels.attention, TILE_MIN_TOKENS), its
    second block part empty: outputs and the cache as the reference's, rows at different positions."""
    if dtype == torch.bfloat16 and not GPU:  # (as in the test below, at the positions of 40 tokens)
        pytest.skip("the interpreter's truncation to bf16 is an ulp of the rotation's larger term off")
    positions = torch.stack([torch.arange(37, 77), torch.arange(30, 70)])
    (out, k_cache, v_cache), (out_k, k_cache_k, v_cache_k) = attention_pass_with_and_without_kernels(
        monkeypatch, dtype, 16, 3, positions, 77, lengths=torch.tensor([40, 25]))
    assert_agree(out_k, out, dtype, bf16_tol=0.05)
    assert_agree(k_cache_k, k_cache, dtype)
    assert_agree(v_cache_k, v_cache, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim", [16, 48])  # 48: padded to 64 in the kernels, masked
def test_attention_kernels_match_the_reference_and_fill_the_cache(dtype, head_dim, monkeypatch):
    if head_dim == 48 and dtype == torch.bfloat16 and not GPU:  # the rotation sums two bf16-rounded terms:
        pytest.skip("the interpreter's truncation to bf16 is an ulp of the larger term off, beyond two of the sum")
    positions = torch.tensor([[37, 38, 39], [30, 31, 32]])  # row 1 overwrites its tail
    (out, k_cache, v_cache), (out_k, k_cache_k, v_cache_k) = attention_pass_with_and_without_kernels(
        monkeypatch, dtype, head_dim, 2, positions, 40)
    # the output projection sums 8 · head_dim bf16-rounded products, so a few ulps before it show up
    # larger: 0.05 at 128 products, growing as the square root of their count
    assert_agree(out_k, out, dtype, bf16_tol=0.05 * (head_dim / 16) ** 0.5)
    assert_agree(k_cache_k, k_cache, dtype)
    assert_agree(v_cache_k, v_cache, dtype)


def scattered_block_tables(lengths: list[int], block_tokens: int, seed: int = 0) -> tuple[torch.Tensor, int]:
    """Block tables [B, max_blocks + 1] int32 whose rows hold blocks drawn from a shuffled pool: no two
    rows share one, no row's are in order (the first shuffle from `seed` on that gives that); past a
    row's last block every entry names block 0 (scratch). Returns the tables and the pool's size (two
    blocks of it held by no row)."""
    needed = [-(-n // block_tokens) for n in lengths]
    for attempt in itertools.count(seed):
        order = torch.randperm(sum(needed) + 2, generator=torch.Generator().manual_seed(attempt)) + 1
        tables = torch.zeros(len(lengths), max(needed) + 1, dtype=torch.int32)
        for b, (n, start) in enumerate(zip(needed, itertools.accumulate(needed, initial=0))):
            tables[b, :n] = order[start : start + n]
        if all((row[1:n] < row[: n - 1]).any() for row, n in zip(tables, needed) if n > 1):
            return tables, len(order) + 1


def paged_write_reference(layer, qg, k, v, positions, tables, k_cache, v_cache) -> torch.Tensor:
    """The layer's q/k norms and rotation: writes the pass's keys and values into k_cache, v_cache at
    (tables[b, p // block_tokens], p % block_tokens) and returns the rotated q [B, T, HQ, D]."""
    B, T, _ = qg.shape
    D, block_tokens = layer.head_dim, k_cache.shape[1]
    blocks, offsets = tables.long().gather(1, positions // block_tokens), positions % block_tokens
    k_cache[blocks, offsets] = layer.rotary(layer.k_norm(k.view(B, T, layer.kv_heads, D)), positions)
    v_cache[blocks, offsets] = v.view(B, T, layer.kv_heads, D)
    return layer.rotary(layer.q_norm(qg.view(B, T, layer.heads, 2 * D)[..., :D]), positions)


def paged_attention_reference(q, qg, k_cache, v_cache, positions, tables) -> torch.Tensor:
    """Each query against its row's keys 0 .. its position, gathered through the row's table, times
    sigmoid(gate) -> [B, T, HQ*D]."""
    B, T, _, D = q.shape
    block_tokens = k_cache.shape[1]
    keys = torch.arange(int(positions.max()) + 1)
    rows = tables.long()[:, keys // block_tokens], keys % block_tokens  # [B, L]: each row's keys in order
    out = exact_length_attention(q, k_cache[rows], v_cache[rows], positions)
    gate = qg.view(B, T, -1, 2 * D)[..., D:].reshape(B, T, -1)
    return out.transpose(1, 2).reshape(B, T, -1) * torch.sigmoid(gate)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("block_tokens", [16, 64])  # 16: a 32-key tile spans two blocks; 64: a block two tiles
@pytest.mark.parametrize("T", [1, 4, 20])  # decode, verify, a padded prefill (the token-tiled kernel)
@pytest.mark.parametrize("splits", [1, 3])  # the keys in one range, or three (their sums added by a second kernel)
def test_attention_kernels_read_and_write_only_the_blocks_their_tables_name(dtype, block_tokens, T, splits):
    if T > 4 and dtype == torch.bfloat16 and not GPU:  # (q and k at 20 positions: see the test above)
        pytest.skip("the interpreter's truncation to bf16 is an ulp of the rotation's larger term off")
    config = Qwen3_5Config.from_dict(tiny_config(head_dim=16))
    torch.manual_seed(0)
    layer = mixer(config, "full_attention", TPGroup(), None, "attention")
    for p in layer.parameters():
        p.data.normal_(0, 0.3)
    layer = layer.to(dtype)
    B, D, HKV, bt = 4, layer.head_dim, layer.kv_heads, block_tokens
    # the last key ends a block, opens one, mid-block, early (in the first block at T <= 5: a split or two empty)
    lengths = [2 * bt, 2 * bt + 1, bt + bt // 2 + 3, max(5, T + 2)]
    tables, num_blocks = scattered_block_tables(lengths, bt)
    positions = torch.stack([torch.arange(n - T, n) for n in lengths])
    k_cache = torch.full((num_blocks, bt, HKV, D), float("nan"), dtype=dtype)  # NaN: any read past a position shows
    v_cache = k_cache.clone()
    for b, n in enumerate(lengths):  # the keys of earlier passes
        earlier = torch.arange(n - T)
        k_cache[tables[b, earlier // bt].long(), earlier % bt] = torch.randn(n - T, HKV, D, dtype=dtype)
        v_cache[tables[b, earlier // bt].long(), earlier % bt] = torch.randn(n - T, HKV, D, dtype=dtype)
    qg = torch.randn(B, T, layer.heads * 2 * D, dtype=dtype)
    k, v = torch.randn(B, T, HKV * D, dtype=dtype), torch.randn(B, T, HKV * D, dtype=dtype)
    k_expected, v_expected = k_cache.clone(), v_cache.clone()
    q_expected = paged_write_reference(layer, qg, k, v, positions, tables, k_expected, v_expected)

    layer.to(DEVICE)
    qg_d, k_d, v_d, positions_d, tables_d, k_cache_d, v_cache_d = (
        x.to(DEVICE) for x in (qg, k, v, positions, tables, k_cache, v_cache)
    )
    q = kernels.attention.qk_norm_rope(
        qg_d, k_d, v_d, layer.q_norm.weight, layer.k_norm.weight, layer.rotary.inv_freq(DEVICE), positions_d,
        tables_d, k_cache_d, v_cache_d, layer.q_norm.eps,
    )
    out = kernels.attention.cached_attention(q, qg_d, k_cache_d, v_cache_d, positions_d, tables_d, splits=splits)

    assert_agree(q, q_expected, dtype)
    written = torch.zeros(num_blocks, bt, dtype=torch.bool)
    written[tables.long().gather(1, positions // bt), positions % bt] = True
    assert written.sum() == B * T
    k_cache_d, v_cache_d = k_cache_d.cpu(), v_cache_d.cpu()
    for actual, want, before in ((k_cache_d, k_expected, k_cache), (v_cache_d, v_expected, v_cache)):
        assert_agree(actual[written], want[written], dtype)
        torch.testing.assert_close(actual[~written], before[~written], rtol=0, atol=0, equal_nan=True)
    # against the q and cache the first kernel made, so that each kernel answers for its own bf16 rounding
    assert_agree(out, paged_attention_reference(q.cpu(), qg, k_cache_d, v_cache_d, positions, tables), dtype)


@pytest.mark.skipif(not GPU or kernel_gdn.chunk_gated_delta_rule is None, reason="needs a GPU and fla-core")
def test_prefill_through_fla_matches_the_float32_reference():
    inputs = gdn_inputs(torch.bfloat16, kernel_gdn.FLA_MIN_TOKENS * 3)
    ref = {k: v.float() if isinstance(v, torch.Tensor) and v.is_floating_point() else v for k, v in inputs.items()}
    ref = on("cpu", ref)
    dev = on(DEVICE, inputs)
    out, _ = run_gdn(reference_gdn, ref, write=True)
    out_k, _ = run_gdn(kernel_gdn, dev, write=True)
    torch.testing.assert_close(out_k.float().cpu(), out, rtol=0.05, atol=0.05)
    torch.testing.assert_close(dev["state"].cpu(), ref["state"], rtol=0.05, atol=0.05)


@pytest.mark.parametrize("fp8", [False, True])
@pytest.mark.parametrize("M", [1, 5])
def test_the_draft_head_argmax_matches_the_logits_argmax(fp8, M):
    """The drafts' LM head (no logits written): the argmax and max of x @ W^T (W bf16, or fp8 with
    a scale per row) as the dequantized matmul gives them; rows past `valid` (vocabulary padding)
    never win, and a tie goes to the lowest index."""
    from shardspec.kernels import head

    torch.manual_seed(M)
    N, K, valid = 300, 160, 290  # several blocks of rows, a partial one, and K not a block multiple
    weight = torch.randn(N, K, dtype=torch.bfloat16)
    weight[valid:] = 10.0  # padding rows that would win every argmax
    weight[77] = weight[211]  # a tie between two blocks: the argmax of rows that pick 211 must be 77
    x = torch.randn(M, K, dtype=torch.bfloat16)
    x[0] = weight[211] * 2  # row 0's maximum is the tie
    w, scale = head.quantize_rows(weight) if fp8 else (weight, None)
    dense = w.float() * (scale[:, None] if fp8 else 1.0)
    logits = x.float() @ dense.T
    logits[:, valid:] = float("-inf")
    value, index = head.argmax(x.to(DEVICE), w.to(DEVICE), scale.to(DEVICE) if fp8 else None, valid)
    assert index.cpu().tolist() == logits.argmax(-1).tolist()
    assert index[0].item() == 77
    torch.testing.assert_close(value.cpu(), logits.max(-1).values, rtol=1e-4, atol=1e-4)


def test_the_fp8_head_keeps_each_row_within_fp8_rounding():
    from shardspec.kernels import head

    weight = torch.randn(64, 96) * torch.logspace(-3, 1, 64)[:, None]  # rows of very different sizes
    w8, scale = head.quantize_rows(weight)
    assert w8.dtype == torch.float8_e4m3fn and scale.shape == (64,)
    error = (w8.float() * scale[:, None] - weight).abs().amax(1) / weight.abs().amax(1)
    assert error.max() <= 2**-4  # e4m3: 3 mantissa bits, half an ulp relative


@pytest.mark.parametrize("mode", ["bf16", "fp8"])
def test_the_lm_head_drafts_through_the_head_kernel(mode, monkeypatch):
    """ParallelLMHead.draft_argmax with the kernel chosen: the argmax of each row of [B, T, H]
    hidden states over the weight the mode reads; "cublas" goes back to the logits' argmax."""
    from shardspec.layers.embedding import ParallelLMHead

    torch.manual_seed(0)
    lm_head = ParallelLMHead(300, 160, TPGroup()).to(torch.bfloat16)
    lm_head.weight.data.normal_()
    lm_head = lm_head.to(DEVICE)
    hidden = torch.randn(2, 3, 160, dtype=torch.bfloat16).to(DEVICE)
    monkeypatch.setattr(kernels, "enabled", lambda x: True)  # (on the CPU: the kernel interpreted)
    lm_head.use_draft_kernel(mode)
    assert lm_head.draft_weight.dtype == (torch.float8_e4m3fn if mode == "fp8" else torch.bfloat16)
    dense = lm_head.draft_weight.float() * (lm_head.draft_scale[:, None] if mode == "fp8" else 1.0)
    assert lm_head.draft_argmax(hidden).tolist() == (hidden.float() @ dense.T).argmax(-1).tolist()
    lm_head.use_draft_kernel("cublas")
    assert lm_head.draft_weight is None and torch.equal(lm_head.draft_argmax(hidden), lm_head.argmax(hidden))
    assert [name for name, _ in lm_head.named_parameters()] == ["weight"]


def test_the_draft_head_mode_falls_back_where_the_kernel_cannot_run(monkeypatch):
    """fp8 needs CUDA with compute capability 8.9 or later and a bf16/fp16 model; cublas is taken
    as asked everywhere (a bad draft head never gets this far: WorkerOptions refuses it)."""
    from shardspec.shard_worker import runner

    with torch.device("meta"):
        model = Qwen3_5Model(Qwen3_5Config.from_dict(tiny_config()), TPGroup(), with_mtp=True)
    cpu = torch.device("cpu")
    assert runner.draft_head_mode("fp8", model, torch.bfloat16, cpu) == "cublas"  # no CUDA tensors here
    monkeypatch.setattr(kernels, "enabled", lambda x: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    assert runner.draft_head_mode("fp8", model, torch.bfloat16, cpu) == "bf16"  # an A100: no fp8 loads
    assert runner.draft_head_mode("fp8", model, torch.float32, cpu) == "cublas"
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    assert runner.draft_head_mode("fp8", model, torch.bfloat16, cpu) == "fp8"
    assert runner.draft_head_mode("cublas", model, torch.bfloat16, cpu) == "cublas"

SM90_PTX = """
import importlib, json, sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
kernel = getattr(importlib.import_module(sys.argv[1]), sys.argv[2])
types, constants, other = json.loads(sys.argv[3]), json.loads(sys.argv[4]), sys.argv[5]
signature = {a: "constexpr" if a in constants else types.get(a, other) for a in kernel.arg_names}
source = ASTSource(fn=kernel, signature=signature, constexprs=constants)
print(triton.compile(source, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4}).asm["ptx"])
"""


def sm90_ptx(module: str, kernel: str, types: dict[str, str], constants: dict, other: str) -> list[str]:
    """The stripped PTX lines of a Triton kernel compiled for sm_90 (no GPU needed), in a process of
    its own without TRITON_INTERPRET (the interpreter compiles nothing); `other`: the type of every
    argument neither `types` nor `constants` names."""
    env = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    argv = [module, kernel, json.dumps(types), json.dumps(constants), other]
    done = subprocess.run([sys.executable, "-c", SM90_PTX, *argv], env=env, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    return [line.strip() for line in done.stdout.splitlines()]


def test_the_fused_all_reduce_swaps_each_flag_from_one_thread_and_shares_the_result():
    """The fused all-reduce's protocol needs each program's flag compare-and-swaps to run once (if
    every thread ran them, all but one would spin on a flag already swapped). Triton runs a scalar
    atomic in one thread and broadcasts its result through shared memory; this checks that in the
    kernel's compiled code for an H100/H200 (sm_90), with no GPU needed (in a process of its own:
    this module may run the kernels through the interpreter, which compiles nothing)."""
    lines = sm90_ptx("shardspec.kernels.norm", "_all_reduce_rms_norm_kernel",
                     {"D": "i32", "eps": "fp32", "stride_x": "i32", "stride_r": "i32", "SLOT_ROWS": "i32",
                      "buffers": "*i64", "pads": "*i64", "epochs": "*i64"},
                     {"RANK": 0, "WORLD": 2, "HAS_RES": True, "BLOCK": 4096}, other="*bf16")
    swaps = [i for i, line in enumerate(lines) if ".sys.cas." in line]
    assert [("release" in lines[i], "acquire" in lines[i]) for i in swaps] == [(True, False), (False, True)]
    for i in swaps:
        assert lines[i].startswith("@%p"), lines[i]  # predicated: not every thread
        shared = next(line for line in lines[i + 1 :] if "st.shared" in line or "bar.sync" in line)
        assert shared.startswith("@%p") and "st.shared" in shared, shared  # the result, to shared memory


# --- FP8 GEMMs (block-wise e4m3 weights, 128 × 128 scales) -------------------------------------------

def _fp8_operands(M: int, N: int, K: int, dtype: torch.dtype, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(M, K, generator=gen).to(dtype)
    weight = (torch.randn(N, K, generator=gen) * 3).clamp(-448, 448).to(torch.float8_e4m3fn)
    scale = torch.rand(-(-N // 128), -(-K // 128), generator=gen) * 0.01 + 0.001
    return x, weight, scale


def _dequantised(weight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    from fp8_reference import per_column

    return weight.float() * per_column(scale, weight.shape[1]).repeat_interleave(128, 0)[: weight.shape[0]]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("M", "N", "K"), [(1, 256, 512), (7, 200, 320), (20, 128, 1024)])  # ragged: 200 × 320
@pytest.mark.parametrize("split", [1, 3, 8])  # 8 > the K blocks of 320 and 512: splits with nothing to add
def test_the_fp8_weight_only_gemm_matches_the_dequantised_weight_at_every_split(dtype, M, N, K, split):
    from shardspec.kernels import fp8

    x, weight, scale = _fp8_operands(M, N, K, dtype)
    launch = fp8.Plan(block_m=16 if M <= 16 else 32, block_n=64, split=split)
    got = fp8.decode(x.to(DEVICE), weight.to(DEVICE), scale.to(DEVICE), launch=launch)
    assert got.dtype == dtype
    assert_agree(got, x.float() @ _dequantised(weight, scale).T, dtype)


@pytest.mark.parametrize(("M", "N", "K"), [(1, 256, 512), (7, 200, 320), (20, 128, 1024)])
@pytest.mark.parametrize("split", [1, 3, 8])
def test_the_fp8_w8a8_decode_gemm_equals_the_fp32_product_of_its_quantised_operands_at_every_split(M, N, K, split):
    """The decode path in W8A8 mode (quantize_groups, then e4m3 × e4m3) against (q · scale) @ (W8 · scale)^T
    in fp32, q and its scales as PyTorch rounds them: to fp32 rounding through the interpreter,
    within 2^-9 of the sum of |terms| on the GPU (as the prefill's W8A8 kernel)."""
    from fp8_reference import per_column, quantised_groups

    from shardspec.kernels import fp8

    x, weight, scale = _fp8_operands(M, N, K, torch.bfloat16, seed=5)
    x[0, :4] = torch.tensor([0.0, -1e-6, 2.0**-12, 448.0])  # zero, subnormals, the max
    launch = fp8.Plan(block_m=16 if M <= 16 else 32, block_n=64, split=split, quantize=True)
    got = fp8.decode(x.to(DEVICE), weight.to(DEVICE), scale.to(DEVICE), launch=launch).float().cpu()
    q, x_scale = quantised_groups(x)
    rows, w = q.float() * per_column(x_scale, K), _dequantised(weight, scale)
    expected, terms = rows @ w.T, rows.abs() @ w.abs().T
    bf16_rounding = 2**-7 * expected.abs()  # the output's own rounding to bf16 (the interpreter truncates)
    assert ((got - expected).abs() <= (2**-9 if GPU else 1e-6) * terms + bf16_rounding + 1e-30).all()


@pytest.mark.parametrize("quantize", [False, True])
def test_the_fp8_decode_gemm_is_batch_invariant_and_deterministic(quantize):
    """Invariant mode: a row's result is bit for bit the same alone and in a batch, and again."""
    from shardspec.kernels import fp8

    x, weight, scale = (t.to(DEVICE) for t in _fp8_operands(21, 256, 1024, torch.bfloat16, seed=1))
    batch = fp8.decode(x, weight, scale, invariant=True, quantize=quantize)
    assert fp8.plan(21, 256, 1024, 132, invariant=True) == fp8.plan(1, 256, 1024, 132, invariant=True)
    for row in (0, 20):
        assert torch.equal(fp8.decode(x[row : row + 1], weight, scale, invariant=True, quantize=quantize)[0],
                           batch[row])
    assert torch.equal(fp8.decode(x, weight, scale, invariant=True, quantize=quantize), batch)


def test_the_weight_only_plan_fills_the_sms_with_k_splits_that_never_depend_on_the_rows():
    from shardspec.kernels import fp8

    down, gate_up = fp8.plan(1, 4096, 12288, 132), fp8.plan(1, 24576, 4096, 132)
    assert 64 * down.split >= 4 * 132 and down.split <= 16 and 96 // down.split >= 4
    assert gate_up.split * 384 >= 4 * 132
    assert {fp8.plan(M, 4096, 12288, 132).split for M in (1, 8, 33, 64)} == {down.split}
    assert fp8.plan(64, 4096, 12288, 132).block_m == 64 and fp8.plan(3, 4096, 12288, 132).block_m == 16


def test_the_w8a8_plan_splits_k_only_to_two_programs_an_sm_and_never_by_the_rows():
    from shardspec.kernels import fp8

    assert {fp8.plan(M, 4096, 12288, 132, invariant=True, quantize=True) for M in (1, 8, 33, 64)} == \
        {fp8.plan(1, 4096, 12288, 132, invariant=True, quantize=True)}  # batch-invariant: one plan

    down, gate_up = fp8.plan(1, 4096, 12288, 132, quantize=True), fp8.plan(1, 24576, 4096, 132, quantize=True)
    assert 64 * down.split >= 2 * 132 > 64 * down.split // 2 and 96 // down.split >= 8
    assert gate_up.split == 1 and gate_up.quantize  # 384 strips: already ~3 an SM
    assert {fp8.plan(M, 4096, 12288, 132, quantize=True).split for M in (1, 8, 33, 64)} == {down.split}
    assert (gate_up.stages, down.stages) == (4, 3)  # 32 and 12 blocks a program


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("M", "N", "K"), [(1, 256, 512), (7, 200, 320), (20, 128, 1024)])  # ragged: 200 × 320
@pytest.mark.parametrize(("split", "block_k"), [(1, 128), (3, 64), (8, 128)])  # 8: splits with nothing to add
def test_the_decode_gemv_equals_the_matmul_at_every_split(dtype, M, N, K, split, block_k):
    from shardspec.kernels import gemv

    gen = torch.Generator().manual_seed(M * N + split)
    x, weight = torch.randn(M, K, generator=gen).to(dtype), torch.randn(N, K, generator=gen).to(dtype)
    launch = gemv.Plan(block_m=16 if M <= 16 else 32, block_n=64, split=split, block_k=block_k)
    y = gemv.launch(x.to(DEVICE), weight.to(DEVICE), launch)
    assert y.dtype == dtype
    got = y.float().cpu()
    expected, terms = x.float() @ weight.float().T, x.float().abs() @ weight.float().abs().T
    output_rounding = 0 if dtype == torch.float32 else 2**-7 * expected.abs()  # (the interpreter truncates)
    assert ((got - expected).abs() <= 2**-18 * terms + output_rounding).all()  # fp32 sums of exact products


def test_the_decode_gemv_plan_gives_every_sm_a_program_with_k_splits_that_never_depend_on_the_rows():
    from shardspec.kernels import gemv

    down, out_proj = gemv.plan(1, 4096, 12288, 132), gemv.plan(1, 4096, 4096, 132)
    gate_up = gemv.plan(1, 24576, 4096, 132)
    assert (down.split, out_proj.split, gate_up.split) == (4, 4, 1)  # 64 strips ⨉ 4 ≥ 132 SMs; 384 strips
    assert (down.stages, gemv.plan(1, 10240, 4096, 132).stages, gate_up.stages) == (3, 4, 3)  # 1.9, 1.2, 2.9 an SM
    assert {gemv.plan(M, 4096, 12288, 132).split for M in (1, 8, 16)} == {down.split}
    assert gemv.plan(1, 64, 256, 132).split == 1  # two K tiles: no split leaves each four


def test_only_a_decodes_few_bf16_rows_on_cuda_take_the_decode_gemv(monkeypatch):
    from shardspec.kernels import gemv

    monkeypatch.setattr(kernels, "settings", WorkerOptions())  # the default: bf16_gemv on
    weight = torch.empty(8, 64, dtype=torch.bfloat16)
    cuda_like = type("CudaTensor", (), {})  # takes() reads only these attributes of x
    for rows, dtype, expected in [(1, torch.bfloat16, True), (gemv.ROWS, torch.float16, False),
                                  (gemv.ROWS, torch.bfloat16, True), (gemv.ROWS + 1, torch.bfloat16, False),
                                  (1, torch.float32, False)]:
        x = cuda_like()
        x.is_cuda, x.dtype, x.shape = True, dtype, (rows, 64)
        x.numel = lambda rows=rows: rows * 64
        assert gemv.takes(x, weight) == expected, (rows, dtype)
    assert not gemv.takes(torch.empty(1, 64, dtype=torch.bfloat16), weight)  # a CPU tensor
    x = cuda_like()
    x.is_cuda, x.dtype, x.shape, x.numel = True, torch.bfloat16, (0, 64), lambda: 0
    assert not gemv.takes(x, weight)  # no rows
    x.shape, x.numel = (1, 8), lambda: 8
    assert not gemv.takes(x, torch.empty(64, 8, dtype=torch.bfloat16).t())  # a transposed weight
    x.shape, x.numel = (1, 64), lambda: 64
    assert gemv.takes(x, weight)
    monkeypatch.setattr(kernels, "settings", WorkerOptions(bf16_gemv=False))
    assert not gemv.takes(x, weight)  # the option off: cuBLAS


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("M", "K", "rows"), [(3, 512, 3), (5, 320, 16)])  # 16: padded with zero rows
def test_the_fp8_activation_quantiser_rounds_each_group_to_the_nearest_e4m3_at_max_over_448(dtype, M, K, rows):
    """Bit for bit the PyTorch rounding: scale = max |x| / 448 per token and 128 columns, q = the
    e4m3 nearest x / scale (ties to even); rows past M hold zeros."""
    from fp8_reference import quantised_groups

    from shardspec.kernels import fp8

    x = torch.randn(M, K, generator=torch.Generator().manual_seed(3)).to(dtype) * 3
    x[0, :7] = torch.tensor([0.0, 1e-6, -1e-6, 2.0**-12, 448.0, 300.0, -0.01])  # zero, subnormals, the max
    q, scale = fp8.quantize_groups(x.to(DEVICE), rows=rows)
    expected_q, expected_scale = quantised_groups(x)
    assert torch.equal(q[:M].cpu().view(torch.uint8), expected_q.view(torch.uint8))
    assert torch.equal(scale[:M].cpu(), expected_scale)
    assert not q[M:].float().any()


@pytest.mark.parametrize("dtype", DTYPES)
def test_the_fp8_quantiser_of_silu_gate_times_up_equals_silu_mul_then_the_quantiser(dtype):
    """The MLP's down projection quantises silu(gate) · up in the one launch: the same e4m3 bits and
    scales as kernels.norm.silu_mul and then the quantiser, from gate and up as the merged
    projection's halves (strided views), ragged groups (K = 320) and padding rows."""
    from shardspec.kernels import fp8

    M, K = 5, 320
    merged = (torch.randn(M, 2 * K, generator=torch.Generator().manual_seed(5)) * 3).to(dtype).to(DEVICE)
    gate, up = merged[:, :K], merged[:, K:]
    q, scale = fp8.quantize_groups(gate, rows=16, up=up)
    expected_q, expected_scale = fp8.quantize_groups(kernel_norm.silu_mul(gate, up), rows=16)
    assert torch.equal(q.view(torch.uint8), expected_q.view(torch.uint8))
    assert torch.equal(scale, expected_scale)


def test_an_fp8_mlp_multiplies_silu_gate_times_up_inside_its_down_projection(monkeypatch):
    """With the kernels on, an MLP whose down projection is FP8 hands it gate and up (no SiLU·up
    launch) and gets the bits of down(silu_mul(gate, up)): W8A8 (the quantiser takes the SiLU·up)
    and weight-only (the SiLU·up its own kernel first)."""
    from shardspec.layers.mlp import MLP
    from shardspec.layers.quantization import QuantConfig

    torch.manual_seed(0)
    fp8_down = QuantConfig({"mlp.down_proj.weight": (256, 128)})
    mlp = MLP(256, 128, TPGroup(), fp8_down, "mlp").to(torch.bfloat16)  # (the FP8 weights set below)
    assert mlp.down_proj.method.fuses_silu
    mlp.gate_up_proj.weight.data.normal_(0, 0.1)
    down = torch.randn(256, 128) * 0.1
    mlp.down_proj.weight.data, mlp.down_proj.weight_scale_inv.data = (down / 0.01).clamp(-448, 448).to(
        torch.float8_e4m3fn), torch.full((2, 1), 0.01)
    mlp = mlp.to(DEVICE)
    x = torch.randn(3, 256, dtype=torch.bfloat16).to(DEVICE)
    monkeypatch.setattr(kernels, "enabled", lambda x: True)  # (on the CPU: the kernels interpreted)
    silu_mul_calls = []
    silu_mul = kernel_norm.silu_mul
    monkeypatch.setattr(kernel_norm, "silu_mul", lambda *a: (silu_mul_calls.append(1), silu_mul(*a))[1])
    for mode in ("w8a8", "weight-only"):
        monkeypatch.setattr(kernels, "settings", WorkerOptions(fp8_decode=mode))
        silu_mul_calls.clear()
        got = mlp(x)
        assert len(silu_mul_calls) == (0 if mode == "w8a8" else 1), mode
        gate, up = mlp.gate_up_proj(x)
        expected = mlp.down_proj(silu_mul(gate, up))
        assert torch.equal(got, expected), mode


@pytest.mark.parametrize(("M", "N", "K"), [(70, 256, 512), (65, 200, 320)])
def test_the_w8a8_kernel_equals_the_fp32_product_of_its_quantised_operands(M, N, K):
    """Our FP8 × FP8 kernel against (q · scale) @ (W8 · scale)^T in fp32: to fp32 rounding through the
    interpreter; on the GPU within 2^-9 of the sum of |terms| (the FP8 tensor cores keep fewer
    bits while they accumulate each 128-column block)."""
    from fp8_reference import per_column

    from shardspec.kernels import fp8

    x, weight, scale = _fp8_operands(M, N, K, torch.bfloat16, seed=4)
    q, x_scale = fp8.quantize_groups(x.to(DEVICE))
    got = fp8.w8a8_triton(q, x_scale, weight.to(DEVICE), scale.to(DEVICE), torch.float32).cpu()
    rows = q.cpu().float() * per_column(x_scale, K)
    w = _dequantised(weight, scale)
    terms = rows.abs() @ w.abs().T
    assert ((got - rows @ w.T).abs() <= (2**-9 if GPU else 1e-6) * terms + 1e-30).all()


@pytest.mark.parametrize("weight", ["fp8e4nv", "bf16"])
def test_the_split_k_counter_is_taken_by_one_thread_and_the_partials_read_past_l1(weight):
    """The decode GEMV's split-K protocol, in its compiled code for sm_90 (no GPU needed; a
    process of its own, as the all-reduce's check below), for an FP8 weight-only and a bf16 weight:
    one predicated acq_rel add per program on the tile's counter, one predicated reset, and the
    other splits' partials loaded .cg (L2, where they were stored; L1 may hold stale lines of the
    workspace)."""
    scaled = weight == "fp8e4nv"
    lines = sm90_ptx("shardspec.kernels.gemv", "_gemv_kernel",
                     {"x_ptr": "*bf16", "xs_ptr": "*fp32", "w_ptr": f"*{weight}", "ws_ptr": "*fp32",
                      "y_ptr": "*bf16", "part_ptr": "*fp32", "count_ptr": "*i32"},
                     {"SCALED": scaled, "QUANT": False, "EXACT": False, "EVEN": True,
                      "BM": 16, "BN": 64, "BK": 128},
                     other="i32")
    atomics = [line for line in lines if "atom." in line]
    assert len(atomics) == 2 and all(line.startswith("@%p") and ".gpu.acq_rel." in line for line in atomics), atomics
    assert ".add." in atomics[0] and ".exch." in atomics[1]
    assert any(line.startswith(("ld.global.cg", "@%p")) and "ld.global.cg" in line for line in lines)


# --- Routed experts of a mixture of experts at few rows (kernels.moe) -------------------------------

def _experts(E: int, H: int, width: int, dtype: torch.dtype, rank: int = 0, ep: int = 1, seed: int = 0):
    """Experts of rank `rank` of `ep` (each holding E / ep whole experts), random weights."""
    from shardspec.layers.moe import Experts

    gen = torch.Generator().manual_seed(seed)
    experts = Experts(E, H, width, TPGroup(rank, ep), ep)
    experts.gate_up_proj.data.normal_(0, H**-0.5, generator=gen)
    experts.down_proj.data.normal_(0, width**-0.5, generator=gen)
    return experts.to(dtype)


def _routed(N: int, H: int, E: int, k: int, dtype: torch.dtype, seed: int = 0):
    """x [N, H] and its route (weights, global ids [N, k]): distinct experts per token, repeats across tokens."""
    from shardspec.layers.moe import route

    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(N, H, generator=gen).to(dtype)
    weights, ids = route(torch.randn(N, E, generator=gen).to(dtype), k)
    return x, weights, ids


# (N, k, E, H, width, ep): one token at top 8; ragged dims; 16 tokens over 8 experts (every expert hit
# by many tokens); whole tiles of the default blocks (H 512, width 128: the unmasked loads)
MOE_SHAPES = [(1, 8, 16, 64, 32, 1), (5, 3, 8, 48, 24, 2), (16, 4, 8, 32, 16, 2), (2, 4, 4, 512, 128, 1)]


# (bf16 of the two larger shapes, 15 s in Triton's interpreter, with the slow tests; bf16 of the others here)
@pytest.mark.parametrize(("N", "k", "E", "H", "width", "ep", "dtype"), [
    pytest.param(*shape, dtype, marks=[pytest.mark.slow] if dtype == torch.bfloat16 and shape in MOE_SHAPES[2:] else [],
                 id="-".join(map(str, shape)) + ("-bf16" if dtype == torch.bfloat16 else "-fp32"))
    for shape in MOE_SHAPES for dtype in (torch.float32, torch.bfloat16)])
def test_the_fused_moe_experts_match_the_reference_loop_on_every_rank(dtype, N, k, E, H, width, ep):
    """Each rank adds only its own experts (under expert parallelism the others' ids fall outside its
    range, below or above). float32 to float32 rounding; bf16 rounds where the gathered backend
    does (the matmuls' outputs, silu, the product, each slot's weighted output and running sum), so
    it agrees with it to an ulp, and with the fp32 loop to bf16's noise."""
    x, weights, ids = _routed(N, H, E, k, dtype, seed=N)
    for rank in range(ep):
        experts = _experts(E, H, width, dtype, rank, ep, seed=N + rank)
        held = (ids >= experts.first) & (ids < experts.first + E // ep)
        assert held.any() and (ep == 1 or not held.all())
        experts.backend = "fused"
        out = experts.to(DEVICE)(x.to(DEVICE), weights.to(DEVICE), ids.to(DEVICE)).cpu()
        experts.cpu()
        assert out.dtype == dtype and out.shape == (N, H)
        experts.backend = "gathered"
        gathered = experts(x, weights, ids).float()
        experts.backend = "reference"
        reference = experts.float()(x.float(), weights.float(), ids)  # (float(): in place, after the rest)
        scale = reference.abs().max().item()
        if dtype == torch.float32:
            torch.testing.assert_close(out, reference, rtol=1e-5, atol=1e-5 * scale)
        else:
            torch.testing.assert_close(out.float(), gathered, rtol=2**-7, atol=2**-8 * scale)
            assert (out.float() - reference).abs().max().item() <= 2**-6 * scale
        assert torch.equal(out[~held.any(1)], torch.zeros_like(out[~held.any(1)]))  # no expert here: 0


def test_the_fused_moe_backend_is_a_valid_setting_and_the_cpu_default_stays_the_reference_loop():
    from shardspec.layers.moe import Experts, check_backend_setting

    check_backend_setting("fused")
    with pytest.raises(ValueError, match="'fused', 'gathered', 'grouped', 'reference'"):
        check_backend_setting("triton")
    experts = Experts(8, 32, 16, TPGroup())
    experts.backend = "auto"
    assert experts.pick(torch.empty(1, 32, dtype=torch.bfloat16), 8) == "reference"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("N", "E", "k", "shared"), [(1, 256, 8, True), (32, 256, 8, True), (5, 60, 4, False),
                                                     (3, 8, 8, True)])
def test_the_routing_kernel_picks_the_reference_experts_and_weights(dtype, N, E, k, shared):
    """One launch for softmax, top k and renormalisation (and the shared expert's sigmoid gate from
    the logit after the router's): the experts of layers.moe.route's logits in its order (of equal
    logits, which bf16 makes common, the lower expert id first, where torch.topk's order is its own),
    weights within a rounding of its (fp32 sums in another order), the gate within a rounding of
    torch.sigmoid's. E = 60: a count of experts that is not a power of two (masked lanes); E = k: all."""
    from shardspec.layers.moe import route

    gen = torch.Generator().manual_seed(E + N)
    logits = (3 * torch.randn(N, E + shared, generator=gen)).to(dtype)
    weights, ids, gate = kernels.moe.route(logits.to(DEVICE), E, k)
    expected_weights, expected_ids = route(logits[:, :E], k)
    ids = ids.cpu()
    picked = logits.gather(1, ids)
    assert torch.equal(picked, logits.gather(1, expected_ids))  # the same logits in the same order
    assert all(len(set(row)) == k for row in ids.tolist())
    tied = picked[:, 1:] == picked[:, :-1]
    assert torch.all(ids[:, 1:][tied] > ids[:, :-1][tied])
    assert tied.any() or N < 32 or dtype == torch.float32  # 32 rows of bf16 logits hold ties: the case is tried
    assert weights.dtype == dtype and weights.shape == (N, k)
    ulp = 2**-7 if dtype == torch.bfloat16 else 1e-6
    torch.testing.assert_close(weights.cpu().float(), expected_weights.float(), rtol=ulp, atol=0)
    if shared:
        torch.testing.assert_close(gate.cpu().float(), torch.sigmoid(logits[:, E:]).float(), rtol=ulp, atol=0)
    else:
        assert gate is None


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("N", "k", "E", "H", "width", "ep"), [(1, 8, 16, 64, 32, 1), (5, 3, 8, 48, 24, 2)])
def test_the_fused_moe_kernels_add_the_gated_shared_expert_as_its_eager_sum_does(dtype, N, k, E, H, width, ep):
    """With the shared expert as one more slot per token: the routed experts' sum, then the shared
    expert's output times its gate, added last and rounded where the eager sum rounds (the gathered
    experts + gate · MLP); on an expert-parallel rank that holds none of a token's experts, the
    shared expert alone."""
    from shardspec.layers.mlp import silu_mul

    x, weights, ids = _routed(N, H, E, k, dtype, seed=N)
    gen = torch.Generator().manual_seed(7)
    gate_up = (torch.randn(2 * width, H, generator=gen) * H**-0.5).to(dtype)
    down = (torch.randn(H, width, generator=gen) * width**-0.5).to(dtype)
    gate = torch.sigmoid(torch.randn(N, 1, generator=gen)).to(dtype)
    for rank in range(ep):
        experts = _experts(E, H, width, dtype, rank, ep, seed=N + rank)
        local = (ids - experts.first).to(DEVICE)
        out = kernels.moe.experts(x.to(DEVICE), weights.to(DEVICE), local, experts.gate_up_proj.to(DEVICE),
                                  experts.down_proj.to(DEVICE), (gate_up.to(DEVICE), down.to(DEVICE), gate.to(DEVICE)))
        experts.backend = "gathered"
        routed = experts(x, weights, ids)
        g, u = (x @ gate_up.T).chunk(2, -1)
        expected = routed + gate * (silu_mul(g, u) @ down.T)
        scale = expected.abs().max().item()
        if dtype == torch.float32:
            torch.testing.assert_close(out.cpu(), expected, rtol=1e-5, atol=1e-5 * scale)
        else:
            torch.testing.assert_close(out.cpu().float(), expected.float(), rtol=2**-7, atol=2**-8 * scale)
