"""The Triton kernels of the CUDA path against the PyTorch reference they replace.

On a machine with a GPU the kernels run on it; elsewhere they run on the CPU through Triton's
interpreter (TRITON_INTERPRET=1), which checks the same code. float32 must agree to float32
rounding; bfloat16 within two bf16 ulps (the interpreter rounds float32 -> bfloat16 by truncation,
the GPU to nearest).
"""

from __future__ import annotations

import os

import pytest
import torch

GPU = torch.cuda.is_available()
if not GPU:
    os.environ.setdefault("TRITON_INTERPRET", "1")
triton = pytest.importorskip("triton", reason="Triton is not installed (it comes with CUDA builds of torch)")

from shardspec import kernels  # noqa: E402
from shardspec.kernels import gdn as kernel_gdn  # noqa: E402
from shardspec.kernels import norm as kernel_norm  # noqa: E402
from shardspec.layers import gdn as reference_gdn  # noqa: E402
from shardspec.layers.attention import GatedAttention  # noqa: E402
from shardspec.layers.batch import Batch  # noqa: E402
from shardspec.layers.norm import GatedRMSNorm, RMSNorm  # noqa: E402
from shardspec.layers.parallel import TPGroup  # noqa: E402
from shardspec.models.config import ModelConfig  # noqa: E402
from shardspec.models.random_checkpoint import tiny_config  # noqa: E402

DEVICE = torch.device("cuda" if GPU else "cpu")
DTYPES = [torch.float32, torch.bfloat16]


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
    norm = GatedRMSNorm(32, 1e-6)
    norm.weight.data.normal_(1, 0.2)
    norm = norm.to(dtype)
    # z and the gate/up halves are slices of one merged projection's output, as in the layers
    x, projected = torch.randn(3, 2, 4, 32, dtype=dtype), torch.randn(3, 2, 4 * 32 + 8, dtype=dtype)
    z = projected[..., 8:].view(3, 2, 4, 32)
    assert_agree(kernel_norm.gated_rms_norm(x.to(DEVICE), projected.to(DEVICE)[..., 8:].view(3, 2, 4, 32),
                                            norm.weight.to(DEVICE), 1e-6), norm(x, z), dtype)
    gate_up = torch.randn(3, 2, 3000, dtype=dtype)
    gate, up = gate_up.split(1500, -1)
    assert_agree(kernel_norm.silu_mul(*gate_up.to(DEVICE).split(1500, -1)), torch.nn.functional.silu(gate) * up, dtype)


def gdn_inputs(dtype, T):
    torch.manual_seed(T)
    B, HK, HV, DK, DV, slots = 3, 2, 4, 16, 32, 5
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
@pytest.mark.parametrize("T", [1, 4, 9])
def test_gated_deltanet_kernels_match_the_reference_and_update_states_in_place(dtype, T):
    inputs = gdn_inputs(dtype, T)
    ref, dev = on("cpu", inputs), on(DEVICE, inputs)
    out, _ = run_gdn(reference_gdn, ref, write=True)
    out_k, _ = run_gdn(kernel_gdn, dev, write=True)
    assert_agree(out_k, out, dtype)
    assert_agree(dev["conv_state"], ref["conv_state"], dtype)
    assert_agree(dev["state"], ref["state"], torch.float32 if dtype == torch.float32 else dtype)
    untouched = [1, 4]  # slots no row uses
    assert torch.equal(dev["state"][untouched].cpu(), inputs["state"][untouched])


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_speculative_pass_leaves_states_alone_and_its_replay_commits_the_accepted_prefix(dtype):
    inputs = gdn_inputs(dtype, 4)
    lengths = torch.tensor([1, 4, 2])  # accepted tokens + 1 per row
    dev = on(DEVICE, inputs)
    out, mixed = run_gdn(kernel_gdn, dev, write=False)
    assert torch.equal(dev["conv_state"].cpu(), inputs["conv_state"]) and torch.equal(dev["state"].cpu(), inputs["state"])
    kernel_gdn.causal_conv(dev["x"], dev["conv_state"], dev["conv_weight"], dev["slots"], write_out=False,
                           lengths=lengths.to(DEVICE))
    kernel_gdn.delta_rule(mixed, dev["a"], dev["b"], dev["A_log"], dev["dt_bias"], dev["state"], dev["slots"],
                          dev["k_heads"], dev["dk"], write_out=False, lengths=lengths.to(DEVICE))
    for row, n in enumerate(lengths.tolist()):  # the states after the row's first n tokens, token by token
        ref = on("cpu", inputs)
        ref["slots"] = inputs["slots"][row : row + 1]
        for key in ("x", "a", "b"):
            ref[key] = inputs[key][row : row + 1, :n]
        run_gdn(reference_gdn, ref, write=True)
        slot = int(inputs["slots"][row])
        assert_agree(dev["conv_state"][slot], ref["conv_state"][slot], dtype)
        assert_agree(dev["state"][slot], ref["state"][slot], dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_attention_kernels_match_the_reference_and_fill_the_cache(dtype, monkeypatch):
    config = ModelConfig.from_dict(tiny_config())
    torch.manual_seed(0)
    layer = GatedAttention(config, TPGroup())
    for p in layer.parameters():
        p.data.normal_(0, 0.3)
    layer = layer.to(dtype)
    slots = torch.tensor([2, 0])
    prompt = torch.randn(2, 37, config.hidden_size, dtype=dtype)
    step = torch.randn(2, 3, config.hidden_size, dtype=dtype)
    outputs = []
    for use_kernels, device in ((False, "cpu"), (True, DEVICE)):
        monkeypatch.setattr(kernels, "enabled", lambda x, on=use_kernels: on)
        layer.to(device).allocate(3, 64, dtype, torch.device(device))
        s = slots.to(device)
        positions = torch.arange(37, device=device).expand(2, -1)
        layer(prompt.to(device), Batch(s, positions, 37))  # prefill: never the kernels
        positions = torch.tensor([[37, 38, 39], [30, 31, 32]], device=device)  # row 1 overwrites its tail
        out = layer(step.to(device), Batch(s, positions, 40))
        outputs.append((out, layer.k_cache.clone(), layer.v_cache.clone()))
    (out, k_cache, v_cache), (out_k, k_cache_k, v_cache_k) = outputs
    # the output projection sums 128 bf16-rounded products, so a few ulps before it show up larger
    assert_agree(out_k, out, dtype, bf16_tol=0.05)
    assert_agree(k_cache_k, k_cache, dtype)
    assert_agree(v_cache_k, v_cache, dtype)


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
