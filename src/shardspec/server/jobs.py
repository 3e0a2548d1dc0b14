"""A request's jobs: each choice of each prompt as one validated generation, with its token budget,
sampling and stop strings."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from shardspec.server.api import ApiError, GenerationBody

MAX_CHOICES = 128  # prompts x n in one request: each is a sequence in the engine
SEED_STRIDE = 0x9E3779B97F4A7C15  # odd: seed + j * it differs for every choice j < 2**63


@dataclass
class Job:
    """One validated generation: one choice of one prompt of a request."""

    endpoint: str
    prompt_ids: list[int]
    max_tokens: int
    sampling: dict[str, Any]
    stops: list[str]
    index: int = 0  # the choice's index in the response
    prompt_index: int = 0  # which of the request's prompts it continues
    logprobs: int | None = None  # top log-probabilities per token; None: none
    echo: str | None = None  # the prompt's text, to start the choice with (completions' echo)
    include_stop: bool = False  # a matched stop string ends the text (vLLM's include_stop_str_in_output)
    constraint_param: str = "response_format"  # the body field its structured output came from (errors name it)
    arrived: float = field(default_factory=time.perf_counter)  # its HTTP request reached the handler (set by it)

    @property
    def logprob_entries(self) -> int:
        """The log-probabilities the choice returns at most: for each token (the echoed prompt's, then up
        to max_tokens) the chosen one and the top ones."""
        if self.logprobs is None:
            return 0
        return (self.max_tokens + (len(self.prompt_ids) if self.echo is not None else 0)) * (self.logprobs + 1)

    @property
    def echo_only(self) -> bool:
        """echo with max_tokens 0: the prompt (and its log-probabilities) alone; one token is generated
        (the engine always samples one) and dropped."""
        return self.echo is not None and self.max_tokens == 0


def request_jobs(endpoint: str, body: GenerationBody, prompts: list[list[int]], param: str, max_tokens: int | None,
                 context: int) -> list[Job]:
    """n jobs per prompt, choice i * n + j being prompt i's j-th: its seed derived from the request's
    (seed + j * an odd constant), so that sampled choices differ and choice 0 is the request alone."""
    n = body.n or 1
    if len(prompts) * n > MAX_CHOICES:
        raise ApiError(400, f"{len(prompts)} prompts x n={n} makes {len(prompts) * n} choices; at most "
                       f"{MAX_CHOICES} per request", "n" if n > 1 else param)
    jobs = []
    for i, ids in enumerate(prompts):
        for j in range(n):
            job = _job(endpoint, body, ids, param, max_tokens, context)
            if body.seed is not None:
                job.sampling["seed"] = (body.seed + j * SEED_STRIDE) % 2**63
            job.index, job.prompt_index = i * n + j, i
            jobs.append(job)
    return jobs


def check_logprob_entries(jobs: list[Job], limit: int, param: str) -> None:
    """400 naming `param` for a request whose response could hold more than `limit` log-probabilities:
    refused before any work, as the answer would cost the server far more than the question."""
    entries = sum(job.logprob_entries for job in jobs)
    if entries > limit:
        raise ApiError(400, f"the response could hold {entries:,} log-probabilities (choices x tokens, an echoed "
                       f"prompt's included, x (top log-probabilities + 1)); this server returns at most {limit:,} "
                       "(serve --max-logprob-entries): ask for fewer choices, tokens or top log-probabilities", param)


def _job(endpoint: str, body: GenerationBody, prompt_ids: list[int], param: str, max_tokens: int | None,
         context: int) -> Job:
    """One choice of one prompt, checked against the model's context of `context` tokens."""
    if not prompt_ids:
        raise ApiError(400, "the prompt is empty", param)
    if len(prompt_ids) >= context:
        raise ApiError(400, f"the prompt ({len(prompt_ids)} tokens) does not fit the context of {context} "
                       "tokens", param)
    max_tokens = context - len(prompt_ids) if max_tokens is None else max_tokens
    if len(prompt_ids) + max_tokens > context:
        raise ApiError(400, f"prompt ({len(prompt_ids)} tokens) + max_tokens ({max_tokens}) exceeds the "
                       f"context of {context} tokens", "max_tokens")
    sampling = {"temperature": 1.0 if body.temperature is None else body.temperature,
                "top_p": 1.0 if body.top_p is None else body.top_p, "top_k": body.top_k or 0,
                "seed": body.seed, "stop_at_eos": not body.ignore_eos,
                "presence_penalty": body.presence_penalty or 0.0,
                "frequency_penalty": body.frequency_penalty or 0.0,
                "repetition_penalty": 1.0 if body.repetition_penalty is None else body.repetition_penalty,
                "structured_output": body.structured_output(), "stop_token_ids": body.stop_token_ids,
                "skip_special_tokens": body.skip_special_tokens is not False, "logit_bias": body.token_biases(),
                "min_tokens": body.min_tokens or 0}
    return Job(endpoint, prompt_ids, max_tokens, sampling, body.stop_strings(),
               include_stop=bool(body.include_stop_str_in_output),
               constraint_param="structured_outputs" if body.structured_outputs else "response_format")
