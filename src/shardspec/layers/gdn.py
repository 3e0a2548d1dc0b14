"""Gated DeltaNet (the linear-attention layers of Qwen3.5), pure PyTorch, split by key heads.

Per slot it keeps a causal-conv state (the last K-1 inputs) and a recurrent state S of shape
[value heads, Dk, Dv] in fp32. The delta rule per token t, with decay a_t = exp(g_t):
    S <- a_t S;   S <- S + beta_t k_t (v_t - S^T k_t)^T;   o_t = S^T q_t
Long inputs use the chunked (WY) form of the same recurrence.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from shardspec.layers.batch import Batch
from shardspec.layers.linear import ColumnParallelLinear, RowParallelLinear, head_ranges
from shardspec.layers.norm import GatedRMSNorm
from shardspec.layers.parallel import TPGroup, shard
from shardspec.models.config import ModelConfig

CHUNK = 64


def l2_normalize(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)


def recurrent_delta_rule(q, k, v, g, beta, state, keep_states: bool = False):
    """Token-by-token delta rule. q, k: [B,H,T,Dk]; v: [B,H,T,Dv]; g, beta: [B,H,T]; state fp32.

    Returns the output [B,H,T,Dv], the final state, and (keep_states) the state after every token
    as [B,T,H,Dk,Dv]."""
    outputs, states = [], []
    for t in range(q.shape[2]):
        state = state * g[:, :, t, None, None].exp()
        predicted = (k[:, :, t, None, :] @ state)[:, :, 0]  # S^T k: [B,H,Dv]
        delta = (v[:, :, t] - predicted) * beta[:, :, t, None]
        state = state + k[:, :, t, :, None] * delta[:, :, None, :]
        outputs.append((q[:, :, t, None, :] @ state)[:, :, 0])
        if keep_states:
            states.append(state)
    kept = torch.stack(states, dim=1) if keep_states else None
    return torch.stack(outputs, dim=2), state, kept


def chunked_delta_rule(q, k, v, g, beta, state, chunk: int = CHUNK):
    """The same recurrence, a chunk at a time: within a chunk the updates are a triangular solve."""
    B, H, T, Dk = k.shape
    chunk = min(chunk, T)  # short inputs: one exact-size chunk, no padding
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


class GatedDeltaNet(nn.Module):
    def __init__(self, config: ModelConfig, tp: TPGroup):
        super().__init__()
        nk, nv = config.linear_num_key_heads, config.linear_num_value_heads
        dk, dv = config.linear_key_head_dim, config.linear_value_head_dim
        hidden, kernel = config.hidden_size, config.linear_conv_kernel_dim
        self.k_heads, self.v_heads, self.dk, self.dv = nk // tp.size, nv // tp.size, dk, dv
        # in_proj_qkv and conv1d are [q | k | v] along their rows: take this rank's heads of each
        qkv = [*head_ranges(tp, nk, dk), *head_ranges(tp, nk, dk, nk * dk), *head_ranges(tp, nv, dv, 2 * nk * dk)]
        self.conv_dim = sum(end - start for start, end in qkv)
        self.in_proj_qkv = ColumnParallelLinear(hidden, qkv)
        self.in_proj_z = ColumnParallelLinear(hidden, head_ranges(tp, nv, dv))
        self.in_proj_b = ColumnParallelLinear(hidden, head_ranges(tp, nv, 1))
        self.in_proj_a = ColumnParallelLinear(hidden, head_ranges(tp, nv, 1))
        self.conv1d_weight = shard(nn.Parameter(torch.empty(self.conv_dim, 1, kernel), requires_grad=False), 0, qkv)
        self.A_log = shard(nn.Parameter(torch.empty(self.v_heads), requires_grad=False), 0, head_ranges(tp, nv, 1))
        self.dt_bias = shard(nn.Parameter(torch.empty(self.v_heads), requires_grad=False), 0, head_ranges(tp, nv, 1))
        self.norm = GatedRMSNorm(dv, config.rms_norm_eps)
        self.out_proj = RowParallelLinear(head_ranges(tp, nv, dv), hidden, tp)
        self.kernel = kernel
        self.conv_state = torch.empty(0)
        self.recurrent_state = torch.empty(0)
        self.kept: tuple[torch.Tensor, torch.Tensor] | None = None  # per-token states of the last pass

    def allocate(self, num_slots: int, max_len: int, dtype: torch.dtype, device: torch.device) -> int:
        self.conv_state = torch.zeros(num_slots, self.conv_dim, self.kernel - 1, dtype=dtype, device=device)
        self.recurrent_state = torch.zeros(
            num_slots, self.v_heads, self.dk, self.dv, dtype=torch.float32, device=device
        )
        return self.conv_state.nbytes + self.recurrent_state.nbytes

    def reset(self, slots: torch.Tensor) -> None:
        """Zero the states of slots given to new sequences."""
        self.conv_state[slots] = 0
        self.recurrent_state[slots] = 0

    def forward(self, x: torch.Tensor, batch: Batch) -> torch.Tensor:
        B, T, _ = x.shape
        cached = batch.slots is not None
        qkv = self.in_proj_qkv(x).transpose(1, 2)
        if cached:
            window = torch.cat([self.conv_state[batch.slots], qkv], dim=-1)
            self.conv_state[batch.slots] = window[..., 1 - self.kernel :]
        else:
            window = F.pad(qkv, (self.kernel - 1, 0))
        qkv = F.silu(F.conv1d(window, self.conv1d_weight, groups=self.conv_dim)).transpose(1, 2)
        key_dim = self.k_heads * self.dk
        q, k, v = qkv.split([key_dim, key_dim, self.v_heads * self.dv], -1)
        group = self.v_heads // self.k_heads
        q = l2_normalize(q.reshape(B, T, self.k_heads, self.dk).float()).repeat_interleave(group, 2)
        k = l2_normalize(k.reshape(B, T, self.k_heads, self.dk).float()).repeat_interleave(group, 2)
        v = v.reshape(B, T, self.v_heads, self.dv).float()
        q = q * self.dk**-0.5
        beta = torch.sigmoid(self.in_proj_b(x)).float()
        g = -self.A_log.float().exp() * F.softplus(self.in_proj_a(x).float() + self.dt_bias.float())
        q, k, v, g, beta = (t.transpose(1, 2) for t in (q, k, v, g, beta))

        if cached:
            state = self.recurrent_state[batch.slots]
        else:
            state = q.new_zeros(B, self.v_heads, self.dk, self.dv)
        if T == 1 or batch.keep_states:
            out, state, kept = recurrent_delta_rule(q, k, v, g, beta, state, batch.keep_states)
        else:
            out, state = chunked_delta_rule(q, k, v, g, beta, state)
        if cached:
            self.recurrent_state[batch.slots] = state
        if batch.keep_states:  # conv state after token t is the window's K-1 inputs ending at t
            self.kept = (window.unfold(-1, self.kernel - 1, 1)[:, :, 1:].transpose(1, 2), kept)

        out = out.transpose(1, 2).to(x.dtype)  # [B, T, Hv, Dv]
        z = self.in_proj_z(x).view(B, T, self.v_heads, self.dv)
        return self.out_proj(self.norm(out, z).reshape(B, T, -1))

    def commit(self, slots: torch.Tensor, index: torch.Tensor) -> None:
        """Roll each slot's state back to the one kept after token index[b] of the last pass."""
        assert self.kept is not None, "commit() needs a forward pass with keep_states"
        rows = torch.arange(len(slots), device=slots.device)
        self.conv_state[slots] = self.kept[0][rows, index]
        self.recurrent_state[slots] = self.kept[1][rows, index]
        self.kept = None
