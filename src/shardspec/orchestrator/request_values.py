"""A request's values, checked before it is queued: against the ranges the wire accepts, the model's
vocabulary and the prefix cache's bounds. Each bad value is a ValueError that names it (a value a
worker rejected would fail the whole step, and with it every running request)."""

from __future__ import annotations

import dataclasses
import numbers
import random
from typing import Any

from shardspec.orchestrator.config import message_range
from shardspec.orchestrator.prefix import MAX_CACHE_SALT
from shardspec.orchestrator.requests import Request
from shardspec.orchestrator.tokenizer import Tokenizer
from shardspec.protocol.messages import LoadReply, PrefillSpec, SamplingParams, TokenBias

MAX_STOP_TOKEN_IDS = 256  # a request's stop_token_ids
MAX_LOGIT_BIAS = 1024  # a request's logit_bias entries
MAX_PREFIX_POINTS = 8  # a request's prefix_points (each may cost a saved recurrent state)


def new_request(seq: int, info: LoadReply, tokenizer: Tokenizer | None, forced_acceptance: float | None,
                prompt: str | list[int], max_tokens: int, sampling: SamplingParams, stop_at_eos: bool, *,
                penalties: tuple[float, float, float], stop_token_ids: list[int] | None,
                logit_bias: dict[int, float] | None, min_tokens: int, logprobs: int | None,
                prompt_logprobs: int | None, cache_salt: Any, prefix_points: list[int] | None) -> Request:
    """Sequence `seq`'s request of Engine.generate's values, each checked against the model
    (`info`: its vocabulary, context and end-of-text ids) and the wire (ValueError naming it)."""
    ids = prompt_ids(prompt, tokenizer, info.vocab_size)
    max_tokens = in_wire_range("max_tokens", max_tokens, int, PrefillSpec, "max_tokens")
    in_wire_range("prompt", len(ids), int, PrefillSpec, "length", "the prompt's length in tokens")
    if len(ids) + max_tokens > info.max_seq_len:
        raise ValueError(f"prompt ({len(ids)} tokens) + max_tokens ({max_tokens}) exceeds the context of "
                         f"{info.max_seq_len} tokens")
    stop_ids = list(info.eos_token_ids) if stop_at_eos else []
    request = Request(seq, ids, max_tokens, sampling, stop_ids, info.draft_tokens, forced_acceptance)
    request.cache_salt = checked_salt(cache_salt)
    request.prefix_points = checked_points(prefix_points or [], len(ids))
    request.stop_ids += checked_stop_ids(stop_token_ids or [], info.vocab_size)
    request.logit_bias = checked_bias(logit_bias or {}, info.vocab_size)
    request.min_tokens = in_wire_range("min_tokens", min_tokens, int, PrefillSpec, "min_tokens")
    if min_tokens > max_tokens:
        raise ValueError(f"min_tokens ({min_tokens}) cannot exceed max_tokens ({max_tokens})")
    request.sampling = with_penalties(sampling, *penalties)
    request.logprobs = checked_logprobs("logprobs", logprobs)
    request.prompt_logprobs = checked_logprobs("prompt_logprobs", prompt_logprobs)
    return request


def prompt_ids(prompt: str | list[int], tokenizer: Tokenizer | None, vocab: int) -> list[int]:
    if isinstance(prompt, str):
        if tokenizer is None:
            raise ValueError("this model folder has no tokenizer.json: pass token ids instead of text")
        ids = tokenizer.encode(prompt)
    elif isinstance(prompt, (list, tuple)):
        ids = list(prompt)
    else:  # (bytes would pass as ids, one per byte)
        raise ValueError(f"the prompt is a string or a list of token ids, not {type(prompt).__name__}")
    if not ids:
        raise ValueError("the prompt is empty")
    if not all(type(t) is int and 0 <= t < vocab for t in ids):
        raise ValueError(f"prompt token ids must be integers in [0, {vocab})")
    return ids


