"""The asyncio orchestrator: worker connections, the engine and its step loop."""

from shardspec.orchestrator.engine import Chunk, Engine, EngineError, connect

__all__ = ["Chunk", "Engine", "EngineError", "connect"]
