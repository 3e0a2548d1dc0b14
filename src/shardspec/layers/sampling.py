"""Turning logits into tokens: greedy, or temperature / top-k / top-p with a seeded generator."""

from __future__ import annotations

import torch

from shardspec.protocol.messages import SamplingParams


def filtered_logits(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """[V] fp32 logits scaled by temperature, with tokens outside top-k / top-p set to -inf."""
    logits = logits / params.temperature
    if 0 < params.top_k < logits.shape[-1]:
        kth = torch.topk(logits, params.top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if params.top_p < 1.0:
        ordered, order = torch.sort(logits, descending=True)
        mass_before = torch.softmax(ordered, -1).cumsum(-1) - torch.softmax(ordered, -1)
        drop = mass_before >= params.top_p  # keep the smallest prefix whose mass reaches top_p
        logits = logits.masked_fill(torch.zeros_like(drop).scatter(0, order, drop), float("-inf"))
    return logits


def sample(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None) -> int:
    """One token from [V] fp32 logits."""
    if params.greedy:
        return int(logits.argmax())
    probs = torch.softmax(filtered_logits(logits, params), -1)
    return int(torch.multinomial(probs, 1, generator=generator))
