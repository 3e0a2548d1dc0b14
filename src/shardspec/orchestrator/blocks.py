"""The workers' K/V blocks, granted by the orchestrator alone.

Every rank of every stage holds a pool of K/V blocks (of its own layers and heads) under the same
block ids; the orchestrator decides which sequence holds which ids and tells all of them in each
step (PrefillSpec.blocks, StepRequest.grow), so the ranks and stages never disagree. A block given
back can be granted again at once: each worker takes its messages in order, so the step that reuses
a block runs after every step that wrote it for its last owner.
"""

from __future__ import annotations

from dataclasses import dataclass

from shardspec.protocol.messages import LoadReply


@dataclass(frozen=True)
class Paging:
    """What every worker reported at load: the blocks all of them hold (the fewest), positions per
    block, positions one step may write past a sequence's length, and a sequence's most positions."""

    blocks: int
    block_tokens: int
    step_span: int
    context: int  # max_seq_len + step_span - 1: what a sequence's blocks never need to pass

    @classmethod
    def of(cls, replies: list[LoadReply]) -> Paging:
        first = replies[0]
        return cls(min(r.kv_blocks for r in replies), first.block_tokens, first.step_span,
                   first.max_seq_len + first.step_span - 1)

    def blocks_for(self, positions: int) -> int:
        return -(-min(positions, self.context) // self.block_tokens)

    @property
    def positions(self) -> int:
        return self.blocks * self.block_tokens


class BlockPool:
    def __init__(self, paging: Paging):
        self.paging = paging
        self.free = list(range(paging.blocks - 1, -1, -1))

    def take(self, n: int) -> list[int] | None:
        """n blocks, or None (and nothing taken) when fewer are free."""
        if n > len(self.free):
            return None
        taken = self.free[len(self.free) - n :][::-1]
        del self.free[len(self.free) - n :]
        return taken

    def give_back(self, blocks: list[int]) -> None:
        self.free.extend(reversed(blocks))

    @property
    def usage(self) -> float:
        """The fraction of blocks held by sequences."""
        return 1.0 - len(self.free) / self.paging.blocks if self.paging.blocks else 0.0
