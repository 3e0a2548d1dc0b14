"""A worker's profiling window, and a stage link's wait that spins before it blocks."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import pytest
import torch

from shardspec.protocol.codec import Message
from shardspec.protocol.messages import AcceptRecord, StepReply, to_meta
from shardspec.shard_worker.links import POLL_S, StageLinks
from shardspec.shard_worker.profiling import DEFAULT_STEPS, StepProfiler, parse_setting


@pytest.mark.parametrize("text", ["d:5", "d:4:2", "d:-1:3", "d:x:3", ":1:3"])
def test_a_bad_profile_window_is_refused_naming_the_variable(text):
    with pytest.raises(ValueError, match="SHARDSPEC_PROFILE must be DIR or DIR:START:STOP"):
        parse_setting(text)


def test_the_profile_setting_is_a_folder_with_an_optional_window():
    assert parse_setting("/tmp/prof") == (Path("/tmp/prof"), DEFAULT_STEPS)
    assert parse_setting("/tmp/prof:2:9") == (Path("/tmp/prof"), (2, 9))
    assert StepProfiler("").folder is None


def test_the_profiler_records_its_window_of_steps_and_writes_the_report_and_trace(tmp_path):
    profiler = StepProfiler(f"{tmp_path}:1:3")
    x = torch.randn(64, 64)
    for step in range(5):
        profiler.before(step)
        x = x @ x.T / 64
        profiler.after(step, torch.device("cpu"))
    reports = list(tmp_path.glob("worker-*-1.txt"))
    assert len(reports) == 1 and reports[0].read_text().startswith("2 steps in ")
    assert "aten::mm" in reports[0].read_text()
    (trace,) = tmp_path.glob("worker-*-1.json.gz")
    with gzip.open(trace) as f:
        assert json.load(f)["traceEvents"]
    assert not list(tmp_path.glob("worker-*-2.*"))  # one window per load


class _Scripted(StageLinks):
    """A carrier whose message arrives on the `arrives`-th poll; it records each poll's timeout."""

    def __init__(self, spin_s: float, arrives: int):
        super().__init__(timeout_s=5.0, abort=lambda: None)
        self.spin_s, self.arrives, self.timeouts = spin_s, arrives, []

    def _poll(self, seconds: float) -> None:
        self.timeouts.append(seconds)
        if len(self.timeouts) == self.arrives:
            record = AcceptRecord(1, StepReply(seqs=[], tokens=[], accepted=[], drafts=[], finished=[], step_s=0.0))
            self.queue(Message(AcceptRecord.OP, 0, to_meta(record)))


def test_a_wait_spins_on_zero_timeout_polls_and_a_cpu_workers_wait_blocks_at_once():
    spinning = _Scripted(spin_s=10.0, arrives=50)
    assert spinning.recv_record(1).step == 1
    assert spinning.timeouts == [0] * 50
    blocking = _Scripted(spin_s=0.0, arrives=2)
    assert blocking.recv_record(1).step == 1
    assert blocking.timeouts == [POLL_S, POLL_S]
