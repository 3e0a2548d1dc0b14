"""A live worker daemon against malformed input, competing orchestrators and signals."""

from __future__ import annotations

import random
import signal
import sys
import time
from pathlib import Path

import msgpack
import pytest
from conftest import wait_for_socket

from shardspec.cli import main
from shardspec.protocol import PROTOCOL_VERSION, ErrorCode, Message, decode, encode

VALID_META = {
    "hello": {"client": "fuzz"},
    "init": {"rank": 0, "world_size": 1, "dist_addr": "tcp://127.0.0.1:1", "timeout_s": 5.0},
    "load": {"model": "/nonexistent", "dtype": "auto", "max_seqs": 2, "max_seq_len": 64, "prefill_chunk": 8},
    "step": {"prefill": [{"seq": 1, "length": 1, "sampling": {"temperature": 0.0}}], "decode": [2]},
    "release": {"seqs": [1]},
    "stats": {},
    "shutdown": {},
}
WRONG_TYPED = {  # for a field of this type: values that are never acceptable
    int: ["7", 1.5, True, None, [1], {"a": 1}, b"x"],
    float: ["0.5", True, None, [0.5], {}, b"x"],
    bool: [1, 0, "true", None, [], 1.0],
    str: [1, None, [], {}, b"bytes", 2.5],
    list: [1, "x", {}, None, True],
    dict: [1, "x", [], None],
}
DTYPE_SIZES = {"bool": 1, "uint8": 1, "int32": 4, "int64": 8, "float16": 2, "bfloat16": 2, "float32": 4}


def _header(rng: random.Random, **fields) -> dict:
    op = rng.choice(list(VALID_META))
    header = {"v": PROTOCOL_VERSION, "op": op, "id": rng.randrange(1, 2**40), "meta": VALID_META[op], "tensors": []}
    header.update(fields)
    return header


def _corrupt_meta(rng: random.Random, meta: dict) -> object:
    """A meta map that no op accepts: wrong-typed, unknown or out-of-range fields, or not a map."""
    kind = rng.randrange(4)
    if kind == 0 or not meta:
        return {**meta, f"unknown_{rng.randrange(99)}": rng.choice([1, "x", None, [1]])}
    key = rng.choice(list(meta))
    value = meta[key]
    if kind == 1:
        kind_of = type(value) if type(value) in WRONG_TYPED else dict
        return {**meta, key: rng.choice(WRONG_TYPED[kind_of])}
    if kind == 2 and isinstance(value, list) and value:
        item = value[0]
        bad = _corrupt_meta(rng, item) if isinstance(item, dict) else rng.choice(WRONG_TYPED[type(item)])
        return {**meta, key: [bad, *value[1:]]}
    return rng.choice([[meta], "meta", 17, None])


def malformed_message(rng: random.Random) -> list[bytes]:
    """One message that a worker must reject, drawn from many kinds of damage."""
    kind = rng.randrange(12)
    spec = {"name": "prompt_ids", "dtype": rng.choice(list(DTYPE_SIZES)), "shape": [rng.randrange(1, 9)]}
    size = spec["shape"][0] * DTYPE_SIZES[spec["dtype"]]
    if kind == 0:  # not msgpack at all, or a truncated header
        raw = msgpack.packb(_header(rng))
        return [rng.choice([rng.randbytes(rng.randrange(0, 40)), raw[: rng.randrange(0, len(raw) - 1)]])]
    if kind == 1:  # header of the wrong type
        return [msgpack.packb(rng.choice([[1, 2], "header", 3, None, 2.5, True]))]
    if kind == 2:  # a missing or an extra header key
        header = _header(rng)
        if rng.random() < 0.5:
            del header[rng.choice(list(header))]
        else:
            header["extra"] = 1
        return [msgpack.packb(header)]
    if kind == 3:  # another protocol version
        return [msgpack.packb(_header(rng, v=rng.choice([0, PROTOCOL_VERSION + 1, "1", None, 1.0])))]
    if kind == 4:  # unknown op, or a reply op sent as a request
        return [msgpack.packb(_header(rng, op=rng.choice(["error", "frobnicate", "", 5, None])))]
    if kind == 5:  # bad id
        return [msgpack.packb(_header(rng, id=rng.choice([-1, 2**64 - 1, "1", 1.5, None, True])))]
    if kind == 6:  # fewer or more frames than tensors
        header = msgpack.packb(_header(rng, op="step", tensors=[spec]))
        return [header] if rng.random() < 0.5 else [header, b"\0" * size, b"\0" * size]
    if kind == 7:  # unknown dtype
        bad = {**spec, "dtype": rng.choice(["complex64", "float64", "int8", "", 3, None])}
        return [msgpack.packb(_header(rng, op="step", tensors=[bad])), b"\0" * size]
    if kind == 8:  # frame size does not match the shape
        off = rng.choice([-1, 1, size, -size + 1]) if size > 1 else 1
        return [msgpack.packb(_header(rng, op="step", tensors=[spec])), b"\0" * (size + off)]
    if kind == 9:  # huge, negative, fractional or too many dims
        shape = rng.choice([[2**40, 2**40], [-1], [1.5], [1] * 9, "3", [None], [2**63]])
        return [msgpack.packb(_header(rng, op="step", tensors=[{**spec, "shape": shape}])), b""]
    if kind == 10:  # tensor spec of the wrong form
        bad = rng.choice([[1], {"name": "x"}, {**spec, "extra": 1}, "spec", {**spec, "name": ""}])
        return [msgpack.packb(_header(rng, tensors=bad if isinstance(bad, list) else [bad])), b"\0" * size]
    op = rng.choice(list(VALID_META))  # valid framing, invalid meta for the op
    return [msgpack.packb(_header(rng, op=op, meta=_corrupt_meta(rng, VALID_META[op])))]


