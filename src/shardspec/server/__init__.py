"""`shardspec serve`: an OpenAI-compatible HTTP server over the engine (FastAPI on uvicorn)."""

from typing import Any

__all__ = ["create_app"]


def __getattr__(name: str) -> Any:
    # imported on use: the CLI reads server.limits without loading FastAPI in every worker process
    if name == "create_app":
        from shardspec.server.app import create_app

        return create_app
    raise AttributeError(name)
