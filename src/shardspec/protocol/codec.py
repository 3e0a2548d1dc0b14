"""The wire format: a ZeroMQ multipart `[header, buf0, buf1, ...]`.

`header` is msgpack: {"v", "op", "id", "meta", "tensors": [{"name", "dtype", "shape"}]}; frame i+1
holds the raw little-endian, C-contiguous bytes of tensor i. Nothing is ever pickled. Every field
is validated before a tensor is built, and decoding builds tensors with `torch.frombuffer`
(no copy) over the received frames.
"""

from __future__ import annotations

import math
import sys
import warnings
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import msgpack
import torch

from shardspec.protocol.errors import ErrorCode, ProtocolError
from shardspec.protocol.messages import OPS

PROTOCOL_VERSION = 5  # 5: the shards and chunk ops, LoadRequest.model_key, tree guesses

DTYPES: dict[str, torch.dtype] = {
    "bool": torch.bool,
    "uint8": torch.uint8,
    "int32": torch.int32,
    "int64": torch.int64,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float32": torch.float32,
}
DTYPE_NAMES = {dtype: name for name, dtype in DTYPES.items()}

MAX_HEADER_BYTES = 1 << 20
MAX_TENSORS = 64
MAX_NDIM = 8
MAX_TENSOR_BYTES = 1 << 32
MAX_NAME_LEN = 128
_HEADER_KEYS = frozenset({"v", "op", "id", "meta", "tensors"})
_TENSOR_KEYS = frozenset({"name", "dtype", "shape"})

if sys.byteorder != "little":  # frames are little-endian and we reinterpret them in place
    raise ImportError("shardspec's wire format needs a little-endian host")


@dataclass
class Message:
    """One decoded (or to-be-encoded) message. Tensors decoded from the wire are read-only views."""

    op: str
    id: int
    meta: dict[str, Any] = field(default_factory=dict)
    tensors: dict[str, torch.Tensor] = field(default_factory=dict)


def encode(msg: Message) -> list[Any]:
    """Frames for `msg`: the packed header, then one buffer per tensor (no copy for CPU tensors).

    A CUDA tensor is copied once into pinned host memory. The caller must not modify a CPU tensor
    until ZeroMQ has sent it (see `transport.send`, which tracks zero-copy sends).
    """
    specs, buffers = [], []
    for name, tensor in msg.tensors.items():
        if tensor.dtype not in DTYPE_NAMES:
            raise ProtocolError(ErrorCode.BAD_MESSAGE, f"tensor {name!r}: dtype {tensor.dtype} is not sendable")
        specs.append({"name": name, "dtype": DTYPE_NAMES[tensor.dtype], "shape": list(tensor.shape)})
        buffers.append(_tensor_bytes(tensor))
    header = {"v": PROTOCOL_VERSION, "op": msg.op, "id": msg.id, "meta": msg.meta, "tensors": specs}
    return [msgpack.packb(header, use_bin_type=True), *buffers]


def _tensor_bytes(tensor: torch.Tensor) -> memoryview | bytes:
    tensor = tensor.detach()
    if tensor.device.type != "cpu":
        host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
        host.copy_(tensor)
        tensor = host
    if tensor.numel() == 0:
        return b""
    flat = tensor.contiguous().reshape(-1).view(torch.uint8)
    return memoryview(flat.numpy())  # keeps the storage alive as long as the frame needs it


def decode(frames: Sequence[Any]) -> Message:
    """Validate and decode a multipart message; raises ProtocolError on anything malformed."""
    if not frames:
        raise ProtocolError(ErrorCode.BAD_MESSAGE, "empty message")
    header = _unpack_header(frames[0])
    specs = header["tensors"]
    if len(frames) - 1 != len(specs):
        raise ProtocolError(
            ErrorCode.BAD_MESSAGE,
            f"header lists {len(specs)} tensors but {len(frames) - 1} data frames followed",
        )
    tensors = {}
    for spec, frame in zip(specs, frames[1:]):
        tensors[spec["name"]] = _frame_tensor(spec, memoryview(frame))
    return Message(op=header["op"], id=header["id"], meta=header["meta"], tensors=tensors)


def header_op(frames: Sequence[Any]) -> str:
    """The op of a message, from its validated header alone (the frames are not decoded): what a relay
    needs to forward a message unchanged. Raises ProtocolError like `decode`."""
    if not frames:
        raise ProtocolError(ErrorCode.BAD_MESSAGE, "empty message")
    header = _unpack_header(frames[0])
    if len(frames) - 1 != len(header["tensors"]):
        raise ProtocolError(ErrorCode.BAD_MESSAGE, f"header lists {len(header['tensors'])} tensors but "
                            f"{len(frames) - 1} data frames followed")
    return header["op"]


