"""Gated DeltaNet (the linear-attention layers of Qwen3.5), split by key heads.

Per slot it keeps a causal-conv state (the last K-1 inputs) and a recurrent state S of shape
[value heads, Dk, Dv] in fp32. The delta rule per token t, with decay a_t = exp(g_t):
    S <- a_t S;   S <- S + beta_t k_t (v_t - S^T k_t)^T;   o_t = S^T q_t
Long inputs use the chunked (WY) form of the same recurrence. The functions here are the CPU path
and the reference; on CUDA the same operations run as Triton kernels (shardspec.kernels.gdn).
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import nn

from shardspec import kernels
from shardspec.layers.batch import Batch, CachedLayer, CacheShape
from shardspec.layers.invariant import matvec, pointwise, row_reduce
from shardspec.layers.linear import MergedColumnParallelLinear, RowParallelLinear, head_ranges
from shardspec.layers.norm import GatedRMSNorm
from shardspec.layers.parallel import SliceSpec, TPGroup
from shardspec.layers.quantization import QuantConfig

CHUNK = 64  # tokens per chunk of chunked_delta_rule (read at each call: tools/train_tiny.py --gdn-chunk sets it)


def l2_normalize(x: torch.Tensor, eps: float = 1e-6, exact: bool = False) -> torch.Tensor:
    return x * torch.rsqrt(row_reduce(lambda rows: (rows * rows).sum(-1, keepdim=True), x, exact) + eps)


def recurrent_delta_rule(q, k, v, g, beta, state, lengths: torch.Tensor | None = None, exact: bool = False,
                         save_at: torch.Tensor | None = None):
    """Token-by-token delta rule. q, k: [B,H,T,Dk]; v: [B,H,T,Dv]; g, beta: [B,H,T]; state fp32.

    Returns the output [B,H,T,Dv], the final state and, with `save_at` [B], the state after row b's
    first save_at[b] tokens (else None); with `lengths` [B], row b's state stops changing after its
    first lengths[b] tokens. exact: batch-invariant (layers.invariant.pointwise)."""
    outputs = []
    decay = pointwise(torch.exp, g, exact)
    saved = None if save_at is None else state
    for t in range(q.shape[2]):
        new = state * decay[:, :, t, None, None]
        predicted = matvec(k[:, :, t], new, exact)  # S^T k: [B,H,Dv]
        delta = (v[:, :, t] - predicted) * beta[:, :, t, None]
        new = new + k[:, :, t, :, None] * delta[:, :, None, :]
        outputs.append(matvec(q[:, :, t], new, exact))
        state = new if lengths is None else torch.where((t < lengths)[:, None, None, None], new, state)
        if save_at is not None:
            saved = torch.where((t == save_at - 1)[:, None, None, None], state, saved)
    return torch.stack(outputs, dim=2), state, saved


def chunked_delta_rule(q, k, v, g, beta, state, chunk: int | None = None):
    """The same recurrence, a chunk at a time (default CHUNK tokens): within a chunk the updates are
    a triangular solve."""
    B, H, T, _ = k.shape
    chunk = min(chunk or CHUNK, T)  # short inputs: one exact-size chunk, no padding
    pad = -T % chunk  # padded tokens have g = 0 and beta = 0, so they change nothing
    if pad:
        q, k, v = (F.pad(x, (0, 0, 0, pad)) for x in (q, k, v))
        g, beta = (F.pad(x, (0, pad)) for x in (g, beta))
    n = (T + pad) // chunk
    q, k, v = (x.reshape(B, H, n, chunk, x.shape[-1]) for x in (q, k, v))
    g, beta = g.reshape(B, H, n, chunk), beta.reshape(B, H, n, chunk)

    decay_to = g.cumsum(-1)  # log decay from the chunk start to each token
    causal = torch.ones(chunk, chunk, dtype=torch.bool, device=q.device).tril()
    pair_decay = (decay_to[..., :, None] - decay_to[..., None, :]).masked_fill(~causal, float("-inf")).exp()
    k_beta, v_beta = k * beta[..., None], v * beta[..., None]
    lower = ((k_beta @ k.transpose(-1, -2)) * pair_decay).tril(-1)
    system = lower + torch.eye(chunk, dtype=q.dtype, device=q.device)
    u = torch.linalg.solve_triangular(system, v_beta, upper=False, unitriangular=True)
    w = torch.linalg.solve_triangular(system, k_beta * decay_to.exp()[..., None], upper=False, unitriangular=True)
    intra = (q @ k.transpose(-1, -2)) * pair_decay
    q_decayed = q * decay_to.exp()[..., None]
    k_to_end = k * (decay_to[..., -1:] - decay_to).exp()[..., None]
    chunk_decay = decay_to[..., -1].exp()[..., None, None]

    out = torch.empty_like(v)
    for i in range(n):
        v_new = u[:, :, i] - w[:, :, i] @ state
        out[:, :, i] = q_decayed[:, :, i] @ state + intra[:, :, i] @ v_new
        state = state * chunk_decay[:, :, i] + k_to_end[:, :, i].transpose(-1, -2) @ v_new
    return out.reshape(B, H, n * chunk, -1)[:, :, :T], state


def depthwise_conv(window: torch.Tensor, weight: torch.Tensor, exact: bool = False) -> torch.Tensor:
    """The depthwise convolution of window [B, C, T + K - 1] by weight [C, 1, K] -> [B, C, T]. exact:
    tap by tap in fp32, the same sum for a token whatever the length of the window (batch-invariant
    mode; conv1d may pick its algorithm by shape)."""
    if not exact:
        return F.conv1d(window, weight, groups=window.shape[1])
    K = weight.shape[-1]
    T = window.shape[-1] - K + 1
    taps, inputs = weight[:, 0].float(), window.float()
    out = inputs[..., :T] * taps[:, :1]
    for j in range(1, K):
        out = out + inputs[..., j : j + T] * taps[:, j : j + 1]
    return out.to(window.dtype)


def causal_conv(x, state, weight, slots, write_out=True, write_state=True, lengths=None, exact=False, saves=None):
    """Depthwise causal convolution + SiLU of x [B, T, C] after the conv state [slots, C, K-1] of
    each row's slot (zeros when `state` is None); optionally writes the K-1 inputs ending at token
    lengths[b]-1 (default: the last token) back to the slot (`lengths`: a replay of an accepted prefix,
    or a padded prefill); `saves` (save_at [B], rows [B]): also the K-1 inputs ending at token
    save_at[b]-1 to state row rows[b] (Batch.state_saves); `exact`: see depthwise_conv. The reference
    for kernels.gdn.causal_conv."""
    K = weight.shape[-1]
    inputs = x.transpose(1, 2)
    window = F.pad(inputs, (K - 1, 0)) if state is None else torch.cat([state[slots], inputs], dim=-1)

    def ending_at(n: torch.Tensor) -> torch.Tensor:  # the K-1 inputs before row b's token n[b]
        index = n[:, None, None] + torch.arange(K - 1, device=x.device)
        return window.gather(2, index.expand(-1, window.shape[1], -1))

    if saves is not None and state is not None:
        state[saves[1]] = ending_at(saves[0])
    if write_state and state is not None:
        state[slots] = window[..., -(K - 1) :] if lengths is None else ending_at(lengths)
    if write_out:
        return pointwise(F.silu, depthwise_conv(window, weight, exact), exact).transpose(1, 2)
    return None


def delta_rule(qkv, a, b, A_log, dt_bias, state, slots, k_heads, dk, write_out=True, write_state=True,
               lengths=None, exact=False, saves=None):
    """The gated delta rule over qkv [B, T, q|k|v] (after the convolution), from the recurrent state
    [slots, HV, dk, dv] of each row's slot (zeros when `state` is None); returns the output
    [B, T, HV, dv] in qkv's dtype and optionally writes the state after token lengths[b]-1 (default:
    the last) back to the slot (the outputs past lengths[b] are padding's); `saves` (save_at [B], rows
    [B]): also the state after token save_at[b]-1 to state row rows[b]; `exact`: batch-invariant. The
    reference for kernels.gdn.delta_rule."""
    B, T, _ = qkv.shape
    v_heads = A_log.shape[0]
    key_dim = k_heads * dk
    q, k, v = qkv.split([key_dim, key_dim, qkv.shape[-1] - 2 * key_dim], -1)
    group = v_heads // k_heads
    q = l2_normalize(q.reshape(B, T, k_heads, dk).float(), exact=exact).repeat_interleave(group, 2) * dk**-0.5
    k = l2_normalize(k.reshape(B, T, k_heads, dk).float(), exact=exact).repeat_interleave(group, 2)
    v = v.reshape(B, T, v_heads, -1).float()
    beta = pointwise(torch.sigmoid, b, exact).float()
    g = -A_log.float().exp() * pointwise(F.softplus, a.float() + dt_bias.float(), exact)
    q, k, v, g, beta = (t.transpose(1, 2) for t in (q, k, v, g, beta))
    initial = q.new_zeros(B, v_heads, dk, v.shape[-1]) if state is None else state[slots]
    # batch-invariant mode prefills token by token too: a token's arithmetic is then the same in a
    # prompt as in decoding (a preempted sequence, prefilled again, goes on with the same tokens)
    saved = None
    if T == 1 or lengths is not None or not write_state or exact or saves is not None:
        out, final, saved = recurrent_delta_rule(q, k, v, g, beta, initial, lengths, exact,
                                                 None if saves is None else saves[0])
    else:
        out, final = chunked_delta_rule(q, k, v, g, beta, initial)
    if saved is not None and state is not None:
        state[saves[1]] = saved
    if write_state and state is not None:
        state[slots] = final
    return out.transpose(1, 2).to(qkv.dtype) if write_out else None


class GatedDeltaNet(CachedLayer):
    """nk key heads of dk channels and nv value heads of dv (nv a multiple of nk), a causal conv of
    `kernel` taps over [q | k | v], split by key heads with their value heads."""

    def __init__(self, hidden: int, nk: int, nv: int, dk: int, dv: int, kernel: int, eps: float, tp: TPGroup,
                 quant: QuantConfig | None = None, prefix: str = ""):
        super().__init__()
        self.k_heads, self.v_heads, self.dk, self.dv = nk // tp.size, nv // tp.size, dk, dv
        # in_proj_qkv and conv1d are [q | k | v] along their rows: take this rank's heads of each
        qkv = [*head_ranges(tp, nk, dk), *head_ranges(tp, nk, dk, nk * dk), *head_ranges(tp, nv, dv, 2 * nk * dk)]
        self.conv_dim = sum(end - start for start, end in qkv)
        self.in_proj = MergedColumnParallelLinear(hidden, {
            "in_proj_qkv": qkv,
            "in_proj_z": head_ranges(tp, nv, dv),
            "in_proj_b": head_ranges(tp, nv, 1),
            "in_proj_a": head_ranges(tp, nv, 1),
        }, quant, f"{prefix}.in_proj")
        self.conv1d_weight = nn.Parameter(torch.empty(self.conv_dim, 1, kernel), requires_grad=False)
        self.A_log = nn.Parameter(torch.empty(self.v_heads), requires_grad=False)
        self.dt_bias = nn.Parameter(torch.empty(self.v_heads), requires_grad=False)
        heads = SliceSpec(cut=(0, tuple(head_ranges(tp, nv, 1))))
        self.slice_specs = {"conv1d_weight": SliceSpec(cut=(0, tuple(qkv))), "A_log": heads, "dt_bias": heads}
        self.norm = GatedRMSNorm(dv, eps)
        self.out_proj = RowParallelLinear(head_ranges(tp, nv, dv), hidden, quant, f"{prefix}.out_proj")
        self.kernel = kernel
        self.conv_state = torch.empty(0)
        self.recurrent_state = torch.empty(0)
        self.invariant = False  # batch-invariant mode (CausalLM.set_batch_invariant)

    def allocate(self, shape: CacheShape, dtype: torch.dtype, device: torch.device) -> int:
        rows = shape.slots + shape.saved
        self.conv_state = torch.zeros(rows, self.conv_dim, self.kernel - 1, dtype=dtype, device=device)
        self.recurrent_state = torch.zeros(rows, self.v_heads, self.dk, self.dv, dtype=torch.float32, device=device)
        return self.conv_state.nbytes + self.recurrent_state.nbytes

    def bytes_per(self, dtype: torch.dtype) -> tuple[int, int]:
        conv = self.conv_dim * (self.kernel - 1) * dtype.itemsize
        return conv + self.v_heads * self.dk * self.dv * 4, 0  # (the recurrent state is fp32)

    def reset(self, slots: torch.Tensor) -> None:
        """Zero the states of slots given to new sequences (index_fill_: `state[slots] = 0` would copy
        the 0 from the host, a pageable copy that waits for the device, twice a layer every prefill)."""
        self.conv_state.index_fill_(0, slots, 0)
        self.recurrent_state.index_fill_(0, slots, 0)

    def forward(self, x: torch.Tensor, batch: Batch) -> torch.Tensor:
        B, T, _ = x.shape
        qkv, z, b, a = self.in_proj(x)
        cached = batch.slots is not None
        write = not batch.speculative  # a speculative pass leaves the states as they were
        conv, delta = self._ops(x, cached, self.invariant)
        mixed = conv(qkv, self.conv_state if cached else None, self.conv1d_weight, batch.slots, write_state=write,
                     lengths=batch.lengths, saves=batch.state_saves)
        out = delta(mixed, a, b, self.A_log, self.dt_bias, self.recurrent_state if cached else None, batch.slots,
                    self.k_heads, self.dk, write_state=write, lengths=batch.lengths, saves=batch.state_saves)
        if batch.speculative:  # what commit() replays
            batch.saved[self] = (qkv, mixed, a, b)
        return self.out_proj(self.norm(out, z.view(B, T, self.v_heads, self.dv)).reshape(B, T, -1))

    def copy_states(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        self.conv_state[dst] = self.conv_state[src]
        self.recurrent_state[dst] = self.recurrent_state[src]

    def snapshot(self, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.conv_state[slots].clone(), self.recurrent_state[slots].clone()

    def restore(self, snapshot: tuple[torch.Tensor, torch.Tensor], slots: torch.Tensor) -> None:
        self.conv_state[slots], self.recurrent_state[slots] = snapshot

    def commit(self, saved: tuple[torch.Tensor, ...], slots: torch.Tensor, index: torch.Tensor) -> None:
        """Advance each slot's states past tokens 0..index[b] of a speculative pass, by replaying
        them with the same arithmetic."""
        qkv, mixed, a, b = saved
        conv, delta = self._ops(qkv, True, self.invariant)
        lengths = index + 1
        conv(qkv, self.conv_state, self.conv1d_weight, slots, write_out=False, lengths=lengths)
        delta(mixed, a, b, self.A_log, self.dt_bias, self.recurrent_state, slots, self.k_heads, self.dk,
              write_out=False, lengths=lengths)

    @staticmethod
    def _ops(x: torch.Tensor, cached: bool, invariant: bool):
        """The Triton kernels on CUDA (per-slot states in place, a token at a time), else the
        PyTorch reference (its convolution tap by tap in batch-invariant mode)."""
        if cached and kernels.enabled(x):
            return kernels.gdn.causal_conv, kernels.gdn.delta_rule
        if invariant:
            return functools.partial(causal_conv, exact=True), functools.partial(delta_rule, exact=True)
        return causal_conv, delta_rule
