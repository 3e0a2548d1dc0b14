"""The model interface: all that the runner, the worker daemon and the loader know of a model.

A model family (models/registry.py) builds a `CausalLM` for one pipeline stage: the decoder layers
of its `Stage`, plus the embedding on the first stage and the final norm, LM head and MTP module
on the last. The runner calls `forward` over the stage's layers, `draft` for the MTP module,
`commit` after a speculative pass, and the cache methods; the loader asks `checkpoint_key` which
checkpoint tensor fills each parameter. None of them names a layer type or a model class.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch import nn

from shardspec.layers.batch import Batch, CachedLayer, CacheShape
from shardspec.layers.embedding import ParallelLMHead
from shardspec.layers.parallel import TPGroup
from shardspec.models.config import ConfigError


class ModelConfig(Protocol):
    """What every family's config provides (each family adds its own fields). Optional:
    `tp_splits(tp)`, from which the FP8 checks run without building a model (models.fp8.split_problem)."""

    vocab_size: int
    num_hidden_layers: int
    max_position_embeddings: int
    eos_token_ids: list[int]

    def check_tp(self, tp: int) -> None:
        """Raise ConfigError unless the model can be split tp ways."""


@dataclass(frozen=True)
class Stage:
    """The decoder layers [start, end) of a model of num_layers that one pipeline stage holds."""

    start: int
    end: int
    num_layers: int

    @classmethod
    def whole(cls, num_layers: int) -> Stage:
        return cls(0, num_layers, num_layers)

    @property
    def first(self) -> bool:
        return self.start == 0

    @property
    def last(self) -> bool:
        return self.end == self.num_layers


def split_layers(num_layers: int, stages: int, layer_split: list[int] | None = None) -> list[Stage]:
    """The stages of a model: layer_split[i] layers for stage i, or as even as can be (earlier
    stages take one more where the layers do not divide)."""
    if layer_split:
        if len(layer_split) != stages or sum(layer_split) != num_layers or min(layer_split) < 1:
            raise ConfigError(f"layer split {layer_split} must give each of the {stages} stages at least one "
                              f"layer, {num_layers} in all")
        counts = list(layer_split)
    else:
        if not 1 <= stages <= num_layers:
            raise ConfigError(f"{stages} stages for a model of {num_layers} layers: each stage needs one at least")
        counts = [num_layers // stages + (i < num_layers % stages) for i in range(stages)]
    starts = [sum(counts[:i]) for i in range(stages)]
    return [Stage(start, start + n, num_layers) for start, n in zip(starts, counts)]


def split_config(config: Any, tp: int, ep: int = 1) -> Any:
    """The config of a model split over tp ranks, its experts over ep groups of them (layers.moe);
    ConfigError, naming the degrees that work, where it cannot be split so."""
    if ep != 1:
        with_ep = getattr(config, "with_expert_parallel", None)
        if with_ep is None:
            raise ConfigError(f"expert parallelism (ep={ep}) applies to mixture-of-experts models; this one has "
                              "no experts: leave ep at 1")
        config = with_ep(ep)
    config.check_tp(tp)
    return config


class CausalLM(nn.Module):
    """One stage of a causal language model, tensor-parallel over its group. A family subclasses it
    and implements forward, draft and checkpoint_key; the cache methods here find the stage's
    CachedLayers (its KV caches and recurrent states) on their own."""

    config: Any  # the family's config (see ModelConfig)
    stage: Stage
    lm_head: ParallelLMHead | None  # the last stage's: logits, argmax and the drafts' argmax

    @property
    def has_mtp(self) -> bool:
        """Whether this stage holds an MTP module (`draft`)."""
        raise NotImplementedError

    def forward(self, x: torch.Tensor, batch: Batch) -> torch.Tensor:
        """The stage's layers over x: token ids [B, T] on the first stage, the stage before's hidden
        states [B, T, H] on the others. Returns the final (normed) hidden states on the last stage,
        the residual stream for the next stage on the others."""
        raise NotImplementedError

    def draft(self, next_ids: torch.Tensor, hidden: torch.Tensor, batch: Batch) -> torch.Tensor:
        """The MTP module over (token t+1, final hidden state at t) pairs at positions t: its normed
        output, which the LM head turns into the draft of token t+2 (and which feeds the next draft)."""
        raise NotImplementedError

    def checkpoint_key(self, param_name: str) -> str:
        """The checkpoint tensor (text-model layout, `model.…`) a parameter is read from."""
        raise NotImplementedError

    def set_batch_invariant(self, block_rows: int) -> None:
        """Batch-invariant mode (block_rows > 0; 0 turns it off): every layer computes a token's
        result with the same arithmetic whatever else is in the pass (how many sequences, how many
        tokens each), so greedy output depends neither on the batch nor on MTP. Matmuls run in
        fixed blocks of rows (layers.linear.linear), the layers that attend or recur take their
        CPU paths one token at a time, and a group of more than two ranks sums in rank order."""
        for module in self.modules():
            if hasattr(module, "block_rows"):
                module.block_rows = block_rows
            if hasattr(module, "invariant"):
                module.invariant = block_rows > 0
            tp = getattr(module, "tp", None)
            if isinstance(tp, TPGroup):
                tp.ordered = block_rows > 0

    def cached_layers(self) -> list[CachedLayer]:
        """The layers that keep state per slot, found once (a 9B-class model's walk over its modules
        takes a few tenths of a ms, and a prefill from a cached position asks several times)."""
        layers = self.__dict__.get("_cached_layers")
        if layers is None:
            layers = self.__dict__["_cached_layers"] = [m for m in self.modules() if isinstance(m, CachedLayer)]
        return layers

    def allocate_caches(self, num_slots: int, max_len: int, dtype: torch.dtype, device: torch.device) -> int:
        """Caches for num_slots sequences of up to max_len positions each, every slot its own blocks
        (CacheShape.contiguous); returns the bytes allocated."""
        return self.allocate_paged(CacheShape.contiguous(num_slots, max_len, device), dtype, device)

    def allocate_paged(self, shape: CacheShape, dtype: torch.dtype, device: torch.device) -> int:
        """Allocate every layer's state for `shape`; returns the bytes allocated."""
        return sum(layer.allocate(shape, dtype, device) for layer in self.cached_layers())

    def cache_bytes_per(self, dtype: torch.dtype) -> tuple[int, int]:
        """(Bytes of one slot's recurrent state, bytes of one K/V block) over every layer."""
        sizes = [layer.bytes_per(dtype) for layer in self.cached_layers()]
        return sum(slot for slot, _ in sizes), sum(block for _, block in sizes)

    def reset_slots(self, slots: torch.Tensor) -> None:
        for layer in self.cached_layers():
            layer.reset(slots)

    def copy_states(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Copy recurrent states from rows `src` to rows `dst` in every layer (CacheShape.saved)."""
        for layer in self.cached_layers():
            layer.copy_states(src, dst)

    def copy_blocks(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Copy K/V blocks `src` to `dst` in every attention layer."""
        for layer in self.cached_layers():
            layer.copy_blocks(src, dst)

    def commit(self, saved: dict[CachedLayer, Any], slots: torch.Tensor, index: torch.Tensor) -> None:
        """Keep tokens 0..index[b] of the speculative pass that left `saved` (its Batch.saved)."""
        for layer, inputs in saved.items():
            layer.commit(inputs, slots, index)

    def snapshot(self, slots: torch.Tensor) -> list[tuple[CachedLayer, Any]]:
        """A copy of the slots' recurrent state in every layer, for `restore`."""
        return [(layer, layer.snapshot(slots)) for layer in self.cached_layers()]

    def restore(self, snapshot: list[tuple[CachedLayer, Any]], slots: torch.Tensor) -> None:
        for layer, state in snapshot:
            if state is not None:
                layer.restore(state, slots)