def test_worker_answers_every_malformed_message_with_an_error_and_keeps_serving(spawn_worker, sync_client):
    worker = spawn_worker()
    client = sync_client(worker.address)
    rng = random.Random(1234)
    codes = {}
    n = 2500
    for _ in range(n):
        reply = decode(client.exchange(malformed_message(rng)))
        assert reply.op == "error", reply
        codes[reply.meta["code"]] = codes.get(reply.meta["code"], 0) + 1
    assert sum(codes.values()) == n
    assert set(codes) <= {c.value for c in ErrorCode} and {"bad_message", "bad_request", "bad_version"} <= set(codes)

    hello = decode(client.exchange(encode(Message("hello", 99, {"client": "after-fuzz"}))))
    assert (hello.op, hello.id, hello.meta["state"]) == ("hello", 99, "idle")
    stats = decode(client.exchange(encode(Message("stats", 100, {}))))
    assert stats.op == "stats" and stats.meta["errors"] == n
    assert worker.proc.poll() is None


def test_error_reply_carries_the_request_id(spawn_worker, sync_client):
    client = sync_client(spawn_worker().address)
    reply = decode(client.exchange(encode(Message("release", 77, {"seqs": "x"}))))
    assert (reply.op, reply.id, reply.meta["code"]) == ("error", 77, "bad_request")
    assert "seqs" in reply.meta["message"]


def test_hello_from_another_protocol_version_is_refused_naming_both(spawn_worker, sync_client):
    client = sync_client(spawn_worker().address)
    header = {"v": PROTOCOL_VERSION + 1, "op": "hello", "id": 5, "meta": {}, "tensors": []}
    reply = decode(client.exchange([msgpack.packb(header)]))
    assert reply.op == "error" and reply.id == 5 and reply.meta["code"] == "bad_version"
    assert f"version {PROTOCOL_VERSION + 1}" in reply.meta["message"]
    assert f"speaks {PROTOCOL_VERSION}" in reply.meta["message"]


def test_ops_before_hello_are_refused(spawn_worker, sync_client):
    client = sync_client(spawn_worker().address)
    reply = decode(client.exchange(encode(Message("stats", 1, {}))))
    assert reply.meta["code"] == "bad_state" and "hello" in reply.meta["message"]


def test_second_orchestrator_is_refused_until_the_first_disconnects(spawn_worker, sync_client):
    worker = spawn_worker()
    first, second = sync_client(worker.address), sync_client(worker.address)
    assert decode(first.exchange(encode(Message("hello", 1, {})))).op == "hello"
    refused = decode(second.exchange(encode(Message("hello", 1, {}))))
    assert refused.op == "error" and refused.meta["code"] == "busy"
    first.close()
    deadline = time.monotonic() + 10
    while True:  # the disconnect reaches the worker asynchronously
        reply = decode(second.exchange(encode(Message("hello", 2, {}))))
        if reply.op == "hello" or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    assert reply.op == "hello" and reply.meta["state"] == "idle"
    assert "orchestrator disconnected" in worker.log_text()


