"""Structured output, the orchestrator's part: a request's constraint becomes a grammar once, in a
bounded place, before the request is queued; then the last stage's ranks build it, off their steps.

- **Compile** (`GrammarCompiler`): llguidance is native code that a hostile grammar can crash, or
  keep busy for minutes and gigabytes. Each constraint is compiled and checked in one of a few
  compile processes (`python -m shardspec.constraints`), at the lowest CPU priority, under an
  address-space limit, killed past a time limit and started again; its first mask is computed and
  timed there too. A crash, a time-out or a constraint that cannot start (an error at its first
  token, no token allowed, only the end of text, a first mask over the step budget) is the caller's
  error (ConstraintError, a 400 naming it). Results, refusals included, are remembered by the
  constraint's text.
- **Install** (`Grammars`): the checked grammar goes to the last stage's ranks once per key
  (GrammarRequest), which build it on a thread of their own and answer when it is built; only then
  is the request queued, its prefill naming the key. Requests hold the key they use; keys no request
  holds stay built for the next request, the least recently used dropped past KEEP_UNUSED.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import logging
import signal
import sys
from collections import OrderedDict
from collections.abc import Collection
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from shardspec.constraints import ConstraintError
from shardspec.protocol.errors import ErrorCode, RemoteError
from shardspec.protocol.messages import GrammarRequest

log = logging.getLogger("shardspec.orchestrator")

REMEMBERED = 64  # compile results kept, by constraint
KEEP_UNUSED = 32  # grammars the workers keep built that no request holds
START_TIMEOUT_S = 120.0  # a compile process reads the tokenizer before its first answer
# a compile's time limit is CPU time (a compile process runs at the lowest priority, so its wall time
# follows the host's load); past this many times the limit in wall time, it is stopped all the same
WALL_TIME_FACTOR = 10
ANSWER_LIMIT = 8 << 20  # bytes of one answer line (a grammar is at most 1 MiB of text)
REAP_S = 5.0  # a compile process that closed its output exits within this


@dataclass(frozen=True)
class Compiled:
    """A constraint's checked grammar: `key` names it on the workers (a hash of its text)."""

    key: str
    grammar: str
    build_s: float  # building its matcher, in the compile process
    mask_s: float  # its first mask there


