"""shardspec: tensor-parallel MTP language models on shard-worker daemons."""

__version__ = "0.1.0"

from shardspec.orchestrator.engine import Chunk, Engine, EngineError, connect  # noqa: E402

__all__ = ["Chunk", "Engine", "EngineError", "__version__", "connect"]
