"""A worker's steps under PyTorch's profiler, for finding where a step's time goes in the real engine.

    SHARDSPEC_PROFILE=DIR shardspec ...            # steps 16 to 47 of each load
    SHARDSPEC_PROFILE=DIR:START:STOP shardspec ...

Every worker started with SHARDSPEC_PROFILE set records its steps [START, STOP) of each loaded
model (counted from the load) and then writes, into DIR:
- `worker-<pid>-<n>.txt` (the worker's n-th window): the GPU kernels' time per step against the wall
  time of the window (how much of a step the device was busy), the host's marks, and the operator
  table by device time (a window that does not reach its last step is not written);
- `worker-<pid>-<n>.json.gz`: the Chrome trace of the window (chrome://tracing, Perfetto), whose
  timestamps share the host's clock, so the traces of workers on one machine line up
  (bench/trace_gaps.py).
The workers mark their parts of a step (`step`, `reply`, `link wait`, `link send`) in the trace.
Profiling slows the host a little; the figures are for finding gaps, not for the benchmark tables.
"""

from __future__ import annotations

import gzip
import logging
import os
import shutil
import time
from collections import deque
from contextlib import AbstractContextManager, nullcontext
from pathlib import Path

import torch

log = logging.getLogger("shardspec.worker")

PROFILE_ENV = "SHARDSPEC_PROFILE"
MARKS = ("step", "reply", "link wait", "link send")  # the ranges the worker marks (mark())
DEFAULT_STEPS = (16, 48)


def parse_setting(text: str) -> tuple[Path, tuple[int, int]]:
    """'DIR' or 'DIR:START:STOP' -> (DIR, (START, STOP)), 0 <= START < STOP; ValueError naming the
    variable otherwise. A DIR whose name ends in ':<digits>' needs the window after it."""
    head, _, last = text.rpartition(":")
    if not head or not last.lstrip("-").isdigit():
        return Path(text), DEFAULT_STEPS
    folder, _, first = head.rpartition(":")
    try:
        start, stop = int(first), int(last)
    except ValueError:
        start = stop = -1
    if not folder or not 0 <= start < stop:
        raise ValueError(f"{PROFILE_ENV} must be DIR or DIR:START:STOP (steps after a load, "
                         f"0 <= START < STOP), got {text!r}")
    return Path(folder), (start, stop)


TIMELINE_EVENTS = 4096  # events a worker keeps for StatsReply.timeline


class Timeline:
    """The last TIMELINE_EVENTS events of a worker's steps (protocol.messages.TimelineEvent), for
    reading off where a pipeline step waits; cheap enough to keep always (a clock read and an append)."""

    def __init__(self) -> None:
        self.events: deque[tuple[int, str, float]] = deque(maxlen=TIMELINE_EVENTS)

    def add(self, step: int, event: str) -> None:
        self.events.append((step, event, time.time()))


def mark(name: str) -> AbstractContextManager:
    """A named range in the trace while a profiler records, else nothing."""
    return torch.profiler.record_function(name) if torch.autograd._profiler_enabled() else nullcontext()


class StepProfiler:
    """Starts the profiler before step `start` of a load and writes its report after step `stop` - 1."""

    def __init__(self, setting: str | None = None):
        """`setting`: as SHARDSPEC_PROFILE (default: its value); empty: no profiling."""
        setting = os.environ.get(PROFILE_ENV, "") if setting is None else setting
        self.folder: Path | None = None
        self.start, self.stop = DEFAULT_STEPS
        if setting:
            self.folder, (self.start, self.stop) = parse_setting(setting)
        self.profiler: torch.profiler.profile | None = None
        self.began = 0.0
        self.written = 0  # windows written
        if self.folder is not None:
            self.folder.mkdir(parents=True, exist_ok=True)

    def before(self, step: int) -> None:
        """Called before the load's step number `step` (0-based) runs."""
        if self.folder is None or step != self.start or self.profiler is not None:
            return  # (a step that failed runs again under the same number: the window is already open)
        activities = [torch.profiler.ProfilerActivity.CPU]
        if torch.cuda.is_available():
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        self.profiler = torch.profiler.profile(activities=activities)
        self.profiler.__enter__()
        self.began = time.perf_counter()

    def after(self, step: int, device: torch.device) -> None:
        """Called after step `step` ran (and its reply went out)."""
        if self.profiler is None or step != self.stop - 1:
            return
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        wall = time.perf_counter() - self.began
        profiler, self.profiler = self.profiler, None
        profiler.__exit__(None, None, None)
        self._write(profiler, wall, self.stop - self.start)

    def close(self) -> None:
        """Close a window the load ends before its last step (nothing is written)."""
        profiler, self.profiler = self.profiler, None
        if profiler is not None:
            profiler.__exit__(None, None, None)

    def _write(self, profiler: torch.profiler.profile, wall: float, steps: int) -> None:
        self.written += 1
        name = f"worker-{os.getpid()}-{self.written}"
        events = profiler.key_averages()
        device_events = [e for e in events if e.device_type == torch.autograd.DeviceType.CUDA and e.key not in MARKS]
        busy_us = sum(e.self_device_time_total for e in device_events)
        kernels = sum(e.count for e in device_events)
        marks = {e.key: e for e in events if e.key in MARKS and e.device_type != torch.autograd.DeviceType.CUDA}
        lines = [f"{steps} steps in {1000 * wall:.2f} ms: {1000 * wall / steps:.3f} ms a step; device busy "
                 f"{busy_us / 1000 / steps:.3f} ms a step ({busy_us / 1e4 / wall:.0f} %), {kernels / steps:.0f} "
                 "device operations a step"]
        for key, event in marks.items():
            lines.append(f"{key}: {event.cpu_time_total / 1000 / steps:.3f} ms a step (host)")
        sort = "self_device_time_total" if device_events else "cpu_time_total"
        lines.append(events.table(sort_by=sort, row_limit=40, max_name_column_width=70))
        (self.folder / f"{name}.txt").write_text("\n".join(lines) + "\n")
        trace = self.folder / f"{name}.json"
        profiler.export_chrome_trace(str(trace))
        with trace.open("rb") as raw, gzip.open(f"{trace}.gz", "wb") as packed:
            shutil.copyfileobj(raw, packed)
        trace.unlink()
        log.info("profile of %d steps written to %s.txt and .json.gz", steps, self.folder / name)


TEST_HANG_ENV = "SHARDSPEC_TEST_HANG_STEP"  # tests only: "N:S" sleeps S seconds in this process's Nth step, once


def _test_hang() -> list[float] | None:
    value = os.environ.get(TEST_HANG_ENV)
    if not value:
        return None
    step, _, seconds = value.partition(":")
    return [int(step), float(seconds or 60)]


_TEST_HANG = _test_hang()


def hang_for_test() -> None:
    """Tests of the step watchdog only: hang once, outside any collective; heartbeats keep flowing."""
    if _TEST_HANG is not None:
        _TEST_HANG[0] -= 1
        if _TEST_HANG[0] == 0:
            log.warning("%s: hanging in this step for %gs (a test hook)", TEST_HANG_ENV, _TEST_HANG[1])
            time.sleep(_TEST_HANG[1])
