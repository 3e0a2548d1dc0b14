"""A tree of guesses in flight across pipeline stages (lookahead "tree").

A lone sequence's step n + 1 is on its way through the stages; its record decides how many of its k
drafts it keeps (a) and the token the target adds after them (c), and the last stage then drafts
the k drafts of step n + 2 (e). Without a guess the first stage waits for that record before it can
run step n + 2. With the tree, the last stage, once step n's record has left, sends its likeliest
outcomes of step n + 1 as branches (a, c, e): for each acceptance length a, the MTP head's top
choices for c at that position (not the draft it rejects), each with k drafts chained on from it,
ranked by the head's probability of the path (the drafts a keeps, then c).
A stage before the last runs step n + 2 for every branch at once, as one batched verify pass whose
rows sit in branch slots (BranchSlots): each a fork of the sequence's recurrent state, committed
as if step n + 1 kept that branch's a drafts, with private copies of the K/V blocks the branch
writes. The record of step n + 1 then names the branch that holds (its a, c and drafts), whose
blocks and state become the sequence's, or none: the pass runs again on the record's tokens, as
without a guess. The last stage takes the held branch's row of the pass and drops the others; a
middle stage that has the record when the tree comes passes on the held row alone
(stage.ForwardingStage._cut_tree).

The record, not the guess, decides every token: a branch is only a precomputation. So that the
output stays the one of one worker bit for bit in deterministic mode (greedy and sampled with a
seed, whose draws depend on the drafts), a branch holds there only where its drafts equal those the
last stage chains anyway; otherwise the last stage keeps the held branch's drafts (Decoder
._follow_pass), which changes no distribution (any drafts give the target's).

The width follows the tokens a second measured at each width (TreeGuesser): where the tree does
not pay (a short link, drafts it makes worse) it is none.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import torch

from shardspec.layers.batch import CachedLayer

# the most branches a step carries (the widest tree pass: 64 tokens, within a stage link's frame bound)
MAX_BRANCHES = 16
CANDIDATES = 4  # tokens c considered per acceptance length
WIDTHS = (0, 2, 4, 8, 16)  # the widths the adaptive choice measures (0: no tree), each wider while it pays
SETTLE = 2  # lone steps after a change of width that still run trees of the width before: not counted
BLOCK = 6  # lone steps counted per measurement of a width
EXPLORE_EVERY = 6  # every this many blocks, a width next to the best runs
MARGIN = 0.1  # a wider tree counts as faster only by more than this share (a tree costs where it does not pay)


@dataclass(frozen=True)
class Branch:
    """One outcome of the step in flight: it keeps `accepted` drafts, the target adds `token`, and the
    next step's drafts are `drafts`."""

    accepted: int
    token: int
    drafts: tuple[int, ...]

    def flat(self) -> list[int]:
        return [self.accepted, self.token, *self.drafts]


def flatten(branches: list[Branch]) -> list[int]:
    """Branches as a Guesses message carries them: (a, c, e1..ek) after each other."""
    return [value for branch in branches for value in branch.flat()]


def unflatten(values: list[int], draft_len: int, vocab: int) -> list[Branch]:
    """The branches of a Guesses entry; ValueError when it is not whole branches of valid ids."""
    width = draft_len + 2
    if len(values) % width or len(values) > MAX_BRANCHES * width:
        raise ValueError(f"a tree's guesses are up to {MAX_BRANCHES} branches of {width} numbers")
    branches = [
        Branch(values[i], values[i + 1], tuple(values[i + 2 : i + width])) for i in range(0, len(values), width)
    ]
    for b in branches:
        if not 0 <= b.accepted <= draft_len or not all(0 <= t < vocab for t in (b.token, *b.drafts)):
            raise ValueError(f"a branch keeps 0..{draft_len} drafts and holds token ids in [0, {vocab})")
    return branches


def held(branches: list[Branch], accepted: int, token: int, drafts: list[int]) -> int:
    """The row of the branch the record (accepted drafts, new token, next drafts) proves, or -1."""
    return next(
        (i for i, b in enumerate(branches) if (b.accepted, b.token, list(b.drafts)) == (accepted, token, list(drafts))),
        -1,
    )


def kept_drafts(
    guess: torch.Tensor, index: torch.Tensor, new_tokens: torch.Tensor, draft_len: int
) -> torch.Tensor | None:
    """The drafts [1, k] of the branch among the row's guess columns [1, W * (k + 2)] whose
    acceptance and token the verify pass just proved (one sequence, eagerly), or None."""
    rows = guess[0].view(-1, draft_len + 2)
    match = (rows[:, 0] == index[0]) & (rows[:, 1] == new_tokens[0])
    hits = match.nonzero()
    return rows[int(hits[0, 0]), 2:][None] if len(hits) else None


