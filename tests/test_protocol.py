"""The wire codec and the typed op definitions, without any process."""

from __future__ import annotations

import gc
import re
from pathlib import Path

import msgpack
import pytest
import torch
import zmq

from shardspec.protocol import (
    DTYPES,
    PROTOCOL_VERSION,
    ErrorCode,
    Message,
    ProtocolError,
    decode,
    encode,
    transport,
)
from shardspec.protocol import messages as m

SHAPES = [(), (0,), (3, 0, 2), (1,), (7,), (2, 3), (2, 3, 4, 5)]


def _random(dtype: torch.dtype, shape: tuple) -> torch.Tensor:
    if dtype == torch.bool:
        return torch.rand(shape) > 0.5
    if dtype.is_floating_point:
        return torch.randn(shape).to(dtype)
    info = torch.iinfo(dtype)
    return torch.randint(info.min, info.max, shape, dtype=dtype)


@pytest.mark.parametrize("dtype", list(DTYPES.values()), ids=list(DTYPES))
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_codec_round_trips_every_dtype_and_shape_bit_exactly(dtype, shape):
    tensor = _random(dtype, shape)
    frames = encode(Message("step", 7, {"k": [1, 2]}, {"t": tensor}))
    decoded = decode([bytes(f) for f in frames])
    out = decoded.tensors["t"]
    assert (decoded.op, decoded.id, decoded.meta) == ("step", 7, {"k": [1, 2]})
    assert out.dtype == dtype and tuple(out.shape) == shape
    assert torch.equal(out.reshape(-1).view(torch.uint8), tensor.reshape(-1).view(torch.uint8))


def test_codec_sends_non_contiguous_tensors_as_their_values():
    tensor = torch.arange(24, dtype=torch.float32).reshape(4, 6).t()
    out = decode([bytes(f) for f in encode(Message("step", 1, {}, {"t": tensor}))]).tensors["t"]
    assert torch.equal(out, tensor)


def test_decode_is_zero_copy_over_the_frame():
    tensor = torch.arange(1000, dtype=torch.float32)
    frame = bytearray(bytes(encode(Message("step", 1, {}, {"t": tensor}))[1]))
    header = encode(Message("step", 1, {}, {"t": tensor}))[0]
    out = decode([header, frame]).tensors["t"]
    frame[0:4] = torch.tensor([42.0]).numpy().tobytes()
    assert out[0].item() == 42.0  # the tensor views the frame's memory


def test_zero_copy_send_keeps_the_buffer_alive_until_zeromq_is_done():
    ctx = zmq.Context()
    a, b = ctx.socket(zmq.PAIR), ctx.socket(zmq.PAIR)
    a.bind("inproc://keepalive")
    b.connect("inproc://keepalive")
    payload = torch.randn(1 << 18)  # 1 MiB: sent without copying
    expected = payload.clone()
    tracker = transport.send(a, Message("step", 3, {}, {"t": payload}))
    del payload
    gc.collect()
    received = decode(b.recv_multipart(copy=False)).tensors["t"]
    assert torch.equal(received, expected)
    assert not tracker.done  # inproc hands our buffer itself to the receiver, which still views it
    del received
    gc.collect()
    tracker.wait(5)
    assert tracker.done
    a.close()
    b.close()
    ctx.term()


def _header(**overrides) -> bytes:
    header = {"v": PROTOCOL_VERSION, "op": "stats", "id": 1, "meta": {}, "tensors": []}
    header.update(overrides)
    return msgpack.packb(header)


