"""Short prefills replayed from CUDA graphs: the new tokens of a conversation's next turn.

A turn whose conversation is cached prefills only its new tokens, tens of them, from the state the
turn before saved. Run eagerly, that pass is hundreds of kernel launches from Python: on a 9B-class
model about 50 ms of the host's time for about 10 ms of the device's (docs/benchmarks.md). So a whole
model (a single stage) captures, at load, the prefill of one sequence's next TAIL_BUCKETS[i] tokens
from any position, padded past its own (Batch.lengths):

- the recurrent layers keep the state after the sequence's last token;
- attention reads the cache in place and writes the padding's K/V past the sequence's end, where
  the sequence's next tokens write theirs before anything reads those positions;
- the MTP layer's entries past the end likewise (the first token's entry is written after it);
- a prefix cache's save within the piece (Batch.state_saves) writes the recurrent states after its
  position to the saved state's rows, and the hidden state before it beside them, in the same pass
  (one replay, not a pass on each side of the save); a piece without one saves to scratch rows.

With MTP a second graph pairs the token sampled from the pass's last hidden state with that state
and chains the k drafts (for a sequence whose drafts are not biased or masked). The caller samples
in between, on the host, as after an eager prefill.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from shardspec.shard_worker.graphs import capture

TAIL_BUCKETS = (16, 32, 64, 128)  # the padded lengths captured; longer pieces prefill eagerly

# (ids [1, T], positions [1, T], slots [1], lengths [1], hidden_before [1, 1, H] or None, kv_len, saves: None or
# (save_at [1], recurrent-state rows [1], saved hidden-state rows [1])) -> the target's hidden state at the last
# of the row's own tokens, [1, H]
Saves = tuple[torch.Tensor, torch.Tensor, torch.Tensor]
PrefillFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None, int,
                      Saves | None], torch.Tensor]
# (first token [1, 1], the hidden state before it [1, H], slots [1], lengths [1] (its position + 1),
# kv_len or None: the widest, as in a graph) -> the k drafts [1, k]
FollowFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, int | None], torch.Tensor]


def tail_bucket(n: int) -> int | None:
    """The padded length of a piece of n tokens (None: longer than the largest bucket)."""
    return next((size for size in TAIL_BUCKETS if size >= n), None)


@dataclass
class _Tail:
    """One bucket's graph and the tensors it reads and writes."""

    ids: torch.Tensor  # [1, size]
    positions: torch.Tensor  # [1, size]
    slots: torch.Tensor  # [1]
    lengths: torch.Tensor  # [1]
    hidden_before: torch.Tensor | None  # [1, 1, H] with MTP
    saves: Saves  # a save within the piece: after save_at tokens, into these rows (PrefillFn)
    graph: torch.cuda.CUDAGraph | None = None
    last: torch.Tensor | None = None  # the graph's output [1, H]


