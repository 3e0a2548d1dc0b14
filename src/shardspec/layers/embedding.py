"""Vocabulary-parallel embedding and LM head: each rank holds a contiguous slice of the vocab."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from shardspec import kernels
from shardspec.layers.linear import linear
from shardspec.layers.parallel import SliceSpec, TPGroup
from shardspec.protocol.messages import DRAFT_HEADS  # how draft_argmax can read the head: see use_draft_kernel


def vocab_range(vocab_size: int, tp: TPGroup) -> tuple[int, int]:
    """This rank's [start, end) of the vocabulary padded up to a multiple of the group size."""
    per = -(-vocab_size // tp.size)
    return tp.rank * per, (tp.rank + 1) * per


class VocabParallelEmbedding(nn.Module):
    def __init__(self, vocab_size: int, dim: int, tp: TPGroup):
        super().__init__()
        self.start, self.end = vocab_range(vocab_size, tp)
        self.weight = nn.Parameter(torch.empty(self.end - self.start, dim), requires_grad=False)
        self.slice_specs = {"weight": SliceSpec(cut=(0, ((self.start, self.end),)))}
        self.tp = tp

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            return F.embedding(ids, self.weight)
        local = ids - self.start
        outside = (local < 0) | (local >= self.weight.shape[0])
        out = F.embedding(local.masked_fill(outside, 0), self.weight)
        out = out.masked_fill(outside[..., None], 0.0)
        return self.tp.all_reduce(out)



class ParallelLMHead(nn.Module):
    """Local logits over this rank's vocab slice; full logits or the argmax on request."""

    block_rows = 0  # batch-invariant mode: see layers.linear.linear

    def __init__(self, vocab_size: int, dim: int, tp: TPGroup):
        super().__init__()
        self.vocab_size = vocab_size
        self.start, self.end = vocab_range(vocab_size, tp)
        self.weight = nn.Parameter(torch.empty(self.end - self.start, dim), requires_grad=False)
        self.slice_specs = {"weight": SliceSpec(cut=(0, ((self.start, self.end),)))}
        self.tp = tp
        self.draft_weight: torch.Tensor | None = None  # see use_draft_kernel
        self.draft_scale: torch.Tensor | None = None

    def raw_logits(self, h: torch.Tensor) -> torch.Tensor:
        """This rank's logits as the matmul gives them (the weight's dtype, padding rows included):
        what `logits_of` and `argmax_of` take, so that one read of the head serves both."""
        return linear(h, self.weight, self.block_rows)

    def local_logits(self, h: torch.Tensor) -> torch.Tensor:
        return self._local(self.raw_logits(h))

    def _local(self, raw: torch.Tensor, copy: bool = False) -> torch.Tensor:
        logits = raw.to(torch.float32, copy=copy)
        pad = self.end - self.vocab_size  # padding rows must never win an argmax or get mass
        if pad > 0:
            logits[..., max(0, logits.shape[-1] - pad) :] = float("-inf")
        return logits

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        """Full-vocabulary fp32 logits on every rank: [..., vocab_size]."""
        return self.logits_of(self.raw_logits(h))

    def logits_of(self, raw: torch.Tensor) -> torch.Tensor:
        """`logits` from this rank's raw_logits (a new tensor)."""
        return self.tp.all_gather(self._local(raw, copy=True), dim=-1)[..., : self.vocab_size]

    def argmax(self, h: torch.Tensor) -> torch.Tensor:
        """Global argmax from one (max, index) pair per rank; ties go to the lowest index."""
        return self.argmax_of(self.raw_logits(h))

    def argmax_of(self, raw: torch.Tensor) -> torch.Tensor:
        """`argmax` from this rank's raw_logits."""
        value, index = self._local(raw).max(dim=-1)
        return self._global(value, index)

    def use_draft_kernel(self, mode: str) -> None:
        """How draft_argmax reads the head: "cublas" (the logits, as argmax does), "bf16" (the head
        kernel on this weight: no logits) or "fp8" (the kernel on an fp8 copy: half the bytes)."""
        if mode not in DRAFT_HEADS:
            raise ValueError(f"draft head must be cublas, bf16 or fp8, got {mode!r}")
        self.draft_weight = self.draft_scale = None
        if mode == "bf16":
            self.draft_weight = self.weight.data  # (a plain tensor: not registered as a parameter)
        elif mode == "fp8":
            self.draft_weight, self.draft_scale = kernels.head.quantize_rows(self.weight)

    def draft_argmax(self, h: torch.Tensor) -> torch.Tensor:
        """argmax for the MTP drafts: through the head kernel where use_draft_kernel chose it (a
        draft need not equal the target's argmax bit for bit; the verify pass decides the output)."""
        rows = h.reshape(-1, h.shape[-1])
        weight = self.draft_weight
        if weight is None or not kernels.enabled(h) or rows.shape[0] > kernels.head.MAX_ROWS:
            return self.argmax(h)
        valid = max(0, min(self.end, self.vocab_size) - self.start)
        value, index = kernels.head.argmax(rows, weight, self.draft_scale, valid)
        return self._global(value.view(h.shape[:-1]), index.view(h.shape[:-1]))

    def _global(self, value: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
        """The vocabulary-wide argmax from this rank's (max, local index)."""
        if self.tp.size == 1:
            return index
        pairs = torch.stack([value, (index + self.start).float()], dim=-1)  # exact below 2**24
        gathered = self.tp.all_gather(pairs[None], dim=0)  # [tp, ..., 2]
        best_rank = gathered[..., 0].argmax(dim=0, keepdim=True)  # first max = lowest vocab slice
        return gathered[..., 1].gather(0, best_rank)[0].long()
