"""The device work of a decode step, replayed from CUDA graphs.

A decode step of a large model launches hundreds of kernels; dispatching them one by one from
Python costs far more than the GPU needs to run them. So a step's work is captured as fixed-shape
CUDA graphs per batch bucket (and per context bucket when attention reads a context-sized slice)
and replayed. When every sequence decodes greedily (or under forced acceptance) one `fused` pass
does the whole step on the device: verify, accept, commit, draft. Otherwise the step is two passes
around the host's acceptance decision (rejection sampling): `verify` (the target over each
sequence's pending token and drafts, and the greedy argmax) and `draft` (commit the accepted
prefix, run the MTP head over it, chain k new drafts). The batch is padded to its bucket with rows
that touch only a scratch cache slot. The host uploads one packed int64 tensor per pass.

Under pipeline stages the link I/O stays outside the graphs: a stage after the first reads its
input hidden states from a buffer per bucket (the received frame, one host-to-device copy), and a
stage before the last captures its layers alone (verify, no LM head) and the commit of the accepted
prefix (in place of draft), which runs when the last stage's record comes, after other steps: each
bucket has `copies`, one per step still to commit, and each copy index its own graph pool, so that
no other step's graphs reuse the memory of a held copy's outputs as their temporaries.

A greedy pass can run `again` on its own outputs: the rows of the step after it built on the device
(each row's new token and drafts, its length past what it kept), so that the runner can queue the
next step's pass before the host has read this one's (ModelRunner, "launch ahead").
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from shardspec import kernels
from shardspec.shard_worker.sequences import Rows

BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
MIN_CONTEXT_BUCKET = 256
# the verify graphs of buckets up to this size keep the LM head's logits as an output (bf16, V / tp a
# row: 2 MB a row at Qwen3.5's vocabulary, ~250 MB over the buckets to 64 at k = 3), so that a step
# that samples or masks reads the head once; larger buckets compute them again after the graph
LOGITS_BUCKET_MAX = 64

# (packed, context, input hidden states or None, keep_logits) -> (hidden, argmax (None before the last
# stage), what the pass saved for the commit: Batch.saved, the LM head's raw logits where kept, else None)
VerifyFn = Callable[[torch.Tensor, int, torch.Tensor | None, bool],
                    tuple[torch.Tensor, torch.Tensor | None, dict, torch.Tensor | None]]
# (packed, accepts, hidden, saved, context) -> the next drafts [B, k] (before the last stage: the commit, None)
DraftFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, dict, int], torch.Tensor | None]
FusedFn = Callable[[torch.Tensor, int, torch.Tensor | None], torch.Tensor]  # (packed, context, input) -> [B, 2 + k]
Follow = Callable[[list[list[int]]], torch.Tensor | None]  # accepts -> the draft (or commit) of a verify


def bucket_size(n: int) -> int | None:
    """The batch bucket of n sequences (None: more than the largest bucket)."""
    return next((b for b in BATCH_BUCKETS if b >= n), None)


def upload(rows: list, device: torch.device) -> torch.Tensor:
    """Host ints to a device int64 tensor in one copy (pinned and asynchronous on a GPU)."""
    host = torch.tensor(rows, dtype=torch.long)
    if device.type == "cpu":
        return host
    return host.pin_memory().to(device, non_blocking=True)


class PinnedUpload:
    """The uploads of one device tensor a graph reads, through a pinned host buffer of its shape: one
    copy into the buffer, one asynchronous copy onto the device (no pinning per upload, no copy from
    pageable memory, which waits for the device). An upload first waits for the last one to be done
    (long done in practice: the step that read it has ended)."""

    def __init__(self, target: torch.Tensor):
        self.target = target
        self.host = torch.empty(target.shape, dtype=target.dtype, pin_memory=True)
        self.done = torch.cuda.Event()

    def __call__(self, data: torch.Tensor | list) -> None:
        """data (host tensor or nested list) into the first rows of the target."""
        data = torch.as_tensor(data, dtype=self.target.dtype)
        self.done.synchronize()
        n = data.shape[0]
        self.host[:n].copy_(data)
        self.target[:n].copy_(self.host[:n], non_blocking=True)
        self.done.record()


@dataclass
class HostRows:
    """A pass's output rows on their way to the host, queued behind the pass on the device."""

    host: torch.Tensor
    done: torch.cuda.Event | None  # None: on the CPU, already there

    @classmethod
    def copy(cls, out: torch.Tensor) -> HostRows:
        if out.device.type == "cpu":
            return cls(out.clone(), None)  # (an eager pass's own tensor; a clone all the same)
        host = torch.empty(out.shape, dtype=out.dtype, pin_memory=True)
        host.copy_(out, non_blocking=True)
        done = torch.cuda.Event()
        done.record()
        return cls(host, done)

    def ready(self) -> bool:
        return self.done is None or self.done.query()

    def rows(self) -> list[list[int]]:
        """Wait for the copy (not for whatever the device queued after it) and read it."""
        if self.done is not None:
            self.done.synchronize()
        return self.host.tolist()


