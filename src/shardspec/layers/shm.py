"""Collectives of a CPU tensor-parallel group whose ranks share a host, through shared memory.

Gloo over loopback TCP costs a chain of system calls and wake-ups per collective (about a
millisecond on two busy cores, twenty times a decode step). Here each rank copies its part into its
slot of a segment every rank maps, raises its arrival count, waits for its peers' counts, and reads
their slots: an all-reduce sums the parts in rank order (every rank gets the same bits, as
deterministic mode needs), an all-gather concatenates them.

- **Private, and gone with the group.** Local rank 0 makes the segment with memfd_create (never a
  name in /dev/shm) and the peers open it as /proc/PID/fd/FD, which only the same user can; it is
  freed when the last rank unmaps it or dies, SIGKILL included.
- **Two buffers, one wait.** Collective n writes buffer n % 2. A peer can write that buffer again
  only at collective n + 2, after every rank arrived at n + 1, that is after every rank finished
  reading n: one wait per collective suffices.
- **Spin, then yield, then sleep**, so that a peer on the same core gets to run; a peer that died
  (its process gone), a worker whose orchestrator left (`abort`: a peer that never got the step
  waits for nothing) or a wait past the group's timeout raises instead of spinning forever.
- **Ordering.** A rank stores its part, then its count; a peer loads the count, then the part. x86-64
  keeps stores in order and loads in order, so no fence is needed: the group uses shared memory on
  x86-64 only.
"""

from __future__ import annotations

import logging
import mmap
import os
import platform
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

log = logging.getLogger("shardspec.worker")

SLOT_BYTES = 4 << 20  # per rank and buffer: decode, verify and short prefill passes; larger go through Gloo
LINE = 64  # a rank's header (arrival count, pid) on a cache line of its own
SPINS, YIELDS = 2000, 2000  # checks before yielding the core, then before sleeping
NAP_S = 50e-6
MAX_VIEWS = 256  # slot views kept (per buffer, dtype and shape)
CHECK_PEERS_S = 0.1  # while sleeping, how often the peers' processes are checked


class CollectiveFailed(RuntimeError):
    """A collective that cannot complete: a peer rank died, the group gave up, or a peer is late. What
    an operator sees when a worker of the group goes away, not a bug of this one."""


def supported() -> bool:
    return platform.machine() in ("x86_64", "AMD64") and hasattr(os, "memfd_create")


