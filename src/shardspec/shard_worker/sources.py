"""Where a worker finds the model a load names, in this order: the folder at that path on its host
(under --model-dir, if given); its shard cache (the tensors an orchestrator sent it before, by the
model's key); the Hugging Face Hub (an ORG/NAME@COMMIT id: only the safetensors files that hold its
stage's tensors are fetched)."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from shardspec.models import hub
from shardspec.models.base import Stage
from shardspec.models.checkpoint import Checkpoint
from shardspec.models.config import ConfigError
from shardspec.models.loader import stage_keys
from shardspec.models.shard_files import INDEX_FILE, CachedCheckpoint
from shardspec.protocol.messages import LoadProgress
from shardspec.shard_worker.shard_cache import ShardCache, is_digest

log = logging.getLogger("shardspec.worker")


@dataclass(frozen=True)
class ModelSource:
    kind: str  # "folder", "cache" or "hub"
    checkpoint: Checkpoint
    hub_model: hub.HubModel | None = None
    cache: ShardCache | None = None
    key: str = ""

    def fetch(self, stage: Stage, mtp: bool, report: Callable[[LoadProgress], None]) -> None:
        """Make the stage's tensors readable: fetch its files from the Hub, or mark its cached blobs used."""
        if self.kind == "cache":
            held = self.cache.tensors(self.key)
            self.cache.touch(held[name] for name in stage_keys(self.checkpoint, stage, mtp) if name in held)
        elif self.kind == "hub":
            fetch_from_hub(self.hub_model, self.checkpoint, stage, mtp, report)


def local_folder(model: str, root: Path | None) -> Path | None:
    """The model folder at path `model` on this host, if there is one (and it lies under `root`);
    whether it holds a readable model, Checkpoint.open says."""
    path = Path(model)
    if not path.is_dir():
        return None
    if root is not None and not path.resolve().is_relative_to(root.resolve()):
        return None
    return path


def cached_checkpoint(cache: ShardCache, key: str) -> CachedCheckpoint | None:
    """Model `key` in the shard cache (whatever share of its tensors it holds), or None."""
    if not is_digest(key):
        return None
    folder = cache.model_folder(key)
    if not (folder / "config.json").is_file() or not (folder / INDEX_FILE).is_file():
        return None
    blobs = {name: cache.blob(digest) for name, digest in cache.tensors(key).items()}
    return CachedCheckpoint.open_cached(folder, blobs)


def stage_of(checkpoint: Checkpoint, mtp: str, layer_split: list[int], index: int, stages: int) -> tuple[Stage, bool]:
    """The stage this rank holds, and whether it includes the MTP module (mtp: auto, on, off)."""
    stage = checkpoint.stage(index, stages, layer_split or None)
    return stage, mtp == "on" or (mtp == "auto" and checkpoint.has_mtp)


def missing(checkpoint: Checkpoint, stage: Stage, mtp: bool, held: dict[str, str]) -> list[str]:
    """The tensors the stage reads that `held` lacks."""
    return sorted(stage_keys(checkpoint, stage, mtp) - held.keys())


def open_source(model: str, key: str, cache: ShardCache, root: Path | None, index: int, stages: int,
                mtp: str, layer_split: list[int]) -> ModelSource:
    """The first place that has the model's stage (see the module's doc); ConfigError if none."""
    if (folder := local_folder(model, root)) is not None:
        return ModelSource("folder", Checkpoint.open(folder))
    cached = cached_checkpoint(cache, key)
    ref = hub.parse_ref(model)
    if cached is not None:
        stage, with_mtp = stage_of(cached, mtp, layer_split, index, stages)
        lacking = missing(cached, stage, with_mtp, cache.tensors(key))
        if not lacking:
            return ModelSource("cache", cached, cache=cache, key=key)
        if ref is None:
            raise ConfigError(f"the shard cache holds {model} without {len(lacking)} of this stage's tensors "
                              f"({lacking[0]}, ...): the orchestrator sends them before the load")
    if ref is None:
        where = f" under --model-dir {root}" if root is not None else ""
        raise ConfigError(f"no model folder at {model}{where} on this worker's host, nothing of it in the shard "
                          f"cache at {cache.root}, and it is not a Hub id (ORG/NAME[@REVISION])")
    resolved = hub.resolve(ref, ("config.json", INDEX_FILE))
    if not (resolved.folder / INDEX_FILE).is_file():  # a model in one file: that file is every stage's
        hub.fetch(resolved, ["model.safetensors"])
    return ModelSource("hub", Checkpoint.open(resolved.folder), hub_model=resolved)


def hub_files(checkpoint: Checkpoint, stage: Stage, mtp: bool) -> list[str]:
    """The safetensors files that hold the stage's tensors."""
    return sorted({checkpoint.files[name].name for name in stage_keys(checkpoint, stage, mtp)
                   if name in checkpoint.files})


def fetch_from_hub(model: hub.HubModel, checkpoint: Checkpoint, stage: Stage, mtp: bool,
                   report: Callable[[LoadProgress], None]) -> None:
    """Fetch the safetensors files of the stage (only those) into the Hub cache, telling `report`
    how far (files and bytes)."""
    names = hub_files(checkpoint, stage, mtp)
    total = len({path.name for path in checkpoint.files.values()})
    log.info("fetching %d of the %d safetensors files of %s from the Hub for layers %d-%d: %s", len(names), total,
             model.pinned, stage.start, stage.end - 1, ", ".join(names))
    started, fetched, sizes = time.perf_counter(), [0], [0]  # bytes so far; sizes of the files done
    for done, name in enumerate(names):
        def told(n: int, size: int, done: int = done) -> None:
            fetched[0] += n
            report(LoadProgress(done, len(names), fetched[0], sizes[0] + size))

        path = hub.fetch(model, [name], told)[0]
        sizes[0] += path.stat().st_size
        report(LoadProgress(done + 1, len(names), sizes[0], sizes[0]))
    log.info("fetched %s from the Hub: %.1f MB in %.1fs", ", ".join(names), fetched[0] / 1e6,
             time.perf_counter() - started)