def peek_id(frames: Sequence[Any]) -> int:
    """The request id of a (possibly malformed) message, 0 when it cannot be read."""
    try:
        header = msgpack.unpackb(memoryview(frames[0])[:MAX_HEADER_BYTES], raw=False)
        rid = header.get("id", 0) if isinstance(header, dict) else 0
        return rid if type(rid) is int and 0 <= rid < 2**63 else 0
    except Exception:
        return 0


def _unpack_header(frame: Any) -> dict[str, Any]:
    view = memoryview(frame)
    if view.nbytes > MAX_HEADER_BYTES:
        raise ProtocolError(ErrorCode.BAD_MESSAGE, f"header of {view.nbytes} bytes exceeds {MAX_HEADER_BYTES}")
    try:
        header = msgpack.unpackb(view, raw=False, strict_map_key=True)
    except Exception as exc:
        raise ProtocolError(ErrorCode.BAD_MESSAGE, f"header is not valid msgpack: {exc}") from None
    if not isinstance(header, dict):
        raise ProtocolError(ErrorCode.BAD_MESSAGE, f"header must be a map, got {type(header).__name__}")
    if set(header) != _HEADER_KEYS:
        raise ProtocolError(ErrorCode.BAD_MESSAGE, f"header keys must be {sorted(_HEADER_KEYS)}, got {sorted(header)}")
    if type(header["v"]) is not int or header["v"] != PROTOCOL_VERSION:
        raise ProtocolError(
            ErrorCode.BAD_VERSION,
            f"peer speaks protocol version {header['v']!r}, this side speaks {PROTOCOL_VERSION}",
        )
    if type(header["op"]) is not str or header["op"] not in OPS:
        raise ProtocolError(ErrorCode.BAD_MESSAGE, f"unknown op {header['op']!r}; known: {sorted(OPS)}")
    if type(header["id"]) is not int or not 0 <= header["id"] < 2**63:
        raise ProtocolError(ErrorCode.BAD_MESSAGE, f"id must be an int in [0, 2**63), got {header['id']!r}")
    if not isinstance(header["meta"], dict):
        raise ProtocolError(ErrorCode.BAD_MESSAGE, "meta must be a map")
    _check_tensor_specs(header["tensors"])
    return header


def _check_tensor_specs(specs: Any) -> None:
    if not isinstance(specs, list) or len(specs) > MAX_TENSORS:
        raise ProtocolError(ErrorCode.BAD_MESSAGE, f"tensors must be a list of at most {MAX_TENSORS} specs")
    names = set()
    for spec in specs:
        if not isinstance(spec, dict) or set(spec) != _TENSOR_KEYS:
            raise ProtocolError(ErrorCode.BAD_MESSAGE, f"tensor spec must have keys {sorted(_TENSOR_KEYS)}")
        name, dtype, shape = spec["name"], spec["dtype"], spec["shape"]
        if not isinstance(name, str) or not 0 < len(name) <= MAX_NAME_LEN or name in names:
            raise ProtocolError(ErrorCode.BAD_MESSAGE, f"tensor name {name!r} is invalid or repeated")
        names.add(name)
        if type(dtype) is not str or dtype not in DTYPES:
            raise ProtocolError(ErrorCode.BAD_MESSAGE, f"tensor {name!r}: dtype {dtype!r} not in {sorted(DTYPES)}")
        if (
            not isinstance(shape, list)
            or len(shape) > MAX_NDIM
            or not all(type(d) is int and 0 <= d <= MAX_TENSOR_BYTES for d in shape)
        ):
            raise ProtocolError(
                ErrorCode.BAD_MESSAGE, f"tensor {name!r}: shape must be a list of ≤{MAX_NDIM} non-negative ints"
            )
        nbytes = math.prod(shape) * DTYPES[dtype].itemsize
        if nbytes > MAX_TENSOR_BYTES:
            raise ProtocolError(ErrorCode.BAD_MESSAGE, f"tensor {name!r}: {nbytes} bytes exceeds {MAX_TENSOR_BYTES}")


def _frame_tensor(spec: dict[str, Any], view: memoryview) -> torch.Tensor:
    dtype, shape = DTYPES[spec["dtype"]], spec["shape"]
    nbytes = math.prod(shape) * dtype.itemsize
    if view.nbytes != nbytes:
        raise ProtocolError(
            ErrorCode.BAD_MESSAGE,
            f"tensor {spec['name']!r}: shape {shape} of {spec['dtype']} needs {nbytes} bytes, frame has {view.nbytes}",
        )
    if nbytes == 0:
        return torch.empty(shape, dtype=dtype)
    with warnings.catch_warnings():  # frames are read-only; the tensor is a view we never write to
        warnings.simplefilter("ignore", UserWarning)
        raw = torch.frombuffer(view, dtype=torch.uint8)
    if raw.data_ptr() % dtype.itemsize:  # misaligned frame: one copy beats undefined behaviour
        raw = raw.clone()
    return raw.view(dtype).view(shape)