class TailPasses:
    """The prefill of one sequence's pieces of up to TAIL_BUCKETS[-1] tokens, padded to their bucket,
    and with MTP (draft_len > 0) the first drafts after them; from CUDA graphs (`graphs`), else run
    eagerly on the same padded inputs (the CPU tests' way to check the padding). `context`: the
    widest position + 1 a sequence's table holds; a graphed piece without a save writes one to the
    scratch slot's state row and to saved hidden-state row `scratch_hidden`."""

    def __init__(self, prefill_fn: PrefillFn, follow_fn: FollowFn, device: torch.device, hidden_size: int,
                 dtype: torch.dtype, draft_len: int, context: int, scratch_slot: int, graphs: bool,
                 scratch_hidden: int | None = None):
        self.prefill_fn, self.follow_fn = prefill_fn, follow_fn
        self.device, self.draft_len, self.context = device, draft_len, context
        assert scratch_hidden is not None or not graphs, "graphed pieces without a save need a scratch hidden row"
        self.scratch = (scratch_slot, scratch_hidden)
        self.graphs = graphs and device.type == "cuda"
        self.replays = 0  # pieces prefilled through this (graphed or not)
        self.pool = torch.cuda.graph_pool_handle() if self.graphs else None
        self.tails: dict[int, _Tail] = {}
        scratch = torch.tensor([scratch_slot], device=device)
        # (captured from position 1, as the MTP layer's first entry is the position before: buckets that fit)
        for size in [size for size in TAIL_BUCKETS if self.graphs and size < context]:
            self.tails[size] = _Tail(
                torch.zeros(1, size, dtype=torch.long, device=device),
                torch.arange(1, size + 1, device=device)[None], scratch.clone(),
                torch.full((1,), size, device=device),
                torch.zeros(1, 1, hidden_size, dtype=dtype, device=device) if draft_len else None,
                (torch.ones(1, dtype=torch.long, device=device), scratch.clone(),
                 torch.full((1,), scratch_hidden, device=device)))
        # the follow graph's inputs: the first token, the hidden state before it, its slot and length
        self.first = torch.zeros(1, 1, dtype=torch.long, device=device)
        self.last = torch.zeros(1, hidden_size, dtype=dtype, device=device)
        self.follow_slots, self.follow_lengths = scratch.clone(), torch.ones(1, dtype=torch.long, device=device)
        self.follow_graph: torch.cuda.CUDAGraph | None = None
        self.drafts: torch.Tensor | None = None

    def fits(self, start: int, n: int) -> bool:
        """Whether a piece of n tokens from position `start` prefills here."""
        size = tail_bucket(n)
        return size is not None and start + size <= self.context and (size in self.tails or not self.graphs)

    def prefill(self, ids: torch.Tensor, start: int, slots: torch.Tensor, hidden_before: torch.Tensor | None,
                save: tuple[int, int, int] | None = None) -> torch.Tensor:
        """The piece ids [1, n] (fits) from position `start` into slots [1]'s caches, after
        `hidden_before` [1, 1, H] (the target's hidden state at start - 1; with MTP): the hidden state
        at its last token, [1, H]. `save` (tokens, recurrent-state row, saved hidden-state row): the
        states after the piece's first tokens (1 to n) into those rows."""
        n = ids.shape[1]
        size = tail_bucket(n)
        self.replays += 1
        if not self.graphs:
            positions = torch.arange(start, start + size, device=self.device)[None]
            lengths = torch.tensor([n], device=self.device)
            saves = None if save is None else tuple(torch.tensor([x], device=self.device) for x in save)
            return self.prefill_fn(F.pad(ids, (0, size - n)), positions, slots, lengths, hidden_before, start + size,
                                   saves)
        tail = self.tails[size]
        tail.ids[:, n:].zero_()
        tail.ids[:, :n].copy_(ids)
        tail.positions.copy_(torch.arange(start, start + size, device=self.device)[None])
        tail.slots.copy_(slots)
        tail.lengths.fill_(n)
        if tail.hidden_before is not None:
            tail.hidden_before.copy_(hidden_before)
        for into, value in zip(tail.saves, save or (1, *self.scratch)):
            into.fill_(value)
        tail.graph.replay()
        return tail.last.clone()

    def follow(self, first: int, last: torch.Tensor, slots: torch.Tensor, length: int) -> torch.Tensor:
        """With MTP: the first token sampled after a prefill of `length` tokens, paired with the hidden
        state `last` [1, H] at its last token, then the k drafts chained from it: [1, k]."""
        if not self.graphs:
            return self.follow_fn(torch.tensor([[first]], device=self.device), last, slots,
                                  torch.tensor([length], device=self.device), length)
        self.first.fill_(first)
        self.last.copy_(last)
        self.follow_slots.copy_(slots)
        self.follow_lengths.fill_(length)
        self.follow_graph.replay()
        return self.drafts

    def capture_all(self) -> int:
        """Capture every bucket's graph and the follow graph on the scratch slot (each runs twice first,
        as a warm-up: its writes go to the scratch slot's state and block). Returns the graphs captured."""
        if not self.graphs:
            return 0
        for tail in reversed(self.tails.values()):  # largest first: the smaller reuse its temporaries
            tail.graph, tail.last = capture(lambda t=tail: self.prefill_fn(
                t.ids, t.positions, t.slots, t.lengths, t.hidden_before, self.context, t.saves), self.device,
                self.pool)
        if self.draft_len:
            self.follow_graph, self.drafts = capture(lambda: self.follow_fn(
                self.first, self.last, self.follow_slots, self.follow_lengths, None), self.device, self.pool)
        return len(self.tails) + bool(self.draft_len)

    def close(self) -> None:
        self.tails.clear()
        self.follow_graph = self.drafts = None
