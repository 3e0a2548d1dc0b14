"""Gated DeltaNet kernels that work on the per-slot states in place.

`causal_conv` runs the depthwise causal convolution + SiLU over T new inputs of each sequence,
reading the conv state of its slot; `delta_rule` runs the gated delta rule (L2-normalised q and k,
decay from A_log/dt_bias, sigmoid beta, grouped value heads) from the recurrent state of its slot.
Both either write the state after the last token back to the slot (decode, prefill), or leave it
alone (a speculative verify pass). With `lengths` they write the state after token lengths[b] - 1 of
row b: replaying only the first lengths[b] tokens without output is how a verify pass is committed
once the accepted prefix is known, with the same arithmetic as the verify pass itself, so no per-token
states are stored; with output, it is a prefill padded past its tokens (tails.TailPasses). With `saves`
they also write the state after token save_at[b] - 1 to another row (a prefix cache's save within
that pass: Batch.state_saves).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from shardspec import kernels

try:  # flash-linear-attention's chunked kernel for long inputs: the optional extra shardspec[cuda]
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule
except ImportError:
    chunk_gated_delta_rule = None

FLA_MIN_TOKENS = 64  # prefill chunks at least this long use fla's chunked form when installed (option fla)
CONV_TOKENS = 16  # tokens per program of the causal convolution


@triton.jit
def _write_window(x_row, state, dest, n, mask, stride_xt, K: tl.constexpr, KP: tl.constexpr):
    """The K-1 inputs ending at token n-1 (window positions n .. n+K-2: the old state's columns, then
    inputs) to the conv state `dest` [C, K-1] (this program's channels)."""
    j = tl.arange(0, KP)
    src = n + j - (K - 1)
    keep = mask[:, None] & (j < K - 1)[None, :]
    from_x = tl.load(x_row[:, None] + src[None, :] * stride_xt, mask=keep & (src >= 0)[None, :], other=0.0)
    from_state = tl.load(state[:, None] + (n + j)[None, :], mask=keep & (src < 0)[None, :], other=0.0)
    tl.store(dest[:, None] + j[None, :], from_x + from_state, mask=keep)


@triton.jit
def _causal_conv_kernel(x_ptr, state_ptr, w_ptr, slots_ptr, lengths_ptr, save_at_ptr, save_rows_ptr, y_ptr, T, C,
                        stride_xb, stride_xt, K: tl.constexpr, KP: tl.constexpr, BLOCK: tl.constexpr,
                        BT: tl.constexpr, HAS_LENGTHS: tl.constexpr, HAS_SAVES: tl.constexpr,
                        WRITE_OUT: tl.constexpr, WRITE_STATE: tl.constexpr):
    t0 = tl.program_id(0) * BT  # this program's tokens: t0 .. t0 + BT - 1 (each needs only its window)
    c = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    b = tl.program_id(2).to(tl.int64)
    mask = c < C
    slot = tl.load(slots_ptr + b)
    n = T
    if HAS_LENGTHS:
        n = tl.load(lengths_ptr + b).to(tl.int32)
    x_row = x_ptr + b * stride_xb + c
    state = state_ptr + slot * C * (K - 1) + c * (K - 1)  # [C, K-1]: oldest input first
    dtype = y_ptr.dtype.element_ty
    zero = tl.zeros([BLOCK], dtype=tl.int32)  # (a scalar condition, as a vector like the mask)
    if WRITE_OUT:
        for t in range(t0, tl.minimum(t0 + BT, T)):
            acc = tl.zeros([BLOCK], dtype=tl.float32)
            for j in tl.static_range(K):  # window position t + j: the state's column t + j, or input t + j - (K - 1)
                src = t + j - (K - 1)
                from_x = tl.load(x_row + src * stride_xt, mask=mask & (zero + src >= 0), other=0.0)
                from_state = tl.load(state + t + j, mask=mask & (zero + src < 0), other=0.0)
                w = tl.load(w_ptr + c * K + j, mask=mask, other=0.0).to(tl.float32)
                acc += w * (from_x.to(tl.float32) + from_state.to(tl.float32))
            acc = acc.to(dtype).to(tl.float32)  # the convolution's output rounds before the SiLU
            tl.store(y_ptr + (b * T + t) * C + c, (acc * tl.sigmoid(acc)).to(dtype), mask=mask)
    # a save's window (before the slot's state changes), then the K-1 inputs ending at token n-1, written
    # by the first token block: the only one that reads the old state (tokens < K-1 <= BT)
    if HAS_SAVES:  # noqa: SIM102 (a compile-time branch around a run-time one)
        if t0 == 0:
            saved = state_ptr + tl.load(save_rows_ptr + b) * C * (K - 1) + c * (K - 1)
            _write_window(x_row, state, saved, tl.load(save_at_ptr + b).to(tl.int32), mask, stride_xt, K, KP)
    if WRITE_STATE:  # noqa: SIM102
        if t0 == 0:
            if WRITE_OUT or HAS_SAVES:  # other warps of this program read the old state above
                tl.debug_barrier()
            _write_window(x_row, state, state, n, mask, stride_xt, K, KP)


def causal_conv(x: torch.Tensor, state: torch.Tensor, weight: torch.Tensor, slots: torch.Tensor,
                write_out: bool = True, write_state: bool = True, lengths: torch.Tensor | None = None,
                saves: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor | None:
    """x [B, T, C] (unit stride along C); state [slots, C, K-1]; weight [C, 1, K] -> silu(conv) [B, T, C].
    `saves` (save_at [B], rows [B]): also the K-1 inputs ending at token save_at[b]-1 to state row rows[b].

    One program per (CONV_TOKENS tokens, 256 channels, row): a prefill chunk runs in parallel over
    its tokens, not token after token."""
    B, T, C = x.shape
    K = weight.shape[-1]
    assert x.stride(-1) == 1 and state.is_contiguous() and weight.is_contiguous()
    assert slots.is_contiguous() and (lengths is None or lengths.is_contiguous())
    assert K - 1 <= CONV_TOKENS, "only the first token block may read the old state"
    save_at, save_rows = _saves(saves, slots)
    y = torch.empty(B, T, C, dtype=x.dtype, device=x.device) if write_out else x
    BLOCK = 256
    blocks = triton.cdiv(T, CONV_TOKENS) if write_out else 1
    _causal_conv_kernel[(blocks, triton.cdiv(C, BLOCK), B)](
        x, state, weight, slots, lengths if lengths is not None else slots, save_at, save_rows, y, T, C,
        x.stride(0), x.stride(1), K=K, KP=triton.next_power_of_2(K - 1), BLOCK=BLOCK, BT=CONV_TOKENS,
        HAS_LENGTHS=lengths is not None, HAS_SAVES=saves is not None, WRITE_OUT=write_out,
        WRITE_STATE=write_state, num_warps=2,
    )
    return y if write_out else None


def _saves(saves: tuple[torch.Tensor, torch.Tensor] | None, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A kernel's (save_at, rows) pointers: the saves' (contiguous), or any valid ones when there are none."""
    if saves is None:
        return slots, slots
    assert saves[0].is_contiguous() and saves[1].is_contiguous()
    return saves


@triton.jit
def _delta_rule_kernel(qkv_ptr, a_ptr, b_ptr, A_log_ptr, dt_bias_ptr, state_ptr, slots_ptr, lengths_ptr,
                       save_at_ptr, save_rows_ptr, o_ptr, T, stride_qkv_b, stride_qkv_t, stride_ab_b, stride_ab_t,
                       scale, HK: tl.constexpr, HV: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr,
                       DKP: tl.constexpr, BV: tl.constexpr, HAS_LENGTHS: tl.constexpr, HAS_SAVES: tl.constexpr,
                       WRITE_OUT: tl.constexpr, WRITE_STATE: tl.constexpr):
    i_v = tl.program_id(0)
    b = tl.program_id(1).to(tl.int64) // HV
    hv = tl.program_id(1) % HV
    hk = hv // (HV // HK)
    slot = tl.load(slots_ptr + b)
    n = T
    if HAS_LENGTHS:
        n = tl.load(lengths_ptr + b).to(tl.int32)
    o_k = tl.arange(0, DKP)  # head dims padded to powers of two: masked lanes hold zeros throughout
    o_v = i_v * BV + tl.arange(0, BV)
    k_live = o_k < DK
    v_live = o_v < DV
    tile = k_live[:, None] & v_live[None, :]
    p_state = state_ptr + ((slot * HV + hv) * DK + o_k[:, None]) * DV + o_v[None, :]
    h = tl.load(p_state, mask=tile, other=0.0)  # [DKP, BV] fp32
    save_at = 0
    p_save = p_state
    if HAS_SAVES:
        save_at = tl.load(save_at_ptr + b).to(tl.int32)
        p_save = state_ptr + ((tl.load(save_rows_ptr + b) * HV + hv) * DK + o_k[:, None]) * DV + o_v[None, :]
    A = tl.exp(tl.load(A_log_ptr + hv).to(tl.float32))
    dt_bias = tl.load(dt_bias_ptr + hv).to(tl.float32)
    dtype = qkv_ptr.dtype.element_ty
    for t in range(0, n):
        row = qkv_ptr + b * stride_qkv_b + t * stride_qkv_t  # [q (HK*DK) | k (HK*DK) | v (HV*DV)]
        q = tl.load(row + hk * DK + o_k, mask=k_live, other=0.0).to(tl.float32)
        k = tl.load(row + HK * DK + hk * DK + o_k, mask=k_live, other=0.0).to(tl.float32)
        v = tl.load(row + 2 * HK * DK + hv * DV + o_v, mask=v_live, other=0.0).to(tl.float32)
        q = q / tl.sqrt(tl.sum(q * q, 0) + 1e-6) * scale
        k = k / tl.sqrt(tl.sum(k * k, 0) + 1e-6)
        ab = b * stride_ab_b + t * stride_ab_t + hv
        beta = tl.sigmoid(tl.load(b_ptr + ab).to(tl.float32)).to(dtype).to(tl.float32)
        a = tl.load(a_ptr + ab).to(tl.float32) + dt_bias
        softplus = tl.where(a > 20.0, a, tl.log(1.0 + tl.exp(a)))
        h = h * tl.exp(-A * softplus)
        delta = (v - tl.sum(h * k[:, None], 0)) * beta
        h = h + k[:, None] * delta[None, :]
        if WRITE_OUT:
            out = tl.sum(h * q[:, None], 0)
            tl.store(o_ptr + ((b * T + t) * HV + hv) * DV + o_v, out.to(o_ptr.dtype.element_ty), mask=v_live)
        if HAS_SAVES:  # noqa: SIM102 (a compile-time branch around a run-time one)
            if t == save_at - 1:
                tl.store(p_save, h, mask=tile)
    if WRITE_STATE:
        tl.store(p_state, h, mask=tile)


def delta_rule(qkv: torch.Tensor, a: torch.Tensor, b: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor,
               state: torch.Tensor, slots: torch.Tensor, k_heads: int, dk: int, write_out: bool = True,
               write_state: bool = True, lengths: torch.Tensor | None = None,
               saves: tuple[torch.Tensor, torch.Tensor] | None = None, block_v: int = 16,
               num_warps: int = 2) -> torch.Tensor | None:
    """qkv [B, T, q|k|v] after the convolution; a, b [B, T, HV] projections; state [slots, HV, dk, DV] fp32.
    `saves` (save_at [B], rows [B]): also the state after token save_at[b]-1 to state row rows[b].

    Returns the output [B, T, HV, DV] in qkv's dtype (when write_out; with `lengths`, zeros past row
    b's lengths[b] tokens). Each program holds a [dk, block_v] tile of one head's state (bench/kernels.py
    times the choices); head dims that are not powers of two are padded to the next one, masked."""
    B, T, _ = qkv.shape
    HV, DK, DV = state.shape[1:]
    assert dk == DK
    # (fla computes in TF32 where float32 must stay exact)
    if (chunk_gated_delta_rule is not None and kernels.settings.fla and T >= FLA_MIN_TOKENS and write_out
            and write_state and lengths is None and saves is None and qkv.dtype != torch.float32):
        return _chunked(qkv, a, b, A_log, dt_bias, state, slots, k_heads, dk)
    assert qkv.stride(-1) == 1 and a.stride(-1) == 1 and b.stride(-1) == 1 and a.stride() == b.stride()
    assert state.is_contiguous() and state.dtype == torch.float32
    assert slots.is_contiguous() and (lengths is None or lengths.is_contiguous())
    out = None
    if write_out:
        out = (torch.empty if lengths is None else torch.zeros)(B, T, HV, DV, dtype=qkv.dtype, device=qkv.device)
    BV = min(block_v, triton.next_power_of_2(DV))
    assert BV & (BV - 1) == 0, "block_v: a power of two"
    save_at, save_rows = _saves(saves, slots)
    _delta_rule_kernel[(triton.cdiv(DV, BV), B * HV)](
        qkv, a, b, A_log, dt_bias, state, slots, lengths if lengths is not None else slots, save_at, save_rows,
        out if write_out else qkv, T, qkv.stride(0), qkv.stride(1), a.stride(0), a.stride(1), DK**-0.5,
        HK=k_heads, HV=HV, DK=DK, DV=DV, DKP=triton.next_power_of_2(DK), BV=BV, HAS_LENGTHS=lengths is not None,
        HAS_SAVES=saves is not None, WRITE_OUT=write_out, WRITE_STATE=write_state, num_warps=num_warps,
    )
    return out


def _chunked(qkv, a, b, A_log, dt_bias, state, slots, k_heads, dk):
    """Prefill through fla-core's chunked gated delta rule, from and back to the slots' states."""
    B, T, _ = qkv.shape
    HV, DV = state.shape[1], state.shape[3]
    key_dim = k_heads * dk
    q, k, v = qkv.split([key_dim, key_dim, HV * DV], -1)
    g = -A_log.float().exp() * F.softplus(a.float() + dt_bias.float())
    out, final = chunk_gated_delta_rule(
        q.reshape(B, T, k_heads, dk), k.reshape(B, T, k_heads, dk), v.reshape(B, T, HV, DV), g=g,
        beta=torch.sigmoid(b).float(), scale=dk**-0.5, initial_state=state[slots], output_final_state=True,
        use_qk_l2norm_in_kernel=True,
    )
    state[slots] = final
    return out.to(qkv.dtype)
