"""Presence, frequency and repetition penalties on the target's logits, per sequence.

They change the distribution the target samples from (and greedy's argmax), so the speculative
step applies them before it accepts: position j of a verify pass is penalised with the output so
far plus the drafts before j, which makes MTP output exactly what it is without MTP."""

from __future__ import annotations

import torch

from shardspec.protocol.messages import SamplingParams


class TokenCounts:
    """One sequence's output token counts and its prompt's tokens, on the device."""

    def __init__(self, prompt: torch.Tensor, vocab: int):
        self.output = torch.zeros(vocab, dtype=torch.float32, device=prompt.device)
        self.in_prompt = torch.zeros(vocab, dtype=torch.bool, device=prompt.device).index_fill_(0, prompt.long(), True)

    def add(self, tokens: list[int]) -> None:
        if tokens:
            index = torch.tensor(tokens, device=self.output.device)
            self.output.index_add_(0, index, torch.ones(len(tokens), device=self.output.device))

    def penalise(self, logits: torch.Tensor, drafts: list[int], params: SamplingParams) -> torch.Tensor:
        """Penalised copies of logits [P, V] (fp32), row j counting drafts[:j] as output too."""
        rows = logits.shape[0]
        counts = self.output.expand(rows, -1).clone()
        for j, draft in enumerate(drafts[: rows - 1]):
            counts[j + 1 :, draft] += 1
        logits = logits.float()
        if params.repetition_penalty != 1.0:
            seen = (counts > 0) | self.in_prompt
            r = params.repetition_penalty
            logits = torch.where(seen, torch.where(logits > 0, logits / r, logits * r), logits)
        return logits - params.frequency_penalty * counts - params.presence_penalty * (counts > 0).float()