def rows_of(saved: dict, rows: list[int]) -> dict:
    """What a speculative pass saved for its commit (Batch.saved), for the given rows of it (repeated
    rows fork one row's inputs into several)."""
    index = torch.tensor(rows)
    return {layer: tuple(t[index.to(t.device)] for t in inputs) for layer, inputs in saved.items()}


def draft_layers(model: Any) -> list:
    """The cached layers of a model's MTP module (all its cached layers where it has none by that name):
    the only ones a branch's draft chain writes."""
    mtp = getattr(model, "mtp", None)
    return [m for m in mtp.modules() if isinstance(m, CachedLayer)] if mtp is not None else model.cached_layers()


class BranchSlots:
    """Cache rows set aside for branches: `width` slots (recurrent states and block-table rows) after
    the sequences' own and the scratch slot, and two K/V blocks each after the scratch block (a
    branch writes k + 1 <= 9 positions: at most two blocks)."""

    def __init__(self, first_slot: int, first_block: int, width: int, tables: torch.Tensor, block_tokens: int):
        self.first_slot, self.first_block, self.width = first_slot, first_block, width
        self.tables, self.block_tokens = tables, block_tokens
        self.private: list[list[tuple[int, int]]] = []  # per branch of the last fork: (table entry, its block)

    def fork(self, model: Any, slot: int, starts: list[int], span: int, layers: list | None = None) -> torch.Tensor:
        """A branch slot per start: `slot`'s recurrent state and block table, with private copies of
        the blocks that hold positions start .. start + span - 1 (what the branch writes), in the
        cached layers `layers` (default: all the model's)."""
        device = self.tables.device
        slots = torch.arange(self.first_slot, self.first_slot + len(starts), device=device)
        layers = model.cached_layers() if layers is None else layers
        for layer in layers:
            layer.copy_states(torch.full_like(slots, slot), slots)
        self.tables[slots] = self.tables[slot].clone()
        src, dst, self.private = [], [], []
        bt = self.block_tokens
        for i, start in enumerate(starts):
            entries = range(start // bt, (start + span - 1) // bt + 1)
            self.private.append([(entry, self.first_block + 2 * i + j) for j, entry in enumerate(entries)])
            for entry, block in self.private[-1]:
                src.append(int(self.tables[slot, entry]))
                dst.append(block)
                self.tables[self.first_slot + i, entry] = block
        src, dst = torch.tensor(src, device=device), torch.tensor(dst, device=device)
        for layer in layers:
            layer.copy_blocks(src, dst)
        return slots

    def take(self, model: Any, branch: int, slot: int) -> None:
        """Branch `branch` of the last fork becomes `slot`'s: its blocks over the slot's, its state."""
        device = self.tables.device
        entries, blocks = zip(*self.private[branch])
        own = self.tables[slot, list(entries)].long()
        model.copy_blocks(torch.tensor(blocks, device=device), own)
        model.copy_states(torch.tensor([self.first_slot + branch], device=device), torch.tensor([slot], device=device))


class TreeGuesser:
    """The last stage's side: the branches of the step in flight, made once its record has left, and
    the tree's width. Adaptive width: widths of WIDTHS (0: no tree) run for blocks of lone steps and
    the tokens a second of each block are measured (the hit rate, the drafts the branches make, the
    stages' passes over more rows and the link's idle time all show in it): from none, each wider
    one while the widest so far is the fastest (by MARGIN); then the fastest runs on (the narrowest
    within MARGIN of it), and one next to it every EXPLORE_EVERY blocks. The ranks of a stage agree on each block's
    time (one all-reduce a block), so that they choose alike."""

    def __init__(self, draft_len: int, fixed: int = 0):
        self.k = draft_len
        self.max_width = min(MAX_BRANCHES, 64 // (draft_len + 1))
        self.fixed = min(fixed, self.max_width)  # branches per tree; 0: adaptive
        self.order = [w for w in WIDTHS if w <= self.max_width]
        self.rates: dict[int, float] = {}  # tokens a second of lone steps at each width (moving average)
        self.current = self.fixed or self.order[0]
        self.block = (0, 0, 0.0)  # this width's lone steps so far, and the tokens and seconds it counts
        self.last: tuple[int, float] | None = None  # (step, clock) of the last lone step
        self.blocks = 0

    def observe(self, decoder: Any, accepted: int) -> None:
        """A lone step of the decoder, which kept `accepted` drafts."""
        now, last = time.perf_counter(), self.last
        self.last = (decoder.steps, now)
        if self.fixed or last is None or decoder.steps != last[0] + 1:
            return  # (a step in between was not a lone one: the time is not this width's)
        steps, tokens, seconds = self.block
        if steps >= SETTLE:  # (the first steps after a change run trees of the width before)
            tokens, seconds = tokens + accepted + 1, seconds + now - last[1]
        self.block = (steps + 1, tokens, seconds)
        if steps + 1 == SETTLE + BLOCK:
            self._next(decoder)

    def _next(self, decoder: Any) -> None:
        """The width of the next block, from this block's tokens a second (its ranks' mean)."""
        _, tokens, seconds = self.block
        tp = decoder.model.lm_head.tp
        seconds = float(tp.all_reduce(torch.tensor([seconds], device=decoder.device))[0]) / tp.size
        rate = tokens / max(seconds, 1e-9)
        width = self.current
        self.rates[width] = rate if width not in self.rates else 0.5 * (self.rates[width] + rate)
        self.blocks, self.block = self.blocks + 1, (0, 0, 0.0)
        untried = [w for w in self.order if w not in self.rates]
        top = max(self.rates.values())
        best = min(w for w, r in self.rates.items() if r * (1 + MARGIN) >= top)  # (noise: the narrowest near the top)
        i = self.order.index(best)
        if untried and best == max(self.rates):  # the widest so far is the fastest: one wider
            self.current = untried[0]
        elif self.blocks % EXPLORE_EVERY == 0:  # a neighbour, wider and narrower in turn
            wider = self.blocks // EXPLORE_EVERY % 2
            self.current = self.order[min(i + 1, len(self.order) - 1)] if wider else self.order[max(i - 1, 0)]
        else:
            self.current = best

    def width(self) -> int:
        """Branches for the next tree (0: none)."""
        return self.current

    def make(self, decoder: Any, drafts: list[int]) -> list[Branch]:
        """The branches of the one live sequence's step in flight (its `drafts` just sent), likeliest
        first, from where the decoder's chain stopped (its heads; Decoder._chain)."""
        if not self.width():
            return []
        k, model = self.k, decoder.model
        head, token, slots, position, context = decoder.chain_end
        heads = [
            *decoder.chain_heads,
            decoder._mtp(token[:, None], head[:, None], slots, position[:, None], context)[:, 0],
        ]
        drafts = [*drafts, None]
        base = position - (k - 1)  # the chain's first MTP position: head a's entry after c sits at base + a
        probs = torch.softmax(model.lm_head.logits(torch.cat(heads)).float(), -1)  # [k + 1, V]
        # a branch's score: the head's probability of its path, the drafts it keeps and then c (the
        # draft a rejection at a refuses is no c: the target's token differs from it)
        scored, path = [], 1.0
        top = torch.topk(probs, CANDIDATES + 1, -1)
        for a in range(k + 1):
            rejected = drafts[a]
            for p, c in zip(top.values[a].tolist(), top.indices[a].tolist()):
                if c != rejected:
                    scored.append((path * p, a, c))
            if rejected is not None:
                path *= float(probs[a, rejected])
        scored.sort(key=lambda x: -x[0])
        chosen = scored[: self.width()]
        if not chosen:
            return []
        drafts = self._chain_branches(
            decoder,
            [heads[a] for _, a, _ in chosen],
            [c for _, _, c in chosen],
            int(slots[0]),
            [int(base) + a for _, a, _ in chosen],
            context,
        )
        return [Branch(a, c, tuple(e)) for (_, a, c), e in zip(chosen, drafts)]

    def _chain_branches(
        self, decoder: Any, heads: list[torch.Tensor], tokens: list[int], slot: int, starts: list[int], context: int
    ) -> list[list[int]]:
        """k drafts for each branch, chained from its head after its token c at once, each branch in
        a slot forked from the sequence's (its MTP cache up to its start, written past it alone)."""
        slots = decoder.branch_slots.fork(decoder.model, slot, starts, self.k, draft_layers(decoder.model))
        head = torch.cat(heads)
        current = torch.tensor(tokens, device=slots.device)
        positions = torch.tensor(starts, device=slots.device)
        drafts = []
        for i in range(self.k):
            head = decoder._mtp(current[:, None], head[:, None], slots, (positions + i)[:, None], context)[:, 0]
            current = decoder.model.lm_head.draft_argmax(head)
            drafts.append(current)
        return torch.stack(drafts, 1).tolist()
