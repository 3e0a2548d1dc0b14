"""Partial rotary position embedding (rotate-half layout) over the first rotary_dim channels."""

from __future__ import annotations

import torch
from torch import nn

from shardspec.layers.invariant import pointwise


class RotaryEmbedding(nn.Module):
    def __init__(self, head_dim: int, rotary_dim: int, theta: float):
        super().__init__()
        self.rotary_dim = rotary_dim
        self.theta = theta
        self._inv_freq: torch.Tensor | None = None  # computed on first use, on the input's device
        self.invariant = False  # batch-invariant mode (CausalLM.set_batch_invariant)

    def inv_freq(self, device: torch.device) -> torch.Tensor:
        if self._inv_freq is None or self._inv_freq.device != device:
            exponents = torch.arange(0, self.rotary_dim, 2, dtype=torch.float32, device=device) / self.rotary_dim
            self._inv_freq = 1.0 / (self.theta**exponents)
        return self._inv_freq

    def forward(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """x: [B, T, H, D]; positions: [B, T] absolute positions."""
        freqs = positions.float()[..., None] * self.inv_freq(x.device)  # [B, T, rotary_dim/2]
        cos, sin = pointwise(torch.cos, freqs, self.invariant), pointwise(torch.sin, freqs, self.invariant)
        cos = torch.cat([cos, cos], -1).to(x.dtype)[:, :, None, :]
        sin = torch.cat([sin, sin], -1).to(x.dtype)[:, :, None, :]
        rot, rest = x[..., : self.rotary_dim], x[..., self.rotary_dim :]
        half = self.rotary_dim // 2
        rotated = torch.cat([-rot[..., half:], rot[..., :half]], -1)
        return torch.cat([rot * cos + rotated * sin, rest], -1)
