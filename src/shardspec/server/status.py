"""The operator's view of a serving engine: `/status.json` (for scripts and the page) and `/status`,
a page from the package that refreshes itself from it.

The report groups the workers as hosts -> pipeline stages -> TP ranks, each with its address,
device, decoder layers, memory, the age of its last message and its state; and the engine's step
times, MTP acceptance per draft position, requests and cache. It holds no secret: no key material,
no file path (an ipc:// address shows only its socket's file name, the model only its folder's
name), no traceback.
"""

from __future__ import annotations

import asyncio
import time
from importlib import resources
from typing import Any

from shardspec.utils import public, public_reason


def page() -> str:
    return resources.files("shardspec.server").joinpath("static/status.html").read_text(encoding="utf-8")


async def report(service: Any, started: float) -> dict[str, Any]:
    """The engine and its workers now (see the module's docstring)."""
    engine = service.engine
    group = engine.group
    stats = await service.worker_stats()  # [] while the workers are down
    now = asyncio.get_running_loop().time()
    tp = engine.config.tp_size
    ranks = []
    for rank, worker in enumerate(group.workers):
        s = stats[rank] if len(stats) > rank else None
        load = group.load_replies[rank] if len(group.load_replies) > rank else None
        ranks.append({
            "rank": rank,
            "stage": rank // tp,
            "tp_rank": rank % tp,
            "address": public(worker.address),
            "host": group.hostnames[rank] if len(group.hostnames) > rank else "",
            "device": group.devices[rank] if len(group.devices) > rank else "",
            "layers": list(load.layers) if load is not None else [],
            "state": "lost" if worker.failure is not None else (s.state if s is not None else "unknown"),
            "last_heard_s": round(now - worker.last_heard, 3) if worker.last_heard else None,
            "rss_bytes": s.rss_bytes if s is not None else None,
            "device_bytes": s.device_bytes if s is not None else None,
            "weight_bytes": load.weight_bytes if load is not None else None,
            "cache_bytes": load.cache_bytes if load is not None else None,
            "steps": s.steps if s is not None else None,
        })
    hosts: dict[str, dict[int, list[dict]]] = {}
    for rank in ranks:
        hosts.setdefault(rank["host"], {}).setdefault(rank["stage"], []).append(rank)
    scheduler = engine.scheduler
    cache = scheduler.cache
    failure = engine.failure
    return {
        "model": service.name,
        "healthy": failure is None,
        "failure": public_reason(failure) if failure is not None else None,
        "uptime_s": round(time.monotonic() - started, 1),
        "world_size": len(ranks),
        "stages": len({r["stage"] for r in ranks}),
        "tp": tp,
        "requests": {"running": len(scheduler.running), "waiting": len(scheduler.waiting),
                     "max_seqs": scheduler.max_seqs},
        **service.metrics.summary(),
        "cache_usage": round(scheduler.pool.usage, 4) if scheduler.pool is not None else None,
        "prefix_hit_rate": round(cache.hits / cache.queries, 4) if cache is not None and cache.queries else None,
        "hosts": [{"host": host, "stages": [{"stage": stage, "ranks": members}
                                            for stage, members in sorted(stages.items())]}
                  for host, stages in hosts.items()],
    }
