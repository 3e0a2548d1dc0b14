"""What a forward pass needs to know about the sequences in it, and the layers that keep state per
cache slot."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn


@dataclass
class Batch:
    """Where the T new tokens of each of B sequences go: cache slot and absolute positions. A
    speculative pass also carries what its recurrent layers leave for the commit (`saved`): it
    belongs to this pass, not to the layers, so passes of different micro-batches can interleave."""

    slots: torch.Tensor | None  # [B] long; None: no cache at all (training, scoring whole texts)
    positions: torch.Tensor  # [B, T] long, ascending in each row
    kv_len: int  # keys to attend over: at least max(positions) + 1 (a context bucket may be more)
    speculative: bool = False  # recurrent layers leave their states alone until commit() (verify passes)
    tail: bool = False  # every row's positions are kv_len - T .. kv_len - 1 (prefill passes)
    block_tables: torch.Tensor | None = None  # [B, max_blocks] int32: each row's cache blocks, in order
    saved: dict[CachedLayer, Any] = field(default_factory=dict)  # a speculative pass's inputs, per layer

    @classmethod
    def uncached(cls, batch_size: int, length: int, device: torch.device) -> Batch:
        """Whole sequences from position 0 with no cache: attention stays within the input,
        recurrent layers start from zero state and nothing is written anywhere."""
        positions = torch.arange(length, device=device).expand(batch_size, -1)
        return cls(None, positions, length)


class CachedLayer(nn.Module):
    """A layer that keeps state per cache slot (a KV cache, a recurrent state). Models find theirs
    by this type to allocate, reset and commit them (models.base.CausalLM)."""

    def allocate(self, num_slots: int, max_len: int, dtype: torch.dtype, device: torch.device) -> int:
        """(Re)allocate the state of num_slots slots of up to max_len positions; returns its bytes."""
        raise NotImplementedError

    def reset(self, slots: torch.Tensor) -> None:
        """Clear the state of slots given to new sequences (state indexed by position needs nothing)."""

    def commit(self, saved: Any, slots: torch.Tensor, index: torch.Tensor) -> None:
        """After a speculative pass that left `saved` in Batch.saved: advance each slot's state past
        tokens 0..index[b] of that pass. Positional state (a KV cache) needs nothing: the entries
        past the accepted ones are overwritten by the next pass."""

    def snapshot(self, slots: torch.Tensor) -> Any:
        """A copy of the slots' state that `restore` puts back (None: positional state, nothing to keep)."""
        return None

    def restore(self, snapshot: Any, slots: torch.Tensor) -> None:
        """Put back the state `snapshot` copied from these slots."""
