"""The device work of a decode step, replayed from CUDA graphs.

A decode step of a large model launches hundreds of kernels; dispatching them one by one from
Python costs far more than the GPU needs to run them. So a step's work is captured as fixed-shape
CUDA graphs per batch bucket (and per context bucket when attention reads a context-sized slice)
and replayed. When every sequence decodes greedily (or under forced acceptance) one `fused` pass
does the whole step on the device: verify, accept, commit, draft. Otherwise the step is two passes
around the host's acceptance decision (rejection sampling): `verify` (the target over each
sequence's pending token and drafts, and the greedy argmax) and `draft` (commit the accepted
prefix, run the MTP head over it, chain k new drafts). The batch is padded to its bucket with rows
that touch only a scratch cache slot. The host uploads one packed int64 tensor per pass.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from shardspec import kernels

BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
MIN_CONTEXT_BUCKET = 256

VerifyFn = Callable[[torch.Tensor, int], tuple[torch.Tensor, torch.Tensor]]  # (packed, context) -> (hidden, argmax)
DraftFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, int], torch.Tensor]  # (packed, accepts, hidden, context)
FusedFn = Callable[[torch.Tensor, int], torch.Tensor]  # (packed, context) -> [B, 2 + k]


def upload(rows: list, device: torch.device, out: torch.Tensor | None = None) -> torch.Tensor:
    """Host ints to a device int64 tensor in one copy (pinned and asynchronous on a GPU)."""
    host = torch.tensor(rows, dtype=torch.long)
    if device.type == "cpu":
        return host
    host = host.pin_memory()
    if out is None:
        return host.to(device, non_blocking=True)
    return out.copy_(host, non_blocking=True)


@dataclass
class _Captured:
    packed: torch.Tensor  # the inputs both graphs read
    accepts: torch.Tensor
    verify: torch.cuda.CUDAGraph
    hidden: torch.Tensor
    argmax: torch.Tensor
    draft: torch.cuda.CUDAGraph | None = None
    drafts: torch.Tensor | None = None
    fused: torch.cuda.CUDAGraph | None = None
    fused_out: torch.Tensor | None = None
    verify_state: object = None  # what the verify graph leaves for the draft graph (DeltaNet inputs)


class StepPasses:
    """fused(rows, context), or verify(rows, context) then draft(accepts); eager or from graphs;
    outputs are valid until the next call. rows: [pending, d1..dk, length, slot, forced] per
    sequence; accepts: [accepted, new token]."""

    def __init__(self, verify_fn: VerifyFn, draft_fn: DraftFn, fused_fn: FusedFn, device: torch.device,
                 draft_len: int, scratch_slot: int, max_context: int, graphs: bool,
                 verify_state: Callable[[], object] = lambda: None):
        self.verify_fn, self.draft_fn, self.fused_fn = verify_fn, draft_fn, fused_fn
        self.verify_state = verify_state
        self.device = device
        self.draft_len = draft_len
        self.pad_row = [0] * (draft_len + 2) + [scratch_slot, -1]
        self.max_context = max_context
        self.graphs = graphs and device.type == "cuda"
        self.captured: dict[tuple[int, int], _Captured] = {}
        self.pool = torch.cuda.graph_pool_handle() if self.graphs else None
        self._last: tuple = ()

    def fused(self, rows: list[list[int]], context: int) -> torch.Tensor:
        B = len(rows)
        bucket = self._bucket(B)
        if bucket is None:  # eager
            return self.fused_fn(upload(rows, self.device), min(context, self.max_context))
        entry = self._entry(bucket, self._context_bucket(context))
        upload(rows + [self.pad_row] * (bucket - B), self.device, out=entry.packed)
        entry.fused.replay()
        return entry.fused_out[:B]

    def verify(self, rows: list[list[int]], context: int) -> tuple[torch.Tensor, torch.Tensor]:
        B = len(rows)
        bucket = self._bucket(B)
        if bucket is None:  # eager
            context = min(context, self.max_context)
            packed = upload(rows, self.device)
            hidden, argmax = self.verify_fn(packed, context)
            self._last = (None, packed, hidden, context)
            return hidden, argmax
        entry = self._entry(bucket, self._context_bucket(context))
        upload(rows + [self.pad_row] * (bucket - B), self.device, out=entry.packed)
        entry.verify.replay()
        self._last = (entry, B)
        return entry.hidden[:B], entry.argmax[:B]

    def draft(self, accepts: list[list[int]]) -> torch.Tensor:
        if self._last[0] is None:
            _, packed, hidden, context = self._last
            return self.draft_fn(packed, upload(accepts, self.device), hidden, context)
        entry, B = self._last
        upload(accepts + [[0, 0]] * (entry.packed.shape[0] - B), self.device, out=entry.accepts)
        entry.draft.replay()
        return entry.drafts[:B]

    def _bucket(self, batch: int) -> int | None:
        return next((b for b in BATCH_BUCKETS if b >= batch), None) if self.graphs else None

    def _context_bucket(self, context: int) -> int:
        if kernels.ENABLED:  # attention reads the cache in place up to each position: any context
            return self.max_context
        return min(self.max_context, max(MIN_CONTEXT_BUCKET, 1 << (context - 1).bit_length()))

    def _entry(self, bucket: int, context: int) -> _Captured:
        entry = self.captured.get((bucket, context))
        if entry is None:
            packed = torch.tensor([self.pad_row] * bucket, dtype=torch.long, device=self.device)
            accepts = torch.zeros(bucket, 2, dtype=torch.long, device=self.device)
            verify, (hidden, argmax) = self._capture(lambda: self.verify_fn(packed, context))
            # the draft graph reads buffers the verify graph wrote besides its outputs: the entry
            # owns them, so no later capture can take their memory from the pool
            entry = _Captured(packed, accepts, verify, hidden, argmax, verify_state=self.verify_state())
            if self.draft_len:
                entry.draft, entry.drafts = self._capture(lambda: self.draft_fn(packed, accepts, hidden, context))
                entry.fused, entry.fused_out = self._capture(lambda: self.fused_fn(packed, context))
            self.captured[(bucket, context)] = entry
        return entry

    def _capture(self, fn: Callable[[], object]) -> tuple[torch.cuda.CUDAGraph, object]:
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):  # warm-up outside the capture (lazy init, library handles, autotuning)
            for _ in range(2):
                fn()
        torch.cuda.current_stream(self.device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            outputs = fn()
        return graph, outputs
