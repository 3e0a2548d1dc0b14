"""Teacher-forced top-1 agreement of one model's logits with a reference's, where it means something.

Random weights give nearly flat logits: the top-1 margin is often smaller than what any rounding
(bf16, FP8) moves a logit, so the overall agreement measures that flatness more than the rounding.
Per position, the noise σ is the standard deviation over the vocabulary of (logits − reference);
a top-1 flip needs two perturbations to differ by more than the margin, so where the reference's
top-1 margin exceeds 3·√2·σ a flip is a ≥ 3-sigma event (about 0.1 % per close competitor): those
are the "confident" positions, whose agreement is reported apart with their share.
"""

from __future__ import annotations

import torch

CONFIDENT_SIGMAS = 3 * 2**0.5  # margins past this many σ: a flip is a 3-sigma event


def top1_agreement(logits: torch.Tensor, reference: torch.Tensor) -> dict:
    """Top-1 agreement of logits [..., V] with reference [..., V], overall and at the reference's
    confident positions (None where there are none), their share, and the noise σ relative to the
    logits' own spread."""
    logits, reference = logits.float(), reference.float()
    same = logits.argmax(-1) == reference.argmax(-1)
    sigma = (logits - reference).std(-1)
    top2 = reference.topk(2, -1).values
    confident = (top2[..., 0] - top2[..., 1]) > CONFIDENT_SIGMAS * sigma
    return {"top1_agreement": same.float().mean().item(),
            "confident_share": confident.float().mean().item(),
            "confident_top1_agreement": same[confident].float().mean().item() if confident.any() else None,
            "noise_over_logit_std": (sigma.mean() / reference.std(-1).mean()).item()}
