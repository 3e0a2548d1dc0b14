"""The `shardspec` command: `worker` runs a shard-worker daemon, `generate` runs one prompt, `serve`
runs an OpenAI-compatible HTTP server, `status` asks workers what they do, `keys` makes CURVE key pairs.

`parser` holds the subcommands and their flags; `commands` what each subcommand does.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import sys
from typing import NoReturn

from shardspec.cli.commands import (
    ReaderLeft,
    UsageError,
    engine_config,
    run_generate,
    run_keys,
    run_serve,
    run_status,
    run_worker,
    sampling_penalties,
)
from shardspec.cli.parser import DEFAULT_REPETITION_PENALTY, build_parser
from shardspec.orchestrator.config import BUNDLED_MODEL

__all__ = ["BUNDLED_MODEL", "DEFAULT_REPETITION_PENALTY", "UsageError", "build_parser", "engine_config", "main",
           "run", "sampling_penalties"]


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        if args.command == "worker":
            return run_worker(args)
        if args.command == "keys":
            return run_keys(args)
        if args.command == "status":
            return asyncio.run(run_status(args))
        if args.command == "serve":
            return run_serve(args)
        return asyncio.run(run_generate(args))
    except UsageError as exc:
        print(f"shardspec {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except (KeyboardInterrupt, asyncio.CancelledError):
        print(f"shardspec {args.command}: interrupted", file=sys.stderr)
        return 130
    except ReaderLeft:  # (`| head`): stop as a program that SIGPIPE ends does, with nothing more on stdout
        with contextlib.suppress(OSError, ValueError):  # (what is still buffered goes nowhere)
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 128 + signal.SIGPIPE


def run() -> NoReturn:
    """The `shardspec` program: main, then exit at once. Whatever main started is stopped and closed
    when it returns (workers, sockets, folders, grammar processes); the interpreter's own teardown of
    torch's and the server's modules would only add most of a second of CPU to every exit (a worker's
    owner, a script, a test waits for it)."""
    code = main()
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(OSError, ValueError):  # (a reader that left: `shardspec generate ... | head`)
            stream.flush()
    os._exit(code)