def test_goodbye_returns_the_worker_to_idle_for_the_next_orchestrator(spawn_worker, sync_client):
    worker = spawn_worker()
    first, second = sync_client(worker.address), sync_client(worker.address)
    first.exchange(encode(Message("hello", 1, {})))
    first.exchange(encode(Message("init", 2, VALID_META["init"])))
    assert decode(first.exchange(encode(Message("shutdown", 3, {})))).op == "shutdown"
    assert decode(second.exchange(encode(Message("hello", 1, {})))).meta["state"] == "idle"


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_worker_exits_cleanly_on_signal_and_removes_its_socket(spawn_worker, sig):
    worker = spawn_worker()
    wait_for_socket(worker.address)
    worker.proc.send_signal(sig)
    assert worker.proc.wait(20) == 0
    assert not Path(worker.address.removeprefix("ipc://")).exists()
    assert "stopped" in worker.log_text()


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--listen", "http://x:1"], "tcp://HOST:PORT or ipc://PATH"),
        (["--listen", "tcp://127.0.0.1:99999"], "port out of range"),
        (["--listen", "ipc:///tmp/x.sock", "--device", "tpu"], "device must be"),
        (["--listen", "ipc:///tmp/x.sock", "--device", "cuda:7"], "cuda"),
        (["--listen", "ipc:///tmp/x.sock", "--threads", "0"], "--threads"),
        (["--listen", "ipc:///tmp/x.sock", "--threads", "100000"], "--threads must be in [1,"),  # (torch aborted)
        (["--listen", "ipc:///tmp/x.sock", "--threads", "100000", "--lease", "0.001"], "--lease"),
        (["--listen", "ipc:///tmp/x.sock", "--cache-dir", sys.executable], "--cache-dir must be a folder"),
        (["--listen", "ipc:///tmp/x.sock", "--cache-dir", "/proc/none"], "--cache-dir /proc/none: cannot make"),
    ],
)
def test_worker_cli_rejects_bad_arguments_with_a_message(args, message, capsys):
    # in this process (what `python -m shardspec` runs is main): an exception main lets out fails the test
    assert main(["worker", *args]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


def test_unhashable_header_fields_are_bad_messages_not_internal_errors(spawn_worker, sync_client):
    client = sync_client(spawn_worker().address)
    spec = {"name": "prompt_ids", "dtype": ["int64"], "shape": [1]}
    for header in ({"v": PROTOCOL_VERSION, "op": [], "id": 3, "meta": {}, "tensors": []},
                   {"v": PROTOCOL_VERSION, "op": {"a": 1}, "id": 3, "meta": {}, "tensors": []},
                   {"v": PROTOCOL_VERSION, "op": "step", "id": 3, "meta": {}, "tensors": [spec]}):
        frames = [msgpack.packb(header)] + [b"\0" * 8] * len(header["tensors"])
        reply = decode(client.exchange(frames))
        assert (reply.op, reply.id, reply.meta["code"]) == ("error", 3, "bad_message")


BAD_OPTIONS = [
    ({"allreduce": "symmetric"}, "meta.options.allreduce: 'symmetric' is not one of auto, shm, symm, gloo, nccl"),
    ({"moe_backend": "loop"}, "meta.options.moe_backend: 'loop' is not one of auto, reference, grouped, gathered"),
    ({"launch_ahead": "1"}, "meta.options.launch_ahead: '1' is not one of auto, on, off"),
    ({"kernels": 0}, "meta.options.kernels: expected a bool"),
    ({"gemv": True}, "meta.options: unknown fields ['gemv']"),
]


def test_an_init_with_a_bad_option_is_refused_naming_the_field_and_the_choices(spawn_worker, sync_client):
    client = sync_client(spawn_worker().address)
    assert decode(client.exchange(encode(Message("hello", 1, {})))).op == "hello"
    for options, message in BAD_OPTIONS:
        reply = decode(client.exchange(encode(Message("init", 2, VALID_META["init"] | {"options": options}))))
        assert reply.op == "error" and reply.meta["code"] == ErrorCode.BAD_REQUEST.value, options
        assert message in reply.meta["message"], reply.meta["message"]
    assert decode(client.exchange(encode(Message("stats", 3, {})))).op == "stats"  # and it keeps serving
