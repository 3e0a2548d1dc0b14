"""What a `load` request builds on a worker: its shard of the model (kept across loads of the same
weights) and the runner of its pipeline role with fresh caches."""

from __future__ import annotations

import ctypes
import gc
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from shardspec import kernels
from shardspec.layers.parallel import TPGroup
from shardspec.models.base import CausalLM, Stage
from shardspec.models.checkpoint import Checkpoint
from shardspec.models.config import ConfigError
from shardspec.models.loader import load_model
from shardspec.protocol.errors import ErrorCode, ProtocolError
from shardspec.protocol.messages import LoadProgress, LoadRequest
from shardspec.shard_worker.decoder import Decoder, Peek
from shardspec.shard_worker.links import StageLinks
from shardspec.shard_worker.runner import ModelRunner
from shardspec.shard_worker.shard_cache import ShardCache
from shardspec.shard_worker.sources import ModelSource, open_source
from shardspec.shard_worker.stage import ForwardingStage
from shardspec.utils import resolve_dtype

log = logging.getLogger("shardspec.worker")
PROGRESS_EVERY_S = 2.0  # how often a load logs its progress
CPU_CACHE_BYTES = 1 << 30  # a CPU worker's K/V blocks and recurrent states, unless told (--cache-memory)
GPU_MEMORY_FRACTION = 0.9  # a GPU worker's share of its device, weights and cache together (as vLLM's default)
GRAPH_RESERVE_BYTES = 1 << 30  # of that share, kept for CUDA graphs and activations


@dataclass(frozen=True)
class LoadPlan:
    checkpoint: Checkpoint
    dtype: torch.dtype
    stage: Stage
    mtp: bool  # whether the model drafts with its MTP module
    source: ModelSource | None = None  # where the checkpoint is: its folder, the shard cache or the Hub


class HeldModel:
    """The weights a worker holds, kept when the next load asks for the same ones."""

    def __init__(self, device: torch.device, cache: ShardCache | None = None, model_root: Path | None = None):
        self.device = device
        self.cache = cache or ShardCache()  # what orchestrators sent (shard_receiver)
        self.model_root = model_root  # model folders are read only under it (None: anywhere)
        self.model: CausalLM | None = None
        self.key: tuple | None = None  # (path, dtype, stage, expert groups) of the loaded weights
        self.mtp = False  # whether they include the MTP module (on the last stage)

    @property
    def weight_bytes(self) -> int:
        return 0 if self.model is None else sum(p.nbytes for p in self.model.parameters())

    def plan(self, body: LoadRequest, stage_index: int, stages: int) -> LoadPlan:
        """What a load request asks this rank for, read from the checkpoint's config before anything
        loaded is let go (a bad folder leaves the worker as it was)."""
        try:
            source = open_source(body.model, body.model_key, self.cache, self.model_root, stage_index, stages,
                                 body.mtp, body.layer_split)
            checkpoint = source.checkpoint
        except (ConfigError, OSError) as exc:
            raise ProtocolError(ErrorCode.NOT_FOUND, str(exc)) from None
        try:
            dtype = resolve_dtype(body.dtype, checkpoint.dtype, self.device)
        except ValueError as exc:
            raise ProtocolError(ErrorCode.BAD_REQUEST, str(exc)) from None
        try:
            stage = checkpoint.stage(stage_index, stages, body.layer_split)
            mtp = body.mtp == "on" or (body.mtp == "auto" and checkpoint.has_mtp)
        except (ConfigError, OSError) as exc:
            raise ProtocolError(ErrorCode.NOT_FOUND, str(exc)) from None
        return LoadPlan(checkpoint, dtype, stage, mtp, source)

    def load(self, body: LoadRequest, plan: LoadPlan, tp: TPGroup,
             report: Callable[[LoadProgress], None] = lambda _: None) -> CausalLM:
        """The model of `plan`: the one held if it has the same weights, else read (`report`: told
        after each tensor how far the read is)."""
        key = (body.model, body.model_key, plan.dtype, plan.stage, body.expert_parallel)
        if self.model is not None and self.key == key and (self.mtp or not plan.mtp):
            log.info("keeping the loaded weights of %s; new caches", body.model)
        else:
            self.drop()
            self.model = self._read(body, plan, tp, report)
            self.key, self.mtp = key, plan.mtp
        return self.model

    def drop(self) -> None:
        self.model = self.key = None
        free_memory(self.device)

    def _read(self, body: LoadRequest, plan: LoadPlan, tp: TPGroup, report: Callable[[LoadProgress], None]
              ) -> CausalLM:
        log.info("loading %s as %s (rank %d of %d)", body.model, plan.dtype, tp.rank, tp.size)
        last_report = [0.0]

        def progress(done: int, total: int, done_bytes: int, total_bytes: int) -> None:
            report(LoadProgress(done, total, done_bytes, total_bytes))
            if time.perf_counter() - last_report[0] > PROGRESS_EVERY_S or done == total:
                last_report[0] = time.perf_counter()
                log.info("loaded %d/%d tensors (%.0f of %.0f MB)", done, total, done_bytes / 1e6, total_bytes / 1e6)

        try:
            if plan.source is not None:
                plan.source.fetch(plan.stage, plan.mtp, report)
            return load_model(plan.checkpoint, tp, plan.dtype, self.device, with_mtp=plan.mtp, progress=progress,
                              stage=plan.stage, expert_parallel=body.expert_parallel)
        except (ConfigError, OSError) as exc:
            raise ProtocolError(ErrorCode.NOT_FOUND, str(exc)) from None


