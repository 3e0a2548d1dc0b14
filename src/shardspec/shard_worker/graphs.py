"""CUDA graphs for the target model's decode and verify passes.

A decode step of a large model launches thousands of small kernels; eager PyTorch spends far more
time dispatching them than the GPU spends reading the weights. So each (batch bucket, tokens per
sequence, context bucket) shape is captured once as a CUDA graph and replayed: the batch is padded
to its bucket with rows that write only to a scratch cache slot, and attention reads the cache up
to the context bucket with the causal mask hiding the rest.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from shardspec.layers.batch import Batch
from shardspec.layers.gdn import GatedDeltaNet
from shardspec.models.qwen3_5 import Qwen3_5Model

BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
MIN_CONTEXT_BUCKET = 256


@dataclass
class _Graph:
    graph: torch.cuda.CUDAGraph
    ids: torch.Tensor
    positions: torch.Tensor
    slots: torch.Tensor
    hidden: torch.Tensor
    kept: list  # each DeltaNet layer's per-token states, as captured (read by commit after replay)


class GraphedForward:
    """model(ids, Batch(...)) through captured graphs; `scratch_slot` absorbs the padding rows."""

    def __init__(self, model: Qwen3_5Model, device: torch.device, scratch_slot: int, max_context: int):
        self.model = model
        self.device = device
        self.scratch = scratch_slot
        self.max_context = max_context
        self.graphs: dict[tuple[int, int, int, bool], _Graph] = {}
        self.pool = torch.cuda.graph_pool_handle()
        self.deltanets = [layer.mixer for layer in model.layers if isinstance(layer.mixer, GatedDeltaNet)]

    def __call__(self, ids: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor, context: int,
                 keep_states: bool) -> torch.Tensor:
        """Hidden states [B, T, H] (a view valid until the next call)."""
        B, T = ids.shape
        bucket = next((b for b in BATCH_BUCKETS if b >= B), None)
        if bucket is None:  # larger than any bucket: eager
            return self.model(ids, Batch(slots, positions, context, keep_states))
        context = min(self.max_context, max(MIN_CONTEXT_BUCKET, 1 << (context - 1).bit_length()))
        key = (bucket, T, context, keep_states)
        entry = self.graphs.get(key) or self._capture(*key)
        entry.ids[:B].copy_(ids)
        entry.positions[:B].copy_(positions)
        entry.slots[:B].copy_(slots)
        entry.ids[B:].zero_()
        entry.positions[B:].copy_(torch.arange(T, device=self.device))
        entry.slots[B:].fill_(self.scratch)
        entry.graph.replay()
        if keep_states:  # the layers' `kept` must be this graph's outputs, for commit()
            for layer, kept in zip(self.deltanets, entry.kept):
                layer.kept = kept
        return entry.hidden[:B]

    def _capture(self, bucket: int, T: int, context: int, keep_states: bool) -> _Graph:
        ids = torch.zeros(bucket, T, dtype=torch.long, device=self.device)
        positions = torch.arange(T, device=self.device).repeat(bucket, 1)
        slots = torch.full((bucket,), self.scratch, dtype=torch.long, device=self.device)
        batch = Batch(slots, positions, context, keep_states)
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):  # warm-up outside the capture (lazy init, library handles)
            for _ in range(2):
                self.model(ids, batch)
        torch.cuda.current_stream(self.device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            hidden = self.model(ids, batch)
        kept = [layer.kept for layer in self.deltanets]
        entry = _Graph(graph, ids, positions, slots, hidden, kept)
        self.graphs[(bucket, T, context, keep_states)] = entry
        return entry