def checked_stop_ids(ids: list[int], vocab: int) -> list[int]:
    if len(ids) > MAX_STOP_TOKEN_IDS or not all(type(t) is int and 0 <= t < vocab for t in ids):
        raise ValueError(f"stop_token_ids must be at most {MAX_STOP_TOKEN_IDS} token ids in [0, {vocab})")
    return list(ids)


def checked_bias(biases: dict[int, float], vocab: int) -> list[TokenBias]:
    if len(biases) > MAX_LOGIT_BIAS:
        raise ValueError(f"logit_bias has {len(biases)} entries; at most {MAX_LOGIT_BIAS}")
    bad = [t for t in biases if type(t) is not int or not 0 <= t < vocab]
    if bad:
        raise ValueError(f"logit_bias token ids must lie in [0, {vocab}): {bad[:8]}")
    for token, bias in biases.items():
        if type(bias) not in (int, float) or not -100.0 <= bias <= 100.0:
            raise ValueError(f"logit_bias values lie in [-100, 100]; token {token} has {bias!r:.40}")
    return [TokenBias(token, float(bias)) for token, bias in biases.items()]


def checked_logprobs(name: str, top: int | None) -> int:
    """The wire's value for a logprobs option: -1 for None, else N inside the wire's range."""
    if top is None:
        return -1
    value = in_wire_range(name, top, int, PrefillSpec, name)
    if value < 0:
        raise ValueError(f"{name} must be at least 0, got {top}")
    return value


def sampling(temperature: float, top_k: int, top_p: float, seed: int | None) -> SamplingParams:
    """SamplingParams every rank accepts; ValueError naming the field otherwise (a value a worker
    rejected would fail the whole step, and with it every running request)."""
    if seed is None:
        seed = random.getrandbits(63)
    given = {"temperature": (temperature, float), "top_k": (top_k, int), "top_p": (top_p, float), "seed": (seed, int)}
    values = {name: in_wire_range(name, value, kind, SamplingParams, name) for name, (value, kind) in given.items()}
    return SamplingParams(**values)  # its own checks (top_p, temperature near 0) name the field too


def with_penalties(sampling: SamplingParams, presence: float, frequency: float, repetition: float) -> SamplingParams:
    """`sampling` with the penalties, each checked against the wire's range (ValueError naming it)."""
    given = {"presence_penalty": presence, "frequency_penalty": frequency, "repetition_penalty": repetition}
    values = {name: in_wire_range(name, value, float, SamplingParams, name) for name, value in given.items()}
    return dataclasses.replace(sampling, **values)


def in_wire_range(name: str, value: Any, kind: type, message: type, field: str, what: str | None = None) -> Any:
    """`value` as a `kind`; ValueError naming `name` unless it is a number of that kind (an integer
    also does for a float) inside the range that the wire accepts for `message.field`."""
    lo, hi = message_range(message, field)
    if isinstance(value, bool) or not isinstance(value, numbers.Real if kind is float else numbers.Integral):
        raise ValueError(f"{name} must be {'a number' if kind is float else 'an integer'}, got {value!r}")
    if not lo <= value <= hi:
        raise ValueError(f"{what or name} must be in [{lo}, {hi}], got {value!r}")
    return kind(value)


def checked_points(points: list[int], length: int) -> list[int]:
    if len(points) > MAX_PREFIX_POINTS or not all(type(p) is int and 0 < p < length for p in points):
        raise ValueError(f"prefix_points are at most {MAX_PREFIX_POINTS} positions inside the prompt (0, {length})")
    return sorted(set(points))


def checked_salt(salt: Any) -> str | None:
    """`salt` when it is None or a string the prefix cache takes; ValueError naming cache_salt otherwise."""
    if salt is not None and (not isinstance(salt, str) or not 1 <= len(salt) <= MAX_CACHE_SALT):
        raise ValueError(f"cache_salt must be a non-empty string of at most {MAX_CACHE_SALT} characters, "
                         f"got {salt!r:.60}")
    return salt
