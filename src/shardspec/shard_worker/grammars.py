"""The last stage's grammars, by key: built on a thread of their own, never inside a step.

The orchestrator compiles and checks every grammar in its own compile processes before it sends
one (orchestrator.grammars); a rank builds it again here (llguidance has no serialised form) on a
thread with a larger stack than the compile processes', so what built there builds here. llguidance
drops the GIL while it builds, so the steps go on meanwhile. A sequence's matcher is a copy of its
grammar's (cheap: the copies share the built grammar).
"""

from __future__ import annotations

import functools
import logging
import os
import queue
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from llguidance import LLMatcher, LLTokenizer

from shardspec.constraints import WORKER_STACK_BYTES, llg_tokenizer, parser_limits, special_ids
from shardspec.layers.grammar import Constraint
from shardspec.protocol.errors import ErrorCode, ProtocolError
from shardspec.protocol.messages import MAX_GRAMMARS

log = logging.getLogger("shardspec.worker")


@dataclass
class Built:
    """A grammar build that finished: for the request `request_id` that asked, its key, and the
    error or the seconds it took."""

    request_id: int
    key: str
    error: str
    seconds: float


class GrammarStore:
    """Grammars by key, built on one thread; `wake_fd` becomes readable when a build finishes (the
    daemon polls it beside its socket and answers the requests whose build is done)."""

    def __init__(self, tokenizer_file: Path | None, vocab_size: int, eos_ids: list[int]):
        self.tokenizer_file, self.vocab_size, self.eos_ids = tokenizer_file, vocab_size, eos_ids
        self.built: dict[str, LLMatcher] = {}
        self.waiting: dict[str, list[int]] = {}  # keys being built -> the request ids waiting for them
        self.todo: queue.SimpleQueue[tuple[str, str] | None] = queue.SimpleQueue()
        self.finished: queue.SimpleQueue[Built] = queue.SimpleQueue()
        self.wake_fd, self._wake_write = os.pipe()
        os.set_blocking(self.wake_fd, False)
        previous = threading.stack_size(WORKER_STACK_BYTES)
        try:
            self.thread = threading.Thread(target=self._run, name="grammars", daemon=True)
            self.thread.start()
        finally:
            threading.stack_size(previous)

    @functools.cached_property
    def tokenizer(self) -> LLTokenizer:
        if self.tokenizer_file is None:
            raise ProtocolError(ErrorCode.BAD_REQUEST, "structured output needs the model folder's tokenizer.json")
        return llg_tokenizer(self.tokenizer_file, self.vocab_size, self.eos_ids)

    @functools.cached_property
    def special(self) -> np.ndarray:
        return special_ids(self.tokenizer, self.vocab_size, self.eos_ids)

    # --- the daemon's side ----------------------------------------------------------------------

    def build(self, request_id: int, key: str, grammar: str, drop: list[str]) -> bool:
        """Forget `drop`, then start building `grammar` as `key` for request `request_id`; True when
        it is built already (answer at once)."""
        for old in drop:
            self.built.pop(old, None)
        if not key or key in self.built:
            return True
        if key in self.waiting:
            self.waiting[key].append(request_id)
            return False
        if len(self.built) + len(self.waiting) >= MAX_GRAMMARS:
            raise ProtocolError(ErrorCode.CAPACITY, f"this worker holds {MAX_GRAMMARS} grammars; drop some first")
        self.waiting[key] = [request_id]
        self.todo.put((key, grammar))
        return False

    def done(self) -> list[Built]:
        """The builds finished since the last call, one per request that waited for them."""
        try:
            while os.read(self.wake_fd, 4096):
                pass
        except BlockingIOError:
            pass
        out = []
        while not self.finished.empty():
            built = self.finished.get()
            out += [Built(request_id, built.key, built.error, built.seconds)
                    for request_id in self.waiting.pop(built.key, [])]
        return out

    def abandon(self, error: str) -> list[Built]:
        """Every request still waiting, failed with `error` (the store is going)."""
        waiting, self.waiting = self.waiting, {}
        return [Built(request_id, key, error, 0.0) for key, ids in waiting.items() for request_id in ids]

    def constraint(self, key: str) -> Constraint:
        """A new sequence's grammar state, at its start; ProtocolError when `key` is not built here."""
        template = self.built.get(key)
        if template is None:
            raise ProtocolError(ErrorCode.BAD_REQUEST, f"grammar {key[:64]!r} is not built on this worker (send "
                                "its grammar request first)")
        return Constraint(template.deep_copy(), self.special, (self.vocab_size + 31) // 32)

    def close(self) -> None:
        self.todo.put(None)
        self.thread.join(timeout=1.0)  # (a build still running ends with the process: the thread is a daemon)
        os.close(self.wake_fd)
        os.close(self._wake_write)

    # --- the build thread -------------------------------------------------------------------------

    def _run(self) -> None:
        while (item := self.todo.get()) is not None:
            key, grammar = item
            started = time.perf_counter()
            error = ""
            try:
                matcher = LLMatcher(self.tokenizer, grammar, log_level=0, limits=parser_limits())
                _ = self.special  # (built here, off the steps, on first use)
                if matcher.is_error():
                    error = "the grammar does not build: " + matcher.get_error().strip().split("\n", 1)[0][:300]
                else:
                    self.built[key] = matcher
            except ProtocolError as exc:
                error = exc.message
            except Exception as exc:  # (a bug: its request fails, the worker goes on)
                log.exception("building a grammar failed")
                error = f"building the grammar failed: {type(exc).__name__}"
            self.finished.put(Built(0, key, error, time.perf_counter() - started))
            try:
                os.write(self._wake_write, b"\0")
            except OSError:  # (closed: the store is going)
                return
