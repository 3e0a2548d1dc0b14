"""Log-probabilities of the target model for the step replies: what a sequence asks for with
`PrefillSpec.logprobs` / `prompt_logprobs`, computed from the raw target logits (before
temperature, top-k and top-p, as vLLM reports them by default)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

ROWS_PER_PASS = 256  # prompt positions whose full-vocabulary logits are held at once


@dataclass
class LogprobRows:
    """Rows of one sequence: each token's log-probability, and the top `width` (values, ids)."""

    chosen: torch.Tensor  # float32 [n]
    top_values: torch.Tensor  # float32 [n, width]
    top_ids: torch.Tensor  # int64 [n, width]


def token_rows(logits: torch.Tensor, tokens: torch.Tensor, top: int) -> LogprobRows:
    """Rows for `tokens` [n] from the logits [n, V] of the distributions they were drawn from."""
    logp = torch.log_softmax(logits.float(), -1)
    chosen = logp.gather(-1, tokens.to(logp.device).long()[:, None])[:, 0]
    values, ids = logp.topk(top, -1) if top else (logp[:, :0], logp[:, :0].long())
    return LogprobRows(chosen.cpu(), values.cpu(), ids.cpu())


def prompt_rows(logits_of: Callable[[torch.Tensor], torch.Tensor], hidden: torch.Tensor, targets: torch.Tensor,
                top: int) -> list[LogprobRows]:
    """Rows for `targets` [n] from the hidden states [n, H] before them, a few positions at a time
    (the full-vocabulary logits of a whole prefill chunk would be large)."""
    return [token_rows(logits_of(hidden[i : i + ROWS_PER_PASS]), targets[i : i + ROWS_PER_PASS], top)
            for i in range(0, len(targets), ROWS_PER_PASS)]


def chunk_prompt_rows(logits_of: Callable[[torch.Tensor], torch.Tensor], specs: list, prompts: torch.Tensor,
                      start: int, hidden: torch.Tensor, pending: dict[int, list[LogprobRows]]) -> None:
    """Into `pending` (per sequence): the rows of the prompt tokens after a prefill chunk's positions
    (from `start`; hidden [B, T, H]), for the sequences whose spec (PrefillSpec) asked (every rank
    takes the same branch: the specs are the same on all)."""
    for b, spec in enumerate(specs):
        if spec.prompt_logprobs >= 0:
            targets = prompts[b, start + 1 : start + 1 + hidden.shape[1]]
            pending.setdefault(spec.seq, []).extend(prompt_rows(logits_of, hidden[b, : len(targets)], targets,
                                                                spec.prompt_logprobs))


def reply_tensors(rows: list[LogprobRows]) -> dict[str, torch.Tensor]:
    """The step reply's tensors from every row group, top columns padded to the widest."""
    width = max(r.top_ids.shape[1] for r in rows)

    def pad(t: torch.Tensor, value: float) -> torch.Tensor:
        return torch.nn.functional.pad(t, (0, width - t.shape[1]), value=value)

    return {"logprobs": torch.cat([r.chosen for r in rows]).float(),
            "top_logprobs": torch.cat([pad(r.top_values, float("-inf")) for r in rows]).float(),
            "top_ids": torch.cat([pad(r.top_ids, -1) for r in rows]).long()}
