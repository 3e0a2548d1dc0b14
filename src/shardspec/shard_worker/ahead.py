"""Launch ahead: the next step's pass queued on the device behind the current one.

A single stage whose next request is already queued (the orchestrator keeps the next step on
the wire) and continues the current one (the same sequences, greedy, no
prefill) queues that step's pass on the device right behind the current one, its rows built on the
device from the current pass's outputs (graphs.StepPasses.again). The host then reads this step's
outputs, replies and takes the next request while the device runs the next pass, instead of the
device waiting for the host between steps. The next step's rows hold the sequences this one may
finish; their rows run on and are dropped (a finished sequence's caches are never read again).

Under a grammar at k = 0 the tokens are chosen under its masks on the device (Decoder._masked_greedy),
so those steps launch ahead too: the masks of a step are computed while its pass runs. A step the
host decides (sampled, penalised, under a grammar with MTP, with log-probabilities) launches the next
step's verify pass once it has decided, on the rows it has just built, before its reply
(LaunchAhead.verify_next): the reply, the next request and the next masks then run beside that pass.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from shardspec.protocol.messages import StepRequest
from shardspec.shard_worker.graphs import HostRows

if TYPE_CHECKING:
    from shardspec.shard_worker.decoder import Decoder
    from shardspec.shard_worker.sequences import Sequence

# the next request as soon as it is queued, or None once until() is true (the current pass is done)
Peek = Callable[[Callable[[], bool]], StepRequest | None]


@dataclass
class Launched:
    """A pass queued ahead of its step: the sequences of its rows, and its outputs' copy (a greedy
    pass) or what graphs.StepPasses.verify returned and its raw logits (a verify pass)."""

    seqs: list[int]
    out: HostRows | None  # a greedy pass's (None: a verify pass)
    masked: bool = False  # a greedy pass whose tokens its step chooses under grammar masks (Decoder._masked_greedy)
    verify: tuple | None = None  # a verify pass's (hidden, argmax, follow, raw logits)


class LaunchAhead:
    """Queues the next step's pass behind the current one when the next request, seen through `peek`,
    continues it (Decoder.continues): a greedy pass while the current greedy pass runs (follow), or a
    verify pass once the host has decided the current step (verify_next)."""

    def __init__(self, peek: Peek):
        self.peek = peek
        self.launched: Launched | None = None  # the pass queued for the next step
        self.count = 0  # passes launched ahead

    def take(self, request: StepRequest) -> Launched | None:
        """The pass launched for this step, if any (a step that is not the one it was launched for is
        a bug: said as one)."""
        launched, self.launched = self.launched, None
        if launched is not None and (request.prefill or request.return_logits or request.grow
                                     or request.decode != launched.seqs):
            raise RuntimeError("a pass was launched ahead for a step that did not come next")
        return launched

    def follow(self, decoder: Decoder, current: Launched) -> None:
        """While `current` runs: queue the next step's pass if the next request continues it."""
        following = self.peek(current.out.ready)
        if decoder.continues(following, current.seqs):
            forced = None
            if decoder.forced is not None:
                forced = [[decoder.sequences[seq].forced(decoder.forced)] for seq in current.seqs]
            out = decoder.passes.again(forced, keep_logits=current.masked)
            self.launched = Launched(current.seqs, HostRows.copy(out), current.masked)
            self.count += 1

    def verify_next(self, decoder: Decoder, seqs: list[Sequence]) -> None:
        """After a step the host decided (a verify pass, then its acceptance on the host: sampled,
        penalised, shaped, logprobs): queue the next step's verify pass on the rows the host has just
        built, if the next request, queued already, continues this step; the host then replies and
        takes that request (and computes its masks) while the device runs it."""
        order = [s.seq for s in seqs]
        if decoder.passes.replays(len(seqs)) and decoder.continues(self.peek(lambda: True), order, greedy=False):
            self.launched = Launched(order, None, verify=decoder.launch_verify(seqs))
            self.count += 1

    def drop(self) -> None:
        self.launched = None


class NoLaunchAhead:
    count = 0

    def take(self, request: StepRequest) -> None:
        return None

    def follow(self, decoder: Decoder, current: Launched) -> None:
        pass

    def verify_next(self, decoder: Decoder, seqs: list[Sequence]) -> None:
        pass

    def drop(self) -> None:
        pass
