"""Property-based fuzzing (hypothesis) of every op's header and meta fields against one live worker.

The strategies are built from the op dataclasses in `protocol.messages`, so every field of every
request is fuzzed, and a field added later is fuzzed too. Half of the messages are well-formed (so
that sequences really prefill, decode and release, and the worker really loads, resets and
re-inits); the other half carry wrong-typed, out-of-range, missing or unknown fields, broken
headers and broken tensor frames. Properties: every message gets one decodable reply carrying its
request id, the worker never dies, and no cache slot is ever lost (free + live = total after every
batch, and all free once the live sequences are released).
"""

from __future__ import annotations

import dataclasses
import math
import struct
import typing

import msgpack
import pytest
from conftest import SyncClient
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from shardspec.protocol import PROTOCOL_VERSION, REPLIES, REQUESTS, decode, parse, peek_id
from shardspec.protocol.codec import DTYPES
from shardspec.protocol.messages import MAX_STR, LoadProgress, PrefillSpec

BATCH = 10  # messages per hypothesis example
EXAMPLES = 300  # -> 3,000 fuzzed messages
VOCAB = 512  # the tiny test model's
SEQS = st.integers(0, 12)  # few sequence ids, so steps, decodes and releases meet live sequences

# how often each op is drawn (a valid shutdown or load resets the worker, which makes later
# messages of the batch meet an idle worker: useful, but not most of the time)
OPS = ["step"] * 16 + ["release"] * 6 + ["stats"] * 4 + ["hello"] * 4 + ["init"] * 4 + ["load"] * 3 + ["shutdown"]

JUNK = st.one_of(
    st.none(), st.booleans(), st.integers(-(2**63), 2**64 - 1), st.floats(), st.text(max_size=8),
    st.binary(max_size=8), st.lists(st.integers(-3, 3), max_size=3),
    st.dictionaries(st.text(max_size=3), st.integers(-5, 5), max_size=2),
)


def overrides(model: str) -> dict[tuple[str, str], st.SearchStrategy]:
    """Valid values narrowed where the full range would make the worker slow or big, not wrong:
    a multi-rank init with a tcp:// rendezvous waits timeout_s for peers, and a load of 4096
    slots x 4M tokens would allocate terabytes."""
    return {
        ("InitRequest", "rank"): st.integers(0, 2),
        # a valid multi-rank init waits (up to timeout_s) for peers that never come: by design, so
        # valid inits are single-rank; out-of-range and junk world sizes are still drawn
        ("InitRequest", "world_size"): st.just(1),
        ("InitRequest", "dist_addr"): st.text(max_size=20).filter(lambda s: not s.startswith("tcp://")),
        ("LoadRequest", "model"): st.sampled_from([model, model, model, "/nonexistent", ""]),
        ("LoadRequest", "dtype"): st.sampled_from(["auto", "auto", "float32", "bfloat16", "float16", "float64", ""]),
        ("LoadRequest", "max_seqs"): st.integers(1, 8),
        ("LoadRequest", "max_seq_len"): st.integers(1, 256),
        ("LoadRequest", "mtp"): st.sampled_from(["auto", "on", "off", "yes"]),
        ("PrefillSpec", "seq"): SEQS,
        ("PrefillSpec", "length"): st.integers(1, 8),
        ("PrefillSpec", "max_tokens"): st.integers(1, 40),
        ("PrefillSpec", "stop_ids"): st.lists(st.integers(0, VOCAB + 5), max_size=3),
        # ids of the pool a load of ensure_loaded's has (4 sequences of 128 positions: 20 blocks); one covers a prompt
        ("PrefillSpec", "blocks"): st.lists(st.integers(0, 19), min_size=1, max_size=2),
        # the prefix cache's fields, within a load's saved states and blocks (restoring a state never saved is
        # harmless: only the numbers are wrong); a grammar a worker without tokenizer.json refuses
        ("PrefillSpec", "cached"): st.integers(0, 8),
        ("PrefillSpec", "state"): st.integers(-1, 8),
        ("PrefillSpec", "copy_from"): st.integers(-1, 19),
        ("PrefillSpec", "saves"): st.lists(st.fixed_dictionaries({"position": st.integers(1, 8),
                                                                  "state": st.integers(0, 8)}), max_size=2),
        ("PrefillSpec", "output"): st.integers(0, 8),
        ("PrefillSpec", "grammar"): st.sampled_from(["", "", "", 'start: "a"', "{not a grammar"]),
        ("PrefillSpec", "logit_bias"): st.lists(st.fixed_dictionaries({
            "token": st.integers(0, VOCAB + 5), "bias": st.floats(-100, 100)}), max_size=2),
        ("ReleaseRequest", "saves"): st.lists(st.fixed_dictionaries({"seq": SEQS, "state": st.integers(0, 8)}),
                                              max_size=2),
        ("StepRequest", "prefill"): None,  # built by _prefills, with a matching prompt tensor
        ("StepRequest", "grow"): st.lists(st.fixed_dictionaries({"seq": SEQS, "blocks": st.lists(st.integers(0, 19),
                                                                                                max_size=2)}),
                                          max_size=2),
        ("StepRequest", "decode"): st.lists(SEQS, max_size=6),
        ("ReleaseRequest", "seqs"): st.lists(SEQS, max_size=6),
    }


