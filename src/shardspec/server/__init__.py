"""`shardspec serve`: an OpenAI-compatible HTTP server over the engine (FastAPI on uvicorn)."""

from shardspec.server.app import create_app

__all__ = ["create_app"]