SPEC = {"name": "t", "dtype": "float32", "shape": [2]}
MALFORMED = {
    "not msgpack": [b"\xc1\xff\x00"],
    "truncated header": [_header()[:-3]],
    "header is a list": [msgpack.packb([1, 2])],
    "missing key": [msgpack.packb({"v": PROTOCOL_VERSION, "op": "stats", "id": 1, "meta": {}})],
    "extra key": [_header(extra=1)],
    "unknown op": [_header(op="frobnicate")],
    "bool id": [_header(id=True)],
    "negative id": [_header(id=-1)],
    "meta not a map": [_header(meta=[1])],
    "missing frame": [_header(tensors=[SPEC])],
    "extra frame": [_header(), b"1234"],
    "unknown dtype": [_header(tensors=[{**SPEC, "dtype": "complex64"}]), b"\0" * 16],
    "size mismatch": [_header(tensors=[SPEC]), b"\0" * 7],
    "huge shape": [_header(tensors=[{**SPEC, "shape": [2**31, 2**31]}]), b""],
    "negative dim": [_header(tensors=[{**SPEC, "shape": [-2]}]), b""],
    "float dim": [_header(tensors=[{**SPEC, "shape": [2.0]}]), b"\0" * 8],
    "too many dims": [_header(tensors=[{**SPEC, "shape": [1] * 9}]), b"\0" * 4],
    "repeated name": [_header(tensors=[SPEC, SPEC]), b"\0" * 8, b"\0" * 8],
}


@pytest.mark.parametrize("frames", MALFORMED.values(), ids=MALFORMED.keys())
def test_decode_rejects_malformed_messages_with_bad_message(frames):
    with pytest.raises(ProtocolError) as info:
        decode(frames)
    assert info.value.code == ErrorCode.BAD_MESSAGE


def test_version_mismatch_names_both_versions():
    with pytest.raises(ProtocolError) as info:
        decode([_header(v=PROTOCOL_VERSION + 98)])
    assert info.value.code == ErrorCode.BAD_VERSION
    assert str(PROTOCOL_VERSION + 98) in info.value.message and str(PROTOCOL_VERSION) in info.value.message


def test_every_op_round_trips_through_its_typed_definition():
    samples = [
        m.HelloRequest(client="x"),
        m.InitRequest(rank=1, world_size=2, dist_addr="tcp://h:1", timeout_s=3.0),
        m.LoadRequest(model="/m", dtype="bfloat16", max_seqs=2, max_seq_len=16, prefill_chunk=4),
        m.StepRequest(prefill=[m.PrefillSpec(3, 5, m.SamplingParams(0.7, 5, 0.9, 11))], decode=[1, 2]),
        m.ReleaseRequest(seqs=[1]),
        m.StatsRequest(),
        m.ShutdownRequest(),
        m.StepReply(seqs=[1], tokens=[[4, 5]], accepted=[1], drafts=[[6]], finished=[''], step_s=0.5),
        m.ErrorReply(code="busy", message="no"),
    ]
    for sample in samples:
        meta = msgpack.unpackb(msgpack.packb(m.to_meta(sample)))
        assert m.parse(type(sample), meta) == sample


@pytest.mark.parametrize(
    ("meta", "field"),
    [
        ({"seqs": [1, "2"]}, "seqs[1]"),
        ({"seqs": 1}, "seqs"),
        ({"seqs": [True]}, "seqs[0]"),
        ({"seqs": [], "extra": 1}, "extra"),
    ],
)
def test_parse_names_the_bad_field(meta, field):
    with pytest.raises(ProtocolError) as info:
        m.parse(m.ReleaseRequest, meta)
    assert info.value.code == ErrorCode.BAD_REQUEST and field in info.value.message


@pytest.mark.parametrize(
    "sampling",
    [{"temperature": -1.0}, {"top_p": 0.0}, {"top_p": 1.5}, {"top_k": -1}, {"temperature": float("nan")}],
)
def test_parse_rejects_out_of_range_sampling(sampling):
    meta = {"prefill": [{"seq": 1, "length": 1, "sampling": sampling}]}
    with pytest.raises(ProtocolError):
        m.parse(m.StepRequest, meta)


def test_parse_requires_required_fields():
    with pytest.raises(ProtocolError, match="missing required field 'model'"):
        m.parse(m.LoadRequest, {})


def test_no_module_of_the_package_uses_pickle():
    source = Path(m.__file__).parents[1]
    pattern = re.compile(r"^\s*(import|from)\s+(pickle|cloudpickle|dill)\b|torch\.load\(|pickle\.loads", re.M)
    offenders = [p.name for p in source.rglob("*.py") if pattern.search(p.read_text())]
    assert offenders == []