def _valid_of_type(tp: typing.Any, lo: typing.Any = None, hi: typing.Any = None) -> st.SearchStrategy:
    origin = typing.get_origin(tp)
    if tp is bool:
        return st.booleans()
    if tp is int:
        return st.integers(-(2**63) if lo is None else lo, 2**63 - 1 if hi is None else hi)
    if tp is float:
        return st.floats(lo, hi, allow_nan=False, allow_infinity=False)
    if tp is str:
        return st.text(max_size=16)
    if origin is list:
        return st.lists(_valid_of_type(typing.get_args(tp)[0]), max_size=4)
    raise TypeError(tp)


def _invalid(tp: typing.Any, lo: typing.Any, hi: typing.Any) -> st.SearchStrategy:
    """Wrong types, and values just outside the field's range (JUNK may hit a valid value: fine)."""
    edges = []
    if lo is not None:
        edges = [lo - 1, hi + 1] if tp is int else [lo - 0.5, hi + 0.5, math.nan, math.inf]
    elif tp is float:
        edges = [math.nan, -math.inf]
    elif tp is str:
        edges = ["x" * (MAX_STR + 1)]
    return st.one_of(JUNK, st.sampled_from(edges)) if edges else JUNK


@st.composite
def meta_of(draw, cls: type, clean: bool, narrowed: dict) -> dict:
    """A meta map for `cls`: all valid when clean; else each field may be wrong, missing or extra."""
    hints = typing.get_type_hints(cls)
    meta = {}
    for f in dataclasses.fields(cls):
        tp, (lo, hi) = hints[f.name], f.metadata.get("range", (None, None))
        required = f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
        choice = "valid" if clean else draw(st.sampled_from(["valid", "valid", "valid", "invalid", "missing"]))
        if choice == "missing" or (not required and draw(st.integers(0, 4)) == 0):
            continue
        if choice == "invalid":
            meta[f.name] = draw(_invalid(tp, lo, hi))
        elif dataclasses.is_dataclass(tp):
            meta[f.name] = draw(meta_of(tp, clean or draw(st.booleans()), narrowed))
        elif (key := (cls.__name__, f.name)) in narrowed:
            if narrowed[key] is not None:
                meta[f.name] = draw(narrowed[key])
        else:
            meta[f.name] = draw(_valid_of_type(tp, lo, hi))
    if not clean and draw(st.integers(0, 5)) == 0:
        meta[draw(st.text(min_size=1, max_size=8))] = draw(JUNK)
    return meta


@st.composite
def _prefills(draw, clean: bool, narrowed: dict) -> tuple[list, bytes, dict]:
    """Prefill specs, the prompt_ids frame and its tensor spec (mostly matching the specs)."""
    specs = draw(st.lists(meta_of(PrefillSpec, clean, narrowed), max_size=3))
    total = sum(s["length"] for s in specs if type(s.get("length")) is int and 0 < s["length"] < 64)
    ids = draw(st.lists(st.integers(0, VOCAB - 1), min_size=total, max_size=total))
    spec = {"name": "prompt_ids", "dtype": "int64", "shape": [total]}
    frame = struct.pack(f"<{total}q", *ids)
    if not clean:
        damage = draw(st.sampled_from(["none", "none", "dtype", "length", "values", "shape"]))
        if damage == "dtype":
            spec["dtype"] = draw(st.sampled_from(sorted(DTYPES)))
            frame = draw(st.binary(min_size=total * DTYPES[spec["dtype"]].itemsize,
                                   max_size=total * DTYPES[spec["dtype"]].itemsize))
        elif damage == "length":
            spec["shape"] = [total + 1]
            frame += struct.pack("<q", 1)
        elif damage == "values" and total:
            frame = struct.pack(f"<{total}q", *draw(st.lists(st.integers(-(2**63), 2**63 - 1), min_size=total,
                                                             max_size=total)))
        elif damage == "shape":
            spec["shape"] = [1, total]
    return specs, frame, spec


