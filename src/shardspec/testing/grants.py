"""K/V blocks for steps sent straight to a runner, without an orchestrator (tests and benchmarks):
each new sequence gets blocks for its whole context at once, given back when it is released."""

from __future__ import annotations

import dataclasses

from shardspec.protocol.messages import StepRequest
from shardspec.shard_worker.runner import ModelRunner


class Grants:
    def __init__(self, runner: ModelRunner):
        self.runner = runner
        paging = runner.paging
        self.free = list(range(paging.kv_blocks - 1, -1, -1))
        self.per_sequence = paging.max_blocks
        self.held: dict[int, list[int]] = {}

    def __call__(self, request: StepRequest) -> StepRequest:
        """`request` with blocks for each sequence it prefills."""
        specs = [dataclasses.replace(spec, blocks=self._take(spec.seq)) for spec in request.prefill]
        return dataclasses.replace(request, prefill=specs)

    def step(self, request: StepRequest, prompt_ids):
        return self.runner.step(self(request), prompt_ids)

    def release(self, seqs: list[int]) -> list[int]:
        for seq in seqs:
            self.free.extend(self.held.pop(seq, []))
        return self.runner.release(seqs)

    def _take(self, seq: int) -> list[int]:
        if len(self.free) < self.per_sequence:
            raise RuntimeError("more sequences than the runner's blocks hold at full length")
        blocks, self.free = self.free[-self.per_sequence :], self.free[: -self.per_sequence]
        self.held[seq] = blocks
        return blocks