class ShmCollectives:
    """All-reduce and all-gather of tensors up to SLOT_BYTES among the `size` ranks of a CPU group
    on one host, through one shared segment (make it with `ShmCollectives.join`)."""

    def __init__(self, memory: mmap.mmap, rank: int, size: int, timeout_s: float):
        self.memory, self.rank, self.size, self.timeout_s = memory, rank, size, timeout_s
        self.counts = memoryview(memory)[: size * LINE].cast("q")  # rank r's count at [r * LINE // 8]
        self.data = torch.frombuffer(memory, dtype=torch.uint8, offset=size * LINE)
        self.peers = [r for r in range(size) if r != rank]
        self.pids = {r: self.counts[r * LINE // 8 + 1] for r in self.peers}
        self.line, self.peer_lines = rank * LINE // 8, [r * LINE // 8 for r in self.peers]
        self.views: dict[tuple, list[torch.Tensor]] = {}
        self.n = 0
        self.abort: Callable[[], str | None] = lambda: None  # why a wait should give up (the worker's owner left)

    @classmethod
    def join(cls, rank: int, size: int, group: Any, timeout_s: float) -> ShmCollectives | None:
        """The group's shared segment, made by rank 0 and mapped by every rank, or None on every rank
        when any could not (a collective over `group`, Gloo)."""
        nbytes = size * LINE + 2 * size * SLOT_BYTES
        fd, memory = -1, None
        try:
            if rank == 0:
                fd = os.memfd_create("shardspec-tp", os.MFD_CLOEXEC)
                os.ftruncate(fd, nbytes)
            where = torch.tensor([os.getpid(), fd], dtype=torch.int64)
            dist.broadcast(where, group_src(group), group=group)
            if rank != 0:
                fd = os.open(f"/proc/{int(where[0])}/fd/{int(where[1])}", os.O_RDWR | os.O_CLOEXEC)
            memory = mmap.mmap(fd, nbytes)
        except OSError as exc:
            log.warning("shared memory for the TP group failed (%s): collectives go through Gloo", exc)
        ok = torch.tensor([int(memory is not None)])
        dist.all_reduce(ok, op=dist.ReduceOp.MIN, group=group)  # (rank 0's descriptor open until all opened it)
        if fd >= 0:
            os.close(fd)  # the mappings keep the memory
        if not ok.item():
            if memory is not None:
                memory.close()
            return None
        counts = memoryview(memory)[: size * LINE].cast("q")
        counts[rank * LINE // 8 + 1] = os.getpid()
        counts.release()
        dist.barrier(group=group)  # every pid written before any rank reads them
        return cls(memory, rank, size, timeout_s)

    def fits(self, x: torch.Tensor) -> bool:
        return x.device.type == "cpu" and x.nbytes <= SLOT_BYTES

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """x summed over the group in rank order, in place."""
        parts = self._exchange(x)
        torch.add(parts[0], parts[1], out=x)
        for part in parts[2:]:
            x.add_(part)
        return x

    def all_gather(self, x: torch.Tensor, dim: int = -1) -> torch.Tensor:
        return torch.cat(self._exchange(x), dim=dim)

    def close(self) -> None:
        self.views.clear()
        self.counts.release()
        del self.data
        self.memory.close()

    def _slots(self, buffer: int, like: torch.Tensor) -> list[torch.Tensor]:
        """Every rank's slot in `buffer` as a tensor shaped like `like` (views kept per shape: a
        decode step's collectives repeat a few shapes, and making views costs microseconds)."""
        key = (buffer, like.dtype, like.shape)
        views = self.views.get(key)
        if views is None:
            if len(self.views) >= MAX_VIEWS:
                self.views.clear()
            starts = [(buffer * self.size + r) * SLOT_BYTES for r in range(self.size)]
            views = self.views[key] = [self.data[s : s + like.nbytes].view(like.dtype).view(like.shape)
                                       for s in starts]
        return views

    def _exchange(self, x: torch.Tensor) -> list[torch.Tensor]:
        """Every rank's x (views of their slots, valid until the collective after the next)."""
        self.n += 1
        slots = self._slots(self.n % 2, x)
        slots[self.rank].copy_(x)
        self.counts[self.line] = self.n
        self._wait(self.n)
        return slots

    def _wait(self, n: int) -> None:
        counts, lines = self.counts, self.peer_lines
        checks = 0
        while counts[lines[0]] < n or any(counts[line] < n for line in lines[1:]):
            checks += 1
            if checks < SPINS:
                continue
            if checks < SPINS + YIELDS:
                os.sched_yield()
                continue
            if checks == SPINS + YIELDS:
                deadline, next_check = time.monotonic() + self.timeout_s, 0.0
            time.sleep(NAP_S)
            now = time.monotonic()
            if now >= next_check:
                self._check_peers(n, now > deadline)
                next_check = now + CHECK_PEERS_S

    def _check_peers(self, n: int, late: bool) -> None:
        if (reason := self.abort()) is not None:
            raise CollectiveFailed(f"a tensor-parallel collective gave up: {reason}")
        for r in self.peers:
            if self.counts[r * LINE // 8] < n and not _alive(self.pids[r]):
                raise CollectiveFailed(f"tensor-parallel rank {r} (pid {self.pids[r]}) died during a collective")
        if late:
            missing = [r for r in self.peers if self.counts[r * LINE // 8] < n]
            raise CollectiveFailed(f"tensor-parallel ranks {missing} did not reach collective {n} within "
                               f"{self.timeout_s:g} s")


def group_src(group: Any) -> int:
    """The global rank of the group's rank 0 (broadcast takes global ranks)."""
    return dist.get_global_rank(group, 0) if group is not None else 0


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state not in ("Z", "X")