@st.composite
def message(draw, narrowed: dict) -> list[bytes]:
    op = draw(st.sampled_from(OPS))
    clean = draw(st.booleans())
    meta = draw(meta_of(REQUESTS[op], clean, narrowed))
    specs, frames = [], []
    if op == "step" and (clean or draw(st.booleans())):
        prefill, frame, spec = draw(_prefills(clean, narrowed))
        meta["prefill"] = prefill
        specs, frames = [spec], [frame]
    header = {"v": PROTOCOL_VERSION, "op": op, "id": draw(st.integers(0, 2**63 - 1)), "meta": meta,
              "tensors": specs}
    if not clean:
        damage = draw(st.sampled_from(["none"] * 6 + ["field", "drop", "extra", "frames", "meta"]))
        if damage == "field":
            header[draw(st.sampled_from(sorted(header)))] = draw(JUNK)
        elif damage == "drop":
            del header[draw(st.sampled_from(sorted(header)))]
        elif damage == "extra":
            header["extra"] = draw(JUNK)
        elif damage == "frames":
            frames = frames[:-1] if frames and draw(st.booleans()) else [*frames, draw(st.binary(max_size=16))]
        elif damage == "meta":
            header["meta"] = draw(st.one_of(JUNK, st.just([meta])))
    return [msgpack.packb(header, use_bin_type=True), *frames]


class Fuzzer:
    """The fuzzing client: sends a message, checks its reply, keeps the worker loaded between batches."""

    def __init__(self, address: str, model: str):
        self.client = SyncClient(address)
        self.model = model
        self.sent = 0
        self.steps_run = 0  # fuzzed steps the worker carried out (a load resets its own counter)
        self.next_id = 1

    def exchange(self, frames: list[bytes]) -> typing.Any:
        reply = self._reply(frames)
        parse(REPLIES[reply.op], reply.meta)
        assert reply.id == peek_id(frames), (reply, frames[0])
        self.sent += 1
        self.steps_run += reply.op == "step"
        return reply

    def call(self, op: str, meta: dict) -> typing.Any:
        self.next_id += 1
        header = {"v": PROTOCOL_VERSION, "op": op, "id": self.next_id, "meta": meta, "tensors": []}
        reply = self._reply([msgpack.packb(header)])
        assert reply.id == self.next_id, reply
        return reply

    def _reply(self, frames: list[bytes]) -> typing.Any:
        """The reply to `frames`, past the LoadProgress messages a fuzzed load that asked for them
        sends before its reply (id 0: not replies, as an orchestrator reads them)."""
        reply = decode(self.client.exchange(frames, timeout_ms=60_000))
        while reply.op == LoadProgress.OP:
            reply = decode(self.client.receive(timeout_ms=60_000))
        return reply

    def stats(self) -> dict:
        reply = self.call("stats", {})
        assert reply.op == "stats", reply
        return reply.meta

    def ensure_loaded(self) -> None:
        if self.call("hello", {}).meta["state"] == "idle":
            assert self.call("init", {"rank": 0, "world_size": 1}).op == "init"
        if self.stats()["slots_total"] == 0:
            reply = self.call("load", {"model": self.model, "max_seqs": 4, "max_seq_len": 128})
            assert reply.op == "load", reply


@pytest.mark.slow  # 3,000 messages: over a minute on 2 cores
def test_fuzzed_messages_of_every_op_never_kill_the_worker_nor_leak_a_slot(tiny_model, spawn_worker):
    worker = spawn_worker()
    fuzzer = Fuzzer(worker.address, str(tiny_model))
    fuzzer.ensure_loaded()
    narrowed = overrides(str(tiny_model))

    @settings(max_examples=EXAMPLES, deadline=None, database=None, print_blob=True, derandomize=True,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.large_base_example])
    @given(st.lists(message(narrowed), min_size=BATCH, max_size=BATCH))
    def batch(messages: list[list[bytes]]) -> None:
        for frames in messages:
            fuzzer.exchange(frames)
            assert worker.proc.poll() is None, worker.log_text()[-3000:]
        fuzzer.ensure_loaded()
        stats = fuzzer.stats()
        assert stats["slots_free"] + len(stats["live_sequences"]) == stats["slots_total"], stats

    try:
        batch()
        stats = fuzzer.stats()
        released = fuzzer.call("release", {"seqs": stats["live_sequences"]})
        assert released.op == "release" and sorted(released.meta["released"]) == stats["live_sequences"]
        after = fuzzer.stats()
        assert after["slots_free"] == after["slots_total"] > 0 and after["live_sequences"] == []
        assert fuzzer.sent >= 10 * EXAMPLES
        assert worker.proc.poll() is None
        assert fuzzer.steps_run > 0, "no fuzzed step ever ran the model: the fuzzer is too shallow"
    finally:
        fuzzer.client.close()
