"""The asyncio orchestrator: its config, worker group, scheduler, request streams and engine."""

from shardspec.orchestrator.config import EngineConfig
from shardspec.orchestrator.engine import Chunk, Engine, EngineError, connect

__all__ = ["Chunk", "Engine", "EngineConfig", "EngineError", "connect"]
