"""Typed errors that travel on the wire as `error` replies."""

from __future__ import annotations

from enum import StrEnum


class ErrorCode(StrEnum):
    BAD_MESSAGE = "bad_message"  # not decodable: framing, msgpack, header fields
    BAD_VERSION = "bad_version"  # peer speaks another protocol version
    BAD_REQUEST = "bad_request"  # decodable, but the meta fields are invalid for the op
    BAD_STATE = "bad_state"  # valid request the worker cannot serve now (not loaded, ...)
    BUSY = "busy"  # the worker serves another orchestrator
    NOT_FOUND = "not_found"  # unknown sequence id, missing model file, ...
    CAPACITY = "capacity"  # no free slot / sequence too long
    INTERNAL = "internal"  # a bug or device failure on the worker
    UNREACHABLE = "unreachable"  # a stage link to another worker could not be opened (relay instead)


class ProtocolError(Exception):
    """An error with a wire code; a worker turns it into an `error` reply and keeps serving."""

    def __init__(self, code: ErrorCode, message: str):
        super().__init__(f"[{code}] {message}")
        self.code = ErrorCode(code)
        self.message = message


class RemoteError(Exception):
    """An `error` reply received from a worker."""

    def __init__(self, worker: str, code: str, message: str):
        super().__init__(f"worker {worker}: [{code}] {message}")
        self.worker = worker
        self.code = code
        self.message = message
