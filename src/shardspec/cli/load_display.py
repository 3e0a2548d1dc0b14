"""A model load's progress for the person who started it: bars on a terminal, lines in a log.

The workers report how much of their shard they have read (protocol.messages.LoadProgress); the
engine hands every rank's latest report to `LoadDisplay`. On a terminal it draws one tqdm bar per
worker (bytes, rate, time left), or one bar for them all past MAX_BARS workers; without one (a
service's log) it writes a line every LOG_EVERY_S.
"""

from __future__ import annotations

import shutil
import sys
import time
from typing import IO

from tqdm import tqdm

from shardspec.protocol.messages import LoadProgress

MAX_BARS = 8  # more workers than this: one bar for all
LOG_EVERY_S = 5.0


class LoadDisplay:
    def __init__(self, labels: list[str], stream: IO[str] | None = None, terminal: bool | None = None):
        self.labels = labels
        self.stream = stream or sys.stderr
        self.terminal = self.stream.isatty() if terminal is None else terminal
        self.bars: list[tqdm] = []
        self.started = time.monotonic()
        self.logged = self.started

    def __call__(self, progress: list[LoadProgress | None]) -> None:
        if self.terminal:
            self._draw(progress)
        elif time.monotonic() - self.logged >= LOG_EVERY_S:
            self.logged = time.monotonic()
            print(f"[shardspec] {self.line(progress)}", file=self.stream, flush=True)

    def line(self, progress: list[LoadProgress | None]) -> str:
        """All workers in one line: the share of bytes read, of how many, the rate and the time left."""
        done, total = _sums(progress)
        known = sum(p is not None for p in progress)
        rate = done / max(time.monotonic() - self.started, 1e-9)
        left = f", about {(total - done) / rate:.0f}s left" if rate > 0 and known == len(progress) else ""
        return (f"loading: {done / max(total, 1):.0%} of {total / 1e9:.2f} GB read by {known} of {len(progress)} "
                f"workers ({rate / 1e6:.0f} MB/s{left})")

    def close(self) -> None:
        for bar in self.bars:
            bar.close()
        self.bars = []

    def _draw(self, progress: list[LoadProgress | None]) -> None:
        groups = [[p] for p in progress] if len(progress) <= MAX_BARS else [progress]
        labels = self.labels if len(progress) <= MAX_BARS else [f"{len(progress)} workers"]
        if not self.bars:
            width = max(len(label) for label in labels)
            size = shutil.get_terminal_size()  # (a fallback where the terminal does not say)
            self.bars = [tqdm(total=0, desc=label.ljust(width), unit="B", unit_scale=True, unit_divisor=1024,
                              position=i, leave=True, file=self.stream, ncols=min(120, size.columns),
                              nrows=max(size.lines, len(labels) + 1))  # (tqdm hides bars past a terminal's rows)
                         for i, label in enumerate(labels)]
        for bar, group in zip(self.bars, groups, strict=True):
            done, total = _sums(group)
            if total and bar.total != total:
                bar.total = total
            bar.update(done - bar.n)


def _sums(progress: list[LoadProgress | None]) -> tuple[int, int]:
    reports = [p for p in progress if p is not None]
    return sum(p.bytes_done for p in reports), sum(p.bytes_total for p in reports)
