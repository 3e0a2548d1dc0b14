"""Top-1 agreement where the reference is confident beyond the noise (shardspec.testing.agreement)."""

from __future__ import annotations

import torch

from shardspec.testing.agreement import CONFIDENT_SIGMAS, top1_agreement


def test_only_margins_beyond_the_noise_count_as_confident_and_agreement_is_counted_there():
    g = torch.Generator().manual_seed(0)
    reference = torch.randn(400, 64, generator=g)
    reference[:200, 0] += 50.0  # half the positions: a wide top-1 margin
    noise = 0.1 * torch.randn(400, 64, generator=g)
    result = top1_agreement(reference + noise, reference)
    margins = reference.topk(2, -1).values
    expected = (margins[:, 0] - margins[:, 1]) > CONFIDENT_SIGMAS * noise.std(-1)
    assert result["confident_share"] == expected.float().mean().item()
    assert expected[:200].all() and result["confident_top1_agreement"] == 1.0
    assert 0 < result["noise_over_logit_std"] < 0.2


def test_a_flip_at_a_confident_position_lowers_the_confident_agreement():
    reference = torch.zeros(4, 1000)
    reference[:, 0] = 10.0
    logits = reference + 0.01 * torch.randn(4, 1000, generator=torch.Generator().manual_seed(1))
    logits[3, 5] = 11.0  # position 3 now picks token 5: one logit moved, the noise over 1000 stays small
    result = top1_agreement(logits, reference)
    assert result["top1_agreement"] == 0.75
    assert result["confident_share"] == 1.0 and result["confident_top1_agreement"] == 0.75


def test_no_confident_position_gives_none():
    reference = torch.zeros(3, 8)  # every margin is 0
    assert top1_agreement(reference + 1.0, reference)["confident_top1_agreement"] is None
