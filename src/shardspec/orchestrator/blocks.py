"""The workers' K/V blocks, granted by the orchestrator alone.

Every rank of every stage holds a pool of K/V blocks (of its own layers and heads) under the same
block ids; the orchestrator decides which sequence holds which ids and tells all of them in each
step (PrefillSpec.blocks, StepRequest.grow), so the ranks and stages never disagree. A block given
back can be granted again at once: each worker takes its messages in order, so the step that reuses
a block runs after every step that wrote it for its last owner.

A block may have several holders: the sequences whose tables list it and the prefix cache's
entries (orchestrator.prefix). It is free once the last of them gives it back; when too few are
free, `take` asks the prefix cache to evict what no sequence uses.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from shardspec.protocol.messages import LoadReply


@dataclass(frozen=True)
class Paging:
    """What every worker reported at load: the blocks all of them hold (the fewest), positions per
    block, positions one step may write past a sequence's length, a sequence's most positions, the
    saved recurrent states all of them hold for the prefix cache, whether a finished sequence's
    state stays for its release to save (on every worker), and the most new tokens a prefill from a
    saved state runs as one pass with a state saved within it (on every worker: LoadReply)."""

    blocks: int
    block_tokens: int
    step_span: int
    context: int  # max_seq_len + step_span - 1: what a sequence's blocks never need to pass
    states: int = 0
    keeps_finished_state: bool = False
    one_pass_tokens: int = 0

    @classmethod
    def of(cls, replies: list[LoadReply]) -> Paging:
        first = replies[0]
        return cls(min(r.kv_blocks for r in replies), first.block_tokens, first.step_span,
                   first.max_seq_len + first.step_span - 1, min(r.prefix_states for r in replies),
                   all(r.keeps_finished_state for r in replies), min(r.one_pass_tokens for r in replies))

    def blocks_for(self, positions: int) -> int:
        return -(-min(positions, self.context) // self.block_tokens)

    @property
    def positions(self) -> int:
        return self.blocks * self.block_tokens


class BlockPool:
    """Block ids with their holders counted; `evict` (set by the prefix cache) frees one block the
    cache alone holds and says whether it could."""

    def __init__(self, paging: Paging):
        self.paging = paging
        self.free = list(range(paging.blocks - 1, -1, -1))
        self.holders = [0] * paging.blocks
        self.evict: Callable[[], bool] = lambda: False
        self.evictable: Callable[[], int] = lambda: 0  # blocks `evict` could free

    def take(self, n: int) -> list[int] | None:
        """n blocks, or None (and nothing taken) when fewer are free or can be freed."""
        if n > len(self.free) + self.evictable():
            return None
        while n > len(self.free):
            if not self.evict():
                return None
        taken = self.free[len(self.free) - n :][::-1]
        del self.free[len(self.free) - n :]
        for block in taken:
            self.holders[block] = 1
        return taken

    def hold(self, block: int) -> None:
        """One more holder of a taken block."""
        self.holders[block] += 1

    def give_back(self, blocks: list[int]) -> None:
        """One holder fewer of each block; a block without holders is free (the last given first)."""
        for block in reversed(blocks):
            self.holders[block] -= 1
            if self.holders[block] == 0:
                self.free.append(block)

    @property
    def usage(self) -> float:
        """The fraction of blocks that sequences hold (cached blocks no sequence uses count as free)."""
        if not self.paging.blocks:
            return 0.0
        return 1.0 - (len(self.free) + self.evictable()) / self.paging.blocks
