"""Structured output in the last stage's steps: the masks of a verify pass, the rows a grammar alone
shapes (masked together), the draft pass's forced drafts, and the per-step budget of a grammar's
host time. The matchers themselves are layers.grammar.Constraint."""

from __future__ import annotations

import torch

from shardspec.layers.grammar import apply_masks, single
from shardspec.layers.parallel import TPGroup
from shardspec.protocol.messages import FAILED
from shardspec.shard_worker.sequences import Sequence


def grammar_masks(seqs: list[Sequence], rows: int) -> dict[int, torch.Tensor]:
    """Each constrained sequence's `rows` (k + 1) verify rows' masks (Constraint.masks), by sequence."""
    return {s.seq: s.grammar.masks(s.drafts, rows) for s in seqs if s.grammar is not None}


def mask_words(seqs: list[Sequence | None], vocab: int, counters) -> torch.Tensor:
    """The bit masks [B, ceil(V / 32)] (int32, host) of a greedy pass at k = 0, a row per sequence:
    its grammar's next mask, or every token where it has none (or the row's sequence is gone). Counts
    the constrained rows, and those whose mask allows one token, into `counters` (SpecCounters)."""
    masks = {i: s.grammar.masks([], 1)[0] for i, s in enumerate(seqs)
             if s is not None and s.grammar is not None and not s.finished}
    width = max([(vocab + 31) // 32, *(len(m) for m in masks.values())])  # (llguidance's may be wider)
    words = torch.full((len(seqs), width), -1, dtype=torch.int32)
    for i, mask in masks.items():
        words[i] = 0  # (tokens past its mask: refused)
        words[i, : len(mask)] = mask
        if not seqs[i].grammar.failure:
            counters.constrained_counted(1, int(single(mask.numpy()) is not None))
    return words


def grammar_rows(seqs: list[Sequence], logits: torch.Tensor | None, masks: dict[int, torch.Tensor]
                 ) -> dict[int, tuple[torch.Tensor, bool, list[int], list[int]]]:
    """The rows whose logits a grammar alone shapes (no penalties, bias or min_tokens), masked
    together and read off the device in one copy: {row: (its target logits [k+1, V], unusable,
    their argmax, which of them allow a single token)}."""
    if logits is None:
        return {}
    rows = [i for i, s in enumerate(seqs) if s.seq in masks and not s.grammar.failure and s.counts is None
            and s.bias is None and s.early <= 0]
    if not rows:
        return {}
    targets = apply_masks(logits[rows], torch.stack([masks[seqs[i].seq] for i in rows]))  # [R, k+1, V]
    finite = torch.isfinite(targets)
    bad = (torch.isnan(targets) | torch.isposinf(targets)).flatten(1).any(1) | ~finite.any(-1).all(-1)
    facts = torch.cat([bad[:, None].long(), targets.argmax(-1), (finite.sum(-1) == 1).long()], 1).tolist()
    width = targets.shape[1]
    return {i: (targets[j], bool(f[0]), f[1 : 1 + width], f[1 + width :]) for j, (i, f) in enumerate(zip(rows, facts))}


def follow_rows(seqs: list[Sequence], accepted: list[int], tokens: list[int], k: int) -> list[list[int]]:
    """The draft pass's rows: [accepted, new token] each, and under a grammar [..., m, f1..fk]: the m
    tokens the grammar alone allows next (Constraint.forced), which the chain drafts as they are (the
    target accepts them), the device drafting the others as it does unconstrained."""
    if all(s.grammar is None for s in seqs):
        return [[n, token] for n, token in zip(accepted, tokens)]
    rows = []
    for s, n, token in zip(seqs, accepted, tokens):
        forced = s.grammar.forced(k) if s.grammar is not None and not s.finished else []
        rows.append([n, token, len(forced), *forced, *[0] * (k - len(forced))])
    return rows


def fail_over_budget(sequences: dict[int, Sequence], result, budget_s: float, tp: TPGroup, counters,
                     device: torch.device) -> None:
    """Fail, alone, the sequences of a step (its StepResult) whose grammar work in it took over
    `budget_s`, saying why; each rank times its own, so the ranks agree first (one all-reduce, in steps
    with a grammar only: the same steps on every rank; none at TP = 1). Counts the step's grammar time
    into `counters` (SpecCounters)."""
    seqs = [s for s in map(sequences.get, result.seqs)
            if s is not None and s.grammar is not None and s.finished != FAILED]
    if not seqs:
        return
    spent = [s.grammar.spent for s in seqs]
    counters.grammar_s += sum(spent)
    counters.grammar_steps += 1
    over = [float(t > budget_s) for t in spent]
    if tp.size > 1:  # (never a device round trip alone: it would wait for a pass launched ahead behind this step)
        over = tp.all_reduce(torch.tensor(over, device=device)).tolist()
    for s, flag, seconds in zip(seqs, over, spent):
        s.grammar.spent = 0.0
        if flag:
            s.grammar.failure = (f"its grammar's masks took {seconds * 1e3:.0f} ms in one step (on some rank), over "
                                 f"the budget of {budget_s * 1e3:.0f} ms")
            s.finished, s.drafts = FAILED, []
            result.fail(s)
