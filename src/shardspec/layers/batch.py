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
    # a prefill padded past its tokens (tails.TailPasses): row b's first lengths[b] tokens are its own,
    # the recurrent layers keep the state after them, and attention reads and writes the cache in place
    # (the tokens after them write K/V past the sequence's end, which its next tokens overwrite)
    lengths: torch.Tensor | None = None
    # (save_at [B], rows [B]): the recurrent layers also write the state after row b's first save_at[b]
    # tokens (1 <= save_at[b] <= its length) to state row rows[b] (a prefix cache's save within a padded pass)
    state_saves: tuple[torch.Tensor, torch.Tensor] | None = None
    saved: dict[CachedLayer, Any] = field(default_factory=dict)  # a speculative pass's inputs, per layer

    @classmethod
    def uncached(cls, batch_size: int, length: int, device: torch.device) -> Batch:
        """Whole sequences from position 0 with no cache: attention stays within the input,
        recurrent layers start from zero state and nothing is written anywhere."""
        positions = torch.arange(length, device=device).expand(batch_size, -1)
        return cls(None, positions, length)


BLOCK_TOKENS = 32  # positions per K/V block: the attention kernel's key tile


@dataclass
class CacheShape:
    """What a model's caches hold: `slots` sequences' recurrent states and block tables, a pool of
    `blocks` K/V blocks of `block_tokens` positions, and `saved` more recurrent states (rows slots ..
    slots + saved - 1, which the prefix cache saves and restores: CachedLayer.copy_states). tables
    [slots, max_blocks] (int32, shared by every attention layer): position p of the sequence in slot s
    lives in block tables[s, p // block_tokens]."""

    slots: int
    blocks: int
    tables: torch.Tensor
    block_tokens: int = BLOCK_TOKENS
    saved: int = 0

    @classmethod
    def contiguous(cls, num_slots: int, max_len: int, device: torch.device) -> CacheShape:
        """Each slot its own run of blocks for max_len positions (tests and benchmarks that drive a
        model without a runner)."""
        per = -(-max_len // BLOCK_TOKENS)
        tables = torch.arange(num_slots * per, dtype=torch.int32, device=device).view(num_slots, per)
        return cls(num_slots, num_slots * per, tables)


class CachedLayer(nn.Module):
    """A layer that keeps state per cache slot (a recurrent state) or per K/V block. Models find
    theirs by this type to allocate, reset and commit them (models.base.CausalLM)."""

    def allocate(self, shape: CacheShape, dtype: torch.dtype, device: torch.device) -> int:
        """(Re)allocate the state of `shape`; returns its bytes."""
        raise NotImplementedError

    def bytes_per(self, dtype: torch.dtype) -> tuple[int, int]:
        """(Bytes of one slot's state, bytes of one K/V block), for sizing a cache by memory."""
        raise NotImplementedError

    def reset(self, slots: torch.Tensor) -> None:
        """Clear the state of slots given to new sequences (state indexed by position needs nothing)."""

    def copy_states(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Copy the recurrent state of rows `src` to rows `dst` (slots and saved states alike; state
        indexed by position has none)."""

    def copy_blocks(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Copy K/V blocks `src` to blocks `dst` (state per slot has none)."""

    def commit(self, saved: Any, slots: torch.Tensor, index: torch.Tensor) -> None:
        """After a speculative pass that left `saved` in Batch.saved: advance each slot's state past
        tokens 0..index[b] of that pass. Positional state (a KV cache) needs nothing: the entries
        past the accepted ones are overwritten by the next pass."""

    def snapshot(self, slots: torch.Tensor) -> Any:
        """A copy of the slots' state that `restore` puts back (None: positional state, nothing to keep)."""
        return None

    def restore(self, snapshot: Any, slots: torch.Tensor) -> None:
        """Put back the state `snapshot` copied from these slots."""
