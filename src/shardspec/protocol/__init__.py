"""The wire protocol: msgpack headers plus raw tensor frames, typed ops, errors. No torch.distributed."""

from shardspec.protocol.codec import DTYPES, OPS, PROTOCOL_VERSION, Message, decode, encode, peek_id
from shardspec.protocol.errors import ErrorCode, ProtocolError, RemoteError
from shardspec.protocol.messages import REPLIES, REQUESTS, SamplingParams, parse, to_meta

__all__ = [
    "DTYPES",
    "OPS",
    "PROTOCOL_VERSION",
    "REPLIES",
    "REQUESTS",
    "ErrorCode",
    "Message",
    "ProtocolError",
    "RemoteError",
    "SamplingParams",
    "decode",
    "encode",
    "parse",
    "peek_id",
    "to_meta",
]