class CompileProcess:
    """One compile process: a JSON line in, a JSON line out."""

    def __init__(self, proc: asyncio.subprocess.Process):
        self.proc = proc

    @classmethod
    async def start(cls, tokenizer_file: Path, vocab_size: int, eos_ids: list[int],
                    memory_bytes: int) -> CompileProcess:
        proc = await asyncio.create_subprocess_exec(  # (it bounds itself: constraints.bound_this_process)
            sys.executable, "-m", "shardspec.constraints", str(tokenizer_file), str(vocab_size), json.dumps(eos_ids),
            str(memory_bytes), stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.DEVNULL, limit=ANSWER_LIMIT)
        process = cls(proc)
        try:
            ready = await asyncio.wait_for(proc.stdout.readline(), START_TIMEOUT_S)
        except TimeoutError:
            ready = b""
        if not ready:
            process.kill()
            raise RuntimeError(f"a grammar compile process did not start (exit {await proc.wait()}; its memory "
                               f"limit is {memory_bytes >> 20} MiB)")
        return process

    async def ask(self, request: dict[str, Any], timeout: float) -> dict[str, Any] | None:
        """The answer, or None when the process died (crashed, or ran out of memory) first.
        TimeoutError past `timeout` (the process is killed)."""
        try:
            self.proc.stdin.write(json.dumps(request).encode() + b"\n")
            await self.proc.stdin.drain()
            line = await asyncio.wait_for(self.proc.stdout.readline(), timeout)
        except (TimeoutError, asyncio.CancelledError):
            await self.close()
            raise
        except (ConnectionError, ValueError):  # (a pipe closed by a dead process; an answer over the limit)
            line = b""
        if not line:
            await self.reap()
            return None
        return json.loads(line)

    async def reap(self) -> None:
        """Wait for a process that closed its output to exit (killed if it does not): its exit status
        tells why. (Not killed first: Popen.kill polls, reaping a dead one before asyncio's watcher.)"""
        try:
            await asyncio.wait_for(self.proc.wait(), REAP_S)
        except TimeoutError:
            await self.close()

    @property
    def alive(self) -> bool:
        return self.proc.returncode is None

    def kill(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            self.proc.kill()

    async def close(self) -> None:
        self.kill()
        with contextlib.suppress(ProcessLookupError):
            await self.proc.wait()


class GrammarCompiler:
    """Constraints compiled and checked in up to `processes` compile processes, each answer within
    `timeout_s`, each process within `memory_bytes`; a first mask over `mask_budget_s` is refused."""

    def __init__(self, tokenizer_file: Path, vocab_size: int, eos_ids: list[int], added_tokens: Collection[str],
                 processes: int, timeout_s: float, memory_bytes: int, mask_budget_s: float):
        self.start_args = (tokenizer_file, vocab_size, list(eos_ids), memory_bytes)
        self.added_tokens = sorted(added_tokens)
        self.timeout_s, self.memory_bytes, self.mask_budget_s = timeout_s, memory_bytes, mask_budget_s
        self.idle: list[CompileProcess] = []
        self.slots = asyncio.Semaphore(processes)
        self.results: OrderedDict[str, Compiled | str] = OrderedDict()  # by constraint hash: a grammar, or why not
        self.running: dict[str, asyncio.Future] = {}
        self.compiles = self.crashes = 0  # constraints sent to a compile process; those that ended it

    async def compile(self, constraint: Any) -> Compiled:
        """The checked grammar of a constraint; ConstraintError naming what is wrong."""
        try:
            text = json.dumps(constraint, sort_keys=True)
        except (TypeError, ValueError) as exc:
            raise ConstraintError(f"a structured output constraint must be JSON: {exc}") from None
        digest = hashlib.blake2b(text.encode(), digest_size=16).hexdigest()
        if digest not in self.results:
            if digest not in self.running:  # (one compile for all who ask at once; a caller who leaves stops none)
                self.running[digest] = _quiet(asyncio.ensure_future(self._compile(digest, constraint)))
            await asyncio.shield(self.running[digest])
        self.results.move_to_end(digest)
        result = self.results[digest]
        if isinstance(result, str):
            raise ConstraintError(result)
        return result

    async def _compile(self, digest: str, constraint: Any) -> None:
        try:
            result = await self._in_a_process(constraint)
        except Exception as exc:  # (no process would start: the constraint is not at fault; not remembered)
            log.error("grammar compile failed: %s", exc)
            self.running.pop(digest, None)
            raise ConstraintError(f"structured output is unavailable: {exc}") from None
        self.results[digest] = result
        while len(self.results) > REMEMBERED:
            self.results.popitem(last=False)
        self.running.pop(digest, None)

    async def _in_a_process(self, constraint: Any) -> Compiled | str:
        async with self.slots:
            self.compiles += 1
            process = self.idle.pop() if self.idle else await CompileProcess.start(*self.start_args)
            try:
                request = {"constraint": constraint, "tokens": self.added_tokens, "cpu_s": self.timeout_s}
                answer = await process.ask(request, self.timeout_s * WALL_TIME_FACTOR)
            except TimeoutError:
                return (f"compiling the constraint took over {self.timeout_s * WALL_TIME_FACTOR:g} s on this "
                        "busy host: simplify it, or retry")
            finally:
                if process.alive:
                    self.idle.append(process)
        if answer is None:
            code = process.proc.returncode
            if code == -signal.SIGXCPU:
                return (f"compiling the constraint took over {self.timeout_s:g} s of CPU time (the grammar compile "
                        "time limit): simplify it")
            self.crashes += 1
            how = f"signal {signal.Signals(-code).name}" if code is not None and code < 0 else f"exit {code}"
            return (f"the constraint crashed the grammar compiler or ran it out of memory ({how}; its limit is "
                    f"{self.memory_bytes >> 20} MiB): simplify it")
        if "error" in answer:
            return str(answer["error"])
        if answer["mask_s"] > self.mask_budget_s:
            return (f"the constraint's first mask took {answer['mask_s'] * 1e3:.0f} ms, over the budget of "
                    f"{self.mask_budget_s * 1e3:.0f} ms a step: simplify it")
        key = hashlib.blake2b(answer["grammar"].encode(), digest_size=16).hexdigest()
        return Compiled(key, answer["grammar"], answer["build_s"], answer["mask_s"])

    async def close(self) -> None:
        idle, self.idle = self.idle, []
        await asyncio.gather(*(process.close() for process in idle))
        for task in self.running.values():
            task.cancel()


def _quiet(task: asyncio.Future) -> asyncio.Future:
    """A task shared by its callers, whose error is theirs: not logged again if all have left."""
    task.add_done_callback(lambda t: t.cancelled() or t.exception())
    return task


class Grammars:
    """The grammars the last stage's ranks hold: `acquire` compiles a constraint and has every rank
    of the last stage build it (once per key; `call(request)` sends a GrammarRequest to them and
    waits), `release` when the request that acquired it is done."""

    def __init__(self, compiler: GrammarCompiler, call: Any, keep: int = KEEP_UNUSED):
        self.compiler, self.call, self.keep = compiler, call, keep
        self.users: dict[str, int] = {}  # key -> requests holding it
        self.built: OrderedDict[str, None] = OrderedDict()  # keys built on the workers, least recently used first
        self.building: dict[str, asyncio.Future] = {}
        self.drop: list[str] = []  # keys to drop with the next request
        self.loads = -1  # the group's load these keys were built in
        self.builds = 0  # grammars sent to the workers to build

    async def acquire(self, constraint: Any, loads: int) -> str:
        """The key of the constraint's grammar, built on the last stage (ConstraintError: the caller's
        fault); the caller holds it until `release`. `loads`: the group's load count (a new load
        builds on fresh workers)."""
        compiled = await self.compiler.compile(constraint)
        if loads != self.loads:
            self.users, self.built, self.building, self.drop, self.loads = {}, OrderedDict(), {}, [], loads
        key = compiled.key
        self.users[key] = self.users.get(key, 0) + 1
        try:
            if key not in self.built:
                if key not in self.building:
                    self.building[key] = _quiet(asyncio.ensure_future(self._build(compiled)))
                await asyncio.shield(self.building[key])
            self.built.move_to_end(key)
        except BaseException:
            self.release(key)
            raise
        return key

    async def _build(self, compiled: Compiled) -> None:
        drop, self.drop = self.drop, []
        self.builds += 1
        try:
            await self.call(GrammarRequest(key=compiled.key, grammar=compiled.grammar, drop=drop))
        except RemoteError as exc:
            if exc.code == ErrorCode.BAD_REQUEST:  # (it built in the compile process: not expected)
                raise ConstraintError(f"the workers could not build the grammar: {exc.message}") from None
            raise
        finally:
            self.building.pop(compiled.key, None)
        self.built[compiled.key] = None

    def release(self, key: str) -> None:
        left = self.users.get(key, 0) - 1
        if left > 0:
            self.users[key] = left
            return
        self.users.pop(key, None)
        unused = [k for k in self.built if k not in self.users]
        for old in unused[: max(0, len(unused) - self.keep)]:
            del self.built[old]
            self.drop.append(old)
