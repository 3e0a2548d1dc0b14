"""What the FP8 kernels compute, written in plain PyTorch (the reference of their tests): the W8A8
path's activation quantisation and the weight's dequantisation."""

from __future__ import annotations

import torch

BLOCK = 128


def quantised_groups(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (e4m3 [M, K], fp32 scales [M, ⌈K/128⌉]): each token's 128-column groups at the
    scale max |x| / 448, divided by it and rounded to the nearest e4m3 (IEEE fp32 steps)."""
    M, K = x.shape
    groups = -(-K // BLOCK)
    padded = torch.zeros(M, groups * BLOCK)
    padded[:, :K] = x.float().cpu()
    grouped = padded.view(M, groups, BLOCK)
    scale = grouped.abs().amax(-1).clamp(min=1e-12) / 448
    q = (grouped / scale[..., None]).clamp(-448, 448).to(torch.float8_e4m3fn)
    return q.view(M, -1)[:, :K], scale


def per_column(scale: torch.Tensor, K: int) -> torch.Tensor:
    """Scales [M, ⌈K/128⌉] spread to [M, K]: column k takes its group's."""
    return scale.float().cpu().repeat_interleave(BLOCK, dim=1)[:, :K]


def quantised_activations(x: torch.Tensor) -> torch.Tensor:
    """x through the W8A8 path's quantisation and back: q · scale, in fp32."""
    q, scale = quantised_groups(x.reshape(-1, x.shape[-1]))
    return (q.float() * per_column(scale, x.shape[-1])).view(x.shape)


def rounding_bound(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """The most |x q·s − x| @ |w|^T can be (per output): each activation within half an e4m3
    spacing of itself, 2^-4 of it for a normal, 2^-10 of its group's scale for a subnormal."""
    _, scale = quantised_groups(x)
    per_activation = 2**-4 * x.float().cpu().abs() + 2**-10 * per_column(scale, x.shape[1])
    return per_activation @ w.float().cpu().abs().T
