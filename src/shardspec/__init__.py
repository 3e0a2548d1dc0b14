"""shardspec: tensor-parallel MTP language models on shard-worker daemons."""

from typing import Any

__version__ = "0.1.0"
__all__ = ["Chunk", "Engine", "EngineConfig", "EngineError", "WorkerOptions", "__version__", "connect"]


def __getattr__(name: str) -> Any:
    # the engine (and ZeroMQ) load on first use: a worker or a training script does not need them
    if name in ("Chunk", "Engine", "EngineConfig", "EngineError", "connect"):
        from shardspec.orchestrator import engine

        return getattr(engine, name)
    if name == "WorkerOptions":
        from shardspec.protocol.messages import WorkerOptions

        return WorkerOptions
    raise AttributeError(f"module 'shardspec' has no attribute {name!r}")