def make_runner(model: CausalLM, device: torch.device, body: LoadRequest, draft_len: int, links: StageLinks | None,
                peek: Peek | None, folder: Path | None = None) -> ModelRunner:
    """The runner of the model's pipeline role: the last stage decodes (a single stage is one), an
    earlier one forwards. `peek` (the next request while a pass runs) lets a single stage launch ahead."""
    forced = body.forced_acceptance if body.forced_acceptance >= 0 else None
    if forced is not None:
        log.warning("FORCED ACCEPTANCE %.2f: benchmark mode, the output is not the model's", forced)
    max_seq_len = min(body.max_seq_len or model.config.max_position_embeddings, model.config.max_position_embeddings)
    common = dict(forced_acceptance=forced, links=links, deterministic=body.deterministic, lookahead=body.lookahead,
                  tree_width=body.tree_width,
                  draft_head=kernels.settings.draft_head, cache_bytes=body.cache_bytes or default_cache_bytes(device),
                  prefix_cache=body.prefix_cache)
    try:
        if model.stage.last:
            tokenizer = Path(folder or body.model) / "tokenizer.json"
            return Decoder(model, device, body.max_seqs, max_seq_len, body.prefill_chunk, draft_len, peek=peek,
                           launch_ahead=kernels.settings.launch_ahead,
                           tokenizer_file=tokenizer if tokenizer.is_file() else None,
                           grammar_budget_s=body.grammar_budget_s, **common)
        return ForwardingStage(model, device, body.max_seqs, max_seq_len, body.prefill_chunk, draft_len, **common)
    except ValueError as exc:  # the cache cannot hold one sequence
        raise ProtocolError(ErrorCode.CAPACITY, str(exc)) from None


def default_cache_bytes(device: torch.device) -> int:
    """The cache of a worker not told its size: CPU_CACHE_BYTES on a CPU; on a GPU, GPU_MEMORY_FRACTION
    of the device less what is allocated (the weights) and GRAPH_RESERVE_BYTES, within what is free."""
    if device.type != "cuda":
        return CPU_CACHE_BYTES
    free, total = torch.cuda.mem_get_info(device)
    share = int(GPU_MEMORY_FRACTION * total) - torch.cuda.memory_allocated(device)
    return max(0, min(free, share) - GRAPH_RESERVE_BYTES)


def free_memory(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    elif _LIBC is not None:  # hand freed heap pages back to the system, not only to malloc
        _LIBC.malloc_trim(0)


def _libc() -> Any:
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return None
    return libc if hasattr(libc, "malloc_trim") else None  # glibc only


_LIBC = _libc()
