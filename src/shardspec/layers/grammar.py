"""Grammar masks on logits (structured output): a sequence's llguidance matcher, which tokens it
allows next, as -inf on the logits of the others; the time its masks take and the first error it
meets, for its sequence to fail alone."""

from __future__ import annotations

import time

import numpy as np
import torch
from llguidance import LLMatcher  # (not llguidance.torch: it imports torch._dynamo, seconds)

from shardspec.constraints import allowed_mask


class Constraint:
    """A sequence's grammar on the last stage: its matcher at the sequence's emitted tokens, the time
    its masks, advances and rollbacks took since `spent` was last reset, and `failure`: the first
    error the matcher met ("" while none). llguidance errors are the same on every rank (its limits
    count work, not time); `spent` is this rank's own."""

    def __init__(self, matcher: LLMatcher, special: np.ndarray, words: int | None = None):
        self.matcher = matcher
        self.special = special  # the special tokens' bit mask: those a mask allows are checked one by one
        self.words = words  # its masks' 32-bit words, computed without the GIL (None: with it; allowed_mask)
        self.spent = 0.0
        self.failure = ""
        # the masks `forced` computed, at the matcher's state and after each forced token: the first
        # rows of the next `masks`, whose tokens start with those forced ones (cleared by any change)
        self.known: list[bytearray] = []
        self.known_tokens: list[int] = []

    def forced(self, most: int) -> list[int]:
        """The tokens the grammar alone allows next, one after the other (each the only token of its
        mask), at most `most` of them: drafts the target must accept. The matcher is left as it was."""
        started = time.perf_counter()
        tokens: list[int] = []
        self.known = [allowed_mask(self.matcher, self.special, self.words)]
        while len(tokens) < most and not self._failed() and (token := single(self.known[-1])) is not None:
            if not self._consume(token):
                break
            tokens.append(token)
            if len(tokens) < most:
                self.known.append(allowed_mask(self.matcher, self.special, self.words))
        self.matcher.rollback(len(tokens))
        self.known = self.known[: len(tokens) + 1]
        self.known_tokens = tokens
        self.spent += time.perf_counter() - started
        return tokens

    def masks(self, tokens: list[int], rows: int) -> torch.Tensor:
        """[rows, words] int32 bitmasks: row j what the grammar allows after `tokens[:j]` (the rows
        after a token it refuses, or after its end, repeat that token's row, where the token is
        refused anyway). The matcher is left as it was. Rows `forced` computed are taken as they are."""
        started = time.perf_counter()
        masks, consumed = [], 0
        known = self.known if tokens[: len(self.known_tokens)] == self.known_tokens else []
        self.known, self.known_tokens = [], []
        for j in range(rows):
            masks.append(known[j] if j < len(known) else allowed_mask(self.matcher, self.special, self.words))
            if self._failed() or j == rows - 1 or j >= len(tokens) or not self._consume(tokens[j]):
                masks += masks[-1:] * (rows - j - 1)
                break
            consumed += 1
        if consumed:
            self.matcher.rollback(consumed)
        self.spent += time.perf_counter() - started
        return torch.frombuffer(bytearray(b"".join(masks)), dtype=torch.int32).view(rows, -1)

    def advance(self, tokens: list[int]) -> int:
        """Consume the tokens the grammar allows, in order, up to the first it refuses or its end (a
        token after the end would not count for rollback); how many it consumed."""
        self.known, self.known_tokens = [], []
        started = time.perf_counter()
        consumed = 0
        for token in tokens:
            if not self._consume(token):
                break
            consumed += 1
        self.spent += time.perf_counter() - started
        return consumed

    def accept(self, tokens: list[int]) -> bool:
        """Consume emitted tokens; False (and `failure` set) where the grammar refuses one (past its
        end it allows only the end of text, which ends the sequence: not consumed, not refused)."""
        if self.failure:
            return False
        if self.advance(tokens) != len(tokens) and not self.matcher.is_stopped():
            self.failure = self.failure or "the grammar refused a token its own mask allowed"
        return not self.failure

    def rollback(self, n: int) -> None:
        if n:
            self.known, self.known_tokens = [], []
            self.matcher.rollback(n)

    def _consume(self, token: int) -> bool:
        if self.matcher.is_stopped() or self.matcher.validate_tokens([token]) != 1:
            self._failed()
            return False
        self.matcher.consume_token(token)
        return not self._failed()

    def _failed(self) -> bool:
        if not self.failure and self.matcher.is_error():
            self.failure = "the grammar failed: " + self.matcher.get_error().strip().split("\n", 1)[0][:300]
        return bool(self.failure)


def single(mask: bytearray) -> int | None:
    """The one token a bitmask allows, or None (none, or several)."""
    words = np.frombuffer(mask, dtype=np.uint32)
    nonzero = np.flatnonzero(words)
    if len(nonzero) != 1:
        return None
    word = int(words[nonzero[0]])
    return int(nonzero[0]) * 32 + word.bit_length() - 1 if word & (word - 1) == 0 else None


def masked(logits: torch.Tensor, constraint: Constraint, tokens: list[int],
           words: torch.Tensor | None = None) -> torch.Tensor:
    """logits [P, V] (fp32 copies) with row j limited to what the grammar allows after `tokens[:j]`
    (`words`: those masks computed before); all -inf once the grammar has failed (its sequence then
    fails: layers.sampling.unusable). The bit masks are unpacked where the logits are."""
    words = constraint.masks(tokens, logits.shape[0]) if words is None else words
    if constraint.failure:
        return torch.full_like(logits, float("-inf"), dtype=torch.float32)
    return apply_masks(logits, words)


def masked_each(logits: torch.Tensor, constraints: list[Constraint]) -> torch.Tensor:
    """logits [B, V] (fp32 copies) with row b limited to what constraints[b] allows next, the masks
    unpacked in one pass for all rows (a draft of a batch: not one pass a row); a failed
    constraint's row all -inf, as `masked` gives it."""
    words = torch.cat([constraint.masks([], 1) for constraint in constraints])
    out = apply_masks(logits, words)
    failed = [b for b, constraint in enumerate(constraints) if constraint.failure]
    if failed:
        out[failed] = float("-inf")
    return out


def apply_masks(logits: torch.Tensor, words: torch.Tensor) -> torch.Tensor:
    """logits [..., V] (an fp32 copy) with -inf where the bit masks words [..., ceil(V / 32)] (int32,
    on the host) have 0; the masks are unpacked where the logits are."""
    words = words.to(logits.device, non_blocking=True)
    bits = torch.arange(32, dtype=torch.int32, device=logits.device)
    allowed = ((words[..., None] >> bits) & 1).bool().flatten(-2)[..., : logits.shape[-1]]
    return logits.float().masked_fill(~allowed, float("-inf"))
