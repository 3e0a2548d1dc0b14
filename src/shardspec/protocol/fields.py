"""Message fields: the metadata that bounds a field's value, and `parse`, which checks a received
map against a message dataclass — no unknown keys, every required key present, exact types (a bool
is not an int), numeric ranges and choices from the field's metadata — and raises
ProtocolError(BAD_REQUEST) naming the bad field. `to_meta(obj)` is the inverse."""

from __future__ import annotations

import dataclasses
import math
import types
import typing
from dataclasses import field
from functools import cache
from typing import Any, TypeVar

from shardspec.protocol.errors import ErrorCode, ProtocolError

MAX_STR = 4096
MAX_LIST = 1 << 20
INT64 = (-(2**63), 2**63 - 1)


def bounded(lo: float, hi: float, default: Any = dataclasses.MISSING) -> Any:
    """A field whose value must lie in [lo, hi]."""
    return field(default=default, metadata={"range": (lo, hi)})


def text(max_chars: int, default: str = "") -> Any:
    """A string field of up to max_chars characters (other strings: MAX_STR)."""
    return field(default=default, metadata={"max_chars": max_chars})


def one_of(choices: tuple[str, ...], default: str, help: str) -> Any:
    """An option whose value must be one of `choices`; `help` says what each does (the CLI flag's)."""
    return field(default=default, metadata={"choices": choices, "help": help})


def switch(default: bool, help: str) -> Any:
    """An on/off option; `help` says what it turns on (the CLI flag's)."""
    return field(default=default, metadata={"help": help})


T = TypeVar("T")


def parse(cls: type[T], meta: Any, where: str = "meta") -> T:
    """Build `cls` from a received map, validating every field; raises ProtocolError."""
    if not isinstance(meta, dict):
        _bad(where, f"must be a map, got {type(meta).__name__}")
    hints = _hints(cls)
    unknown = set(meta) - set(hints)
    if unknown:
        _bad(where, f"unknown fields {sorted(map(str, unknown))}; expected {sorted(hints)}")
    values = {}
    for f in dataclasses.fields(cls):
        if f.name not in meta:
            if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
                _bad(where, f"missing required field {f.name!r}")
            continue
        if "max_chars" in f.metadata:
            value = meta[f.name]
            if type(value) is not str or len(value) > f.metadata["max_chars"]:
                _bad(f"{where}.{f.name}", f"expected a string of at most {f.metadata['max_chars']} chars")
        else:
            value = _check(hints[f.name], meta[f.name], f"{where}.{f.name}")
        if "range" in f.metadata:
            lo, hi = f.metadata["range"]
            if not lo <= value <= hi:
                _bad(f"{where}.{f.name}", f"{value!r} is outside [{lo}, {hi}]")
        if "choices" in f.metadata and value not in f.metadata["choices"]:
            _bad(f"{where}.{f.name}", f"{value!r:.100} is not one of {', '.join(f.metadata['choices'])}")
        values[f.name] = value
    try:
        return cls(**values)
    except ValueError as exc:
        raise ProtocolError(ErrorCode.BAD_REQUEST, f"{where}: {exc}") from None


def to_meta(obj: Any) -> dict[str, Any]:
    """The msgpack-ready map of a message dataclass."""
    return dataclasses.asdict(obj)


@cache
def _hints(cls: type) -> dict[str, Any]:
    return {f.name: typing.get_type_hints(cls)[f.name] for f in dataclasses.fields(cls)}


def _check(tp: Any, value: Any, where: str) -> Any:
    origin = typing.get_origin(tp)
    if tp is bool:
        if type(value) is not bool:
            _bad(where, f"expected a bool, got {type(value).__name__}")
        return value
    if tp is int:
        if type(value) is not int or not INT64[0] <= value <= INT64[1]:
            _bad(where, f"expected a 64-bit int, got {type(value).__name__}")
        return value
    if tp is float:
        if type(value) not in (int, float) or not math.isfinite(value):
            _bad(where, f"expected a finite number, got {value!r}"[:200])
        return float(value)
    if tp is str:
        if type(value) is not str or len(value) > MAX_STR:
            _bad(where, f"expected a string of at most {MAX_STR} chars")
        return value
    if origin is list:
        (item,) = typing.get_args(tp)
        if type(value) is not list or len(value) > MAX_LIST:
            _bad(where, f"expected a list of at most {MAX_LIST} items")
        return [_check(item, v, f"{where}[{i}]") for i, v in enumerate(value)]
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(tp)
        if value is None and type(None) in args:
            return None
        (inner,) = [a for a in args if a is not type(None)]
        return _check(inner, value, where)
    if dataclasses.is_dataclass(tp):
        return parse(tp, value, where)
    raise TypeError(f"unsupported schema type {tp!r} at {where}")  # a bug in this module


def _bad(where: str, what: str) -> typing.NoReturn:
    raise ProtocolError(ErrorCode.BAD_REQUEST, f"{where}: {what}")
