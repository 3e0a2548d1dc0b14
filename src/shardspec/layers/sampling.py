"""Turning logits into tokens: greedy, or temperature / top-k / top-p with a seeded generator."""

from __future__ import annotations

import torch

from shardspec.protocol.messages import SamplingParams


def filtered_logits(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """[..., V] fp32 logits scaled by temperature, with tokens outside top-k / top-p set to -inf."""
    logits = logits / params.temperature
    if 0 < params.top_k < logits.shape[-1]:
        kth = torch.topk(logits, params.top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if params.top_p < 1.0:
        ordered, order = torch.sort(logits, dim=-1, descending=True)
        probs = torch.softmax(ordered, -1)
        drop = probs.cumsum(-1) - probs >= params.top_p  # keep the smallest prefix whose mass reaches top_p
        logits = logits.masked_fill(torch.zeros_like(drop).scatter(-1, order, drop), float("-inf"))
    return logits


def sample(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None) -> int:
    """One token from [V] fp32 logits."""
    if params.greedy:
        return int(logits.argmax())
    probs = torch.softmax(filtered_logits(logits, params), -1)
    return int(torch.multinomial(probs, 1, generator=generator))


def unusable(logits: torch.Tensor) -> bool:
    """Whether [..., V] logits hold numbers no row can be sampled from: NaN or +inf anywhere, or a
    row without a finite logit (nothing left after penalties, biases and masks). The request's own
    values make them (a repetition_penalty of 1e-39 divides logits into infinity), so such a row
    fails its request alone."""
    return bool(torch.isnan(logits).any() or torch.isposinf(logits).any() or not torch.isfinite(logits).any(-1).all())


def target_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """The distribution the target model samples from: [..., V] fp32."""
    return torch.softmax(filtered_logits(logits, params), -1)


def accept_greedy(target: list[int], drafts: list[int]) -> int:
    """How many leading drafts equal the target's argmax at their position."""
    n = 0
    while n < len(drafts) and drafts[n] == target[n]:
        n += 1
    return n


def accept_sampled(probs: torch.Tensor, drafts: list[int], generator: torch.Generator) -> int:
    """Leviathan et al. acceptance for one-hot (argmax) drafts: how many leading drafts to keep.

    probs: [k+1, V] target distributions at the draft positions and the bonus position. Draft d at
    position j is kept with probability min(1, p_j(d)/q(d)) = p_j(d), q being one-hot on d."""
    for j, draft in enumerate(drafts):
        if float(torch.rand((), generator=generator, device=probs.device)) >= float(probs[j, draft]):
            return j
    return len(drafts)


def resample(probs: torch.Tensor, drafts: list[int], accepted: int, generator: torch.Generator) -> int:
    """The token after `accepted` drafts: from the residual p_j - q (p_j without the rejected
    draft, renormalised) at a rejection, from p_k when all were kept; the output then follows the
    target distribution exactly."""
    if accepted == len(drafts):
        return int(torch.multinomial(probs[accepted], 1, generator=generator))
    residual = probs[accepted].clone()
    residual[drafts[accepted]] = 0.0
    if float(residual.sum()) <= 0.0:  # only reachable with forced acceptance: p was one-hot on d
        return drafts[accepted]
    return int(torch.multinomial(residual, 1, generator=generator))


def forced_accepts(k: int, rate: float, generator: torch.Generator) -> int:
    """Benchmarks only: keep each of k drafts with probability `rate`, whatever the target says."""
    for j in range(k):
        if float(torch.rand((), generator=generator, device=generator.device)) >= rate:
            return j
    return k