@dataclass
class _Last:
    """The last greedy pass of a single stage: what `again` continues."""

    packed: torch.Tensor  # its input rows, the live ones first (padded in a bucket)
    out: torch.Tensor  # its result, [B, 2 + k]
    context: int
    bucket: _Bucket | None  # None: it ran eagerly


@dataclass
class _Bucket:
    """The graphs of one (batch bucket, context bucket), captured at load (capture_all) or on first use."""

    context: int
    copy: int  # its copy index: the graph pool it is captured in
    padding: torch.Tensor  # rows of padding only: what the graphs are captured on
    packed: torch.Tensor  # the input rows every graph reads
    accepts: torch.Tensor  # the draft graph's second input: [accepted, new token, forced count, k forced drafts]
    inputs: torch.Tensor | None  # a stage after the first: the hidden states the graphs read [size, k + 1, H]
    graphs: dict[str, tuple[torch.cuda.CUDAGraph, Any]] = field(default_factory=dict)
    uploads: dict[str, PinnedUpload] = field(default_factory=dict)  # of packed, accepts and inputs

    def upload(self, name: str, data: torch.Tensor | list) -> None:
        if name not in self.uploads:
            self.uploads[name] = PinnedUpload(getattr(self, name))
        self.uploads[name](data)


class StepPasses:
    """greedy(rows, context, x), or verify(rows, context, x) then its follow(accepts); eager or from
    graphs; outputs are valid until the next call (a held copy's, until its follow). rows:
    one per sequence, as sequences.Rows lays them out; accepts: [accepted, new token] and, for a
    draft pass under a grammar, [forced count m, m forced drafts, zeros to k] (Decoder._follow_rows); x: the
    stage before's hidden states [B, k + 1, H] on the host, None on the first stage.

    `inputs` (hidden size, dtype): the stage reads the stage before's hidden states, not token ids.
    `copies` of each bucket: how many verifies may wait for their follow at once (a stage before the
    last: its steps in flight); one more runs eagerly. fused_fn None: the stage has no fused pass."""

    def __init__(self, verify_fn: VerifyFn, draft_fn: DraftFn, fused_fn: FusedFn | None, device: torch.device,
                 rows: Rows, scratch_slot: int, max_context: int, graphs: bool,
                 inputs: tuple[int, torch.dtype] | None = None, copies: int = 1):
        self.verify_fn, self.draft_fn, self.fused_fn = verify_fn, draft_fn, fused_fn
        self.device = device
        self.rows = rows
        self.draft_len = rows.draft_len
        self.pad_row = rows.padding(scratch_slot)
        self.max_context = max_context
        self.graphs = graphs and device.type == "cuda"
        self.inputs, self.copies = inputs, copies
        self.buckets: dict[tuple[int, int, int], _Bucket] = {}  # (batch bucket, context bucket, copy)
        # per copy index: its graph pool, and whether one of its buckets' verify outputs wait for their
        # follow pass (the commit of a step in flight), so no other graph of the pool may run
        self.pools = [torch.cuda.graph_pool_handle() for _ in range(copies)] if self.graphs else []
        self.held = [False] * copies
        self.last: _Last | None = None  # the last greedy pass of a single stage (`again`)
        self.logits: torch.Tensor | None = None  # the last verify's raw logits, where kept (verify; greedy at k = 0)
        self.word_uploads: dict[torch.Size, PinnedUpload] = {}  # grammar bit masks by shape (device_words)

    def greedy(self, rows: list[list[int]], context: int, x: torch.Tensor | None = None,
               keep_logits: bool = False) -> torch.Tensor:
        """The pass of a step every row of which decodes greedily or under forced acceptance, all on
        the device: [B, 2 + k] = (accepted, token, drafts); the fused pass (k > 0), or the verify
        pass's argmax as (0, token) (k = 0; with `keep_logits`, `logits` is then its raw logits)."""
        bucket = self._upload(rows, context, x)
        packed = upload(rows, self.device) if bucket is None else bucket.packed
        return self._greedy(packed, len(rows), min(context, self.max_context), bucket, x, keep_logits)

    def can_go_again(self) -> bool:
        """Whether `again` can continue the last greedy pass: there is one, and its graph serves the
        next pass's context (without the in-place attention kernel, graphs are per context bucket)."""
        last = self.last
        if last is None or last.bucket is None:
            return last is not None
        return self._context_bucket(last.context + self.draft_len + 1) == last.bucket.context

    def again(self, forced: list[list[int]] | None = None, keep_logits: bool = False) -> torch.Tensor:
        """The last greedy pass of a single stage once more, on the rows of the step after it, built on
        the device from its rows and result (Rows.following; `forced` [[n]] per row, k > 0; None: as
        before). The caller has queued the copy of the result it
        reads (HostRows.copy): this pass overwrites it. Returns what `greedy` returns."""
        last, k = self.last, self.draft_len
        if last is None:
            raise RuntimeError("again() continues a greedy pass of a single stage; there is none")
        rows = last.packed[: len(last.out)]  # (at k = 0 the result's accepted column is 0)
        rows.copy_(self.rows.following(rows, last.out, None if forced is None else upload(forced, self.device)))
        return self._greedy(last.packed, len(last.out), min(last.context + k + 1, self.max_context), last.bucket,
                            keep_logits=keep_logits)

    def _greedy(self, packed: torch.Tensor, n: int, context: int, bucket: _Bucket | None,
                x: torch.Tensor | None = None, keep_logits: bool = False) -> torch.Tensor:
        k = self.draft_len
        if bucket is None:
            x = self._to_device(x)
            out = self.fused_fn(packed, context, x) if k else self.verify_fn(packed, context, x, keep_logits)
        else:
            out = self._replay(bucket, "fused") if k else self._replay(bucket, "verify")
        if not k:  # (its raw logits: the tokens a grammar's masks choose, Decoder._masked_greedy)
            self.logits = out[3][:n] if keep_logits and out[3] is not None else None
            out = out[1]
        out = out[:n]
        if not k:
            out = torch.cat([torch.zeros_like(out[:, :1]), out[:, :1]], 1)
        self.last = _Last(packed, out, context, bucket) if x is None else None
        return out

    def replays(self, n: int) -> bool:
        """Whether a pass of n rows replays a graph (or, without graphs, runs as every pass does): a
        pass launched ahead is worth queueing then, not where dispatching it eagerly delays the reply."""
        return not self.graphs or bucket_size(n) is not None

    def keeps_logits(self, n: int) -> bool:
        """Whether a greedy pass of n rows at k = 0 keeps its LM head's raw logits (`logits`): eagerly,
        and in the graphs of buckets up to LOGITS_BUCKET_MAX."""
        size = bucket_size(n) if self.graphs else None
        return size is None or size <= LOGITS_BUCKET_MAX

    def settle(self, out: torch.Tensor) -> None:
        """The last greedy pass's result (k = 0) replaced with `out` [B, 2] = (0, token): the tokens the
        caller chose from its `logits` (under a grammar's masks), which `again` then continues."""
        if self.last is not None:
            self.last.out = out

    def device_words(self, words: torch.Tensor) -> torch.Tensor:
        """Host int32 bit masks [B, W] on the device: through a pinned buffer per B on a GPU (one
        asynchronous copy that does not wait for the passes queued before it), as they are on the CPU."""
        if self.device.type == "cpu":
            return words
        upload = self.word_uploads.get(words.shape)
        if upload is None:
            upload = self.word_uploads[words.shape] = PinnedUpload(torch.empty(words.shape, dtype=words.dtype,
                                                                               device=self.device))
        upload(words)
        return upload.target

    def verify(self, rows: list[list[int]], context: int, x: torch.Tensor | None = None,
               eager_follow: bool = False) -> tuple[torch.Tensor, torch.Tensor | None, Follow]:
        """(hidden, argmax, the follow pass of this verify: draft, or commit before the last stage);
        `eager_follow`: the follow runs eagerly (it drafts under a grammar's masks, on the host), after
        the verify pass's graph where there is one. On the last stage `self.logits` is then the LM
        head's raw logits of the pass (valid until the next pass), or None where its graph keeps none."""
        B = len(rows)
        bucket = self._upload(rows, context, x)
        if bucket is None:
            packed, context = upload(rows, self.device), min(context, self.max_context)
            hidden, argmax, saved, self.logits = self.verify_fn(packed, context, self._to_device(x), True)
            return hidden, argmax, lambda accepts: self.draft_fn(packed, upload(accepts, self.device), hidden, saved,
                                                                 context)
        hidden, argmax, saved, logits = self._replay(bucket, "verify")
        self.logits = None if logits is None else logits[:B]
        self.held[bucket.copy] = self.draft_len > 0

        def follow(accepts: list[list[int]]) -> torch.Tensor | None:
            width = bucket.accepts.shape[1]
            bucket.upload("accepts", [row + [0] * (width - len(row)) for row in accepts]
                          + [[0] * width] * (len(bucket.packed) - B))
            self.held[bucket.copy] = False
            if eager_follow:
                out = self.draft_fn(bucket.packed, bucket.accepts, hidden, saved, bucket.context)
            else:
                out = self._replay(bucket, "draft")
            return None if out is None else out[:B]

        return hidden[:B], None if argmax is None else argmax[:B], follow

    def capture_all(self, max_batch: int) -> int:
        """Capture, ahead of any step, every graph a step of up to max_batch sequences can replay:
        otherwise the first step at each batch bucket (a batch shrinks as its sequences finish)
        stalls on a capture, tens to hundreds of milliseconds. Only where one context bucket covers
        every context (the kernels read the cache in place). Largest bucket first, so that the
        smaller ones reuse its freed temporaries in the shared pool. Returns the graphs captured."""
        if not self.graphs or not kernels.active():
            return 0
        top = bucket_size(max_batch) or BATCH_BUCKETS[-1]  # larger batches run eagerly
        sizes = [b for b in BATCH_BUCKETS if b <= top]
        # verify captures draft with it
        names = ["fused", "verify"] if self.draft_len and self.fused_fn is not None else ["verify"]
        before = sum(len(bucket.graphs) for bucket in self.buckets.values())
        for size in reversed(sizes):
            for copy in range(self.copies):
                bucket = self._bucket(size, self.max_context, copy)
                for name in names:
                    if name not in bucket.graphs:
                        self._capture(bucket, name)
        return sum(len(bucket.graphs) for bucket in self.buckets.values()) - before

    def close(self) -> None:
        """Drop every graph and what they hold (the pool's memory goes back once nothing else
        holds it: the caller also drops the layers' references to the last pass)."""
        self.buckets.clear()
        self.word_uploads.clear()
        self.last = self.logits = None

    def _upload(self, rows: list[list[int]], context: int, x: torch.Tensor | None) -> _Bucket | None:
        """The rows, padded, and the input hidden states into a free copy of their bucket (None: no
        graph for this batch, or every copy held: run eagerly)."""
        size = bucket_size(len(rows)) if self.graphs else None
        if size is None:
            return None
        # with one copy (the last stage) a verify's follow runs before the next verify, or never (a failed step)
        copy = next((i for i, held in enumerate(self.held) if not held), 0 if self.copies == 1 else None)
        if copy is None:
            return None
        bucket = self._bucket(size, self._context_bucket(context), copy)
        bucket.upload("packed", rows + [self.pad_row] * (size - len(rows)))
        if x is not None:  # padding rows keep whatever they held: they touch the scratch slot
            bucket.upload("inputs", x)
        return bucket

    def _to_device(self, x: torch.Tensor | None) -> torch.Tensor | None:
        return None if x is None else x.to(self.device, copy=True)  # (a received frame is read-only)

    def _bucket(self, size: int, context: int, copy: int = 0) -> _Bucket:
        bucket = self.buckets.get((size, context, copy))
        if bucket is None:
            padding = torch.tensor([self.pad_row] * size, dtype=torch.long, device=self.device)
            accepts = torch.zeros(size, 3 + self.draft_len if self.draft_len else 2, dtype=torch.long,
                                  device=self.device)
            inputs = None
            if self.inputs is not None:
                hidden, dtype = self.inputs
                inputs = torch.zeros(size, self.draft_len + 1, hidden, dtype=dtype, device=self.device)
            bucket = _Bucket(context, copy, padding, padding.clone(), accepts, inputs)
            self.buckets[size, context, copy] = bucket
        return bucket

    def _context_bucket(self, context: int) -> int:
        if kernels.active():  # attention reads the cache in place up to each position: any context
            return self.max_context
        return min(self.max_context, max(MIN_CONTEXT_BUCKET, 1 << (context - 1).bit_length()))

    def _replay(self, bucket: _Bucket, name: str) -> Any:
        if name not in bucket.graphs:
            self._capture(bucket, name)
        graph, outputs = bucket.graphs[name]
        graph.replay()
        return outputs

    def _capture(self, bucket: _Bucket, name: str) -> None:
        """Capture on padding rows (the warm-up runs really run: they must touch only the scratch
        slot; the input hidden states, which the layers only read, may be anything), then put the
        step's rows back."""
        rows = bucket.packed.clone()
        bucket.packed.copy_(bucket.padding)
        packed, accepts, context, x = bucket.packed, bucket.accepts, bucket.context, bucket.inputs
        if name == "fused":
            bucket.graphs["fused"] = self._graph(lambda: self.fused_fn(packed, context, x), bucket.copy)
        else:
            # verify and draft together: the draft graph reads the verify graph's outputs (hidden
            # states, the saved inputs of the commit); the bucket owns them, so no later capture
            # can take their memory from the pool
            keep = len(packed) <= LOGITS_BUCKET_MAX
            bucket.graphs["verify"] = self._graph(lambda: self.verify_fn(packed, context, x, keep), bucket.copy)
            if self.draft_len:
                hidden, _, saved, _ = bucket.graphs["verify"][1]
                bucket.graphs["draft"] = self._graph(lambda: self.draft_fn(packed, accepts, hidden, saved, context),
                                                     bucket.copy)
        bucket.packed.copy_(rows)

    def _graph(self, fn: Callable[[], Any], copy: int) -> tuple[torch.cuda.CUDAGraph, Any]:
        return capture(fn, self.device, self.pools[copy])


def capture(fn: Callable[[], Any], device: torch.device, pool: Any) -> tuple[torch.cuda.CUDAGraph, Any]:
    """fn's device work as a CUDA graph in `pool`, and the outputs it writes on each replay; fn runs
    twice first on a side stream, outside the capture (lazy init, library handles, autotuning)."""
    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):
        for _ in range(2):
            fn()
    torch.cuda.current_stream(device).wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool):
        outputs = fn()
    return graph, outputs
