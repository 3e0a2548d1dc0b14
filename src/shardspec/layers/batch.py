"""What a forward pass needs to know about the sequences in it."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class Batch:
    """Where the T new tokens of each of B sequences go: cache slot and absolute positions."""

    slots: torch.Tensor  # [B] long
    positions: torch.Tensor  # [B, T] long
    kv_len: int  # keys to attend over: max(positions) + 1
    keep_states: bool = False  # recurrent layers keep the state after every token (for rollback)
