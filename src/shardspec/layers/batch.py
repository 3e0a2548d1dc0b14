"""What a forward pass needs to know about the sequences in it."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class Batch:
    """Where the T new tokens of each of B sequences go: cache slot and absolute positions."""

    slots: torch.Tensor | None  # [B] long; None: no cache at all (training, scoring whole texts)
    positions: torch.Tensor  # [B, T] long, ascending in each row
    kv_len: int  # keys to attend over: at least max(positions) + 1 (a context bucket may be more)
    speculative: bool = False  # recurrent layers leave their states alone until commit() (verify passes)
    tail: bool = False  # every row's positions are kv_len - T .. kv_len - 1 (prefill passes)

    @classmethod
    def uncached(cls, batch_size: int, length: int, device: torch.device) -> Batch:
        """Whole sequences from position 0 with no cache: attention stays within the input,
        recurrent layers start from zero state and nothing is written anywhere."""
        positions = torch.arange(length, device=device).expand(batch_size, -1)
        return cls(None, positions, length)
