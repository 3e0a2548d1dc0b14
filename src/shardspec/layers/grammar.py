"""Grammar masks on logits (structured output), with llguidance's matchers: which tokens a grammar
allows next, as -inf on the logits of the others."""

from __future__ import annotations

from pathlib import Path

import torch
from llguidance import LLMatcher, LLTokenizer  # (not llguidance.torch: it imports torch._dynamo, seconds)


def llg_tokenizer(tokenizer_file: Path, vocab_size: int, eos_ids: list[int]) -> LLTokenizer:
    """llguidance's view of a model's tokenizer.json, over the model's vocabulary."""
    return LLTokenizer(tokenizer_file.read_text(), n_vocab=vocab_size, eos_token=eos_ids[0] if eos_ids else None)


def masked(logits: torch.Tensor, matcher: LLMatcher, tokens: list[int]) -> torch.Tensor:
    """logits [P, V] (fp32 copies) with row j limited to what the grammar allows after `tokens[:j]`
    (drafts: the rows after a token the grammar refuses, or after its end, are limited as that
    token's row, where the draft is refused anyway). The matcher is left as it was."""
    rows, vocab = logits.shape
    masks, consumed = [], 0
    for j in range(rows):
        masks.append(matcher.compute_bitmask())  # bit t of 32-bit word t // 32: token t is allowed
        if j == rows - 1 or j >= len(tokens) or not advance(matcher, tokens[j : j + 1]):
            masks += masks[-1:] * (rows - j - 1)
            break
        consumed += 1
    if consumed:
        matcher.rollback(consumed)
    words = torch.frombuffer(bytearray(b"".join(masks)), dtype=torch.int32).view(rows, -1)
    allowed = ((words[:, :, None] >> torch.arange(32, dtype=torch.int32)) & 1).bool().flatten(1)[:, :vocab]
    return logits.float().masked_fill(~allowed.to(logits.device), float("-inf"))


def advance(matcher: LLMatcher, tokens: list[int]) -> int:
    """Consume the tokens the grammar allows, in order, up to the first it refuses or its end (a
    token after the end would not count for rollback); how many it consumed."""
    consumed = 0
    for token in tokens:
        if matcher.is_stopped() or matcher.validate_tokens([token]) != 1:
            break
        matcher.consume_token(token)
        consumed += 1
    return consumed
