"""The step op: what a step asks of the workers (new sequences: their prompt, sampling, K/V blocks,
saved states and grammar; the running ones to advance) and what they answer. protocol.messages
puts it in the op set and re-exports it; the stage links carry its reply too (AcceptRecord)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

from shardspec.protocol.fields import bounded, text

MAX_LOGPROBS = 20  # top log-probabilities per token a sequence may ask for (vLLM's default limit)
MIN_TEMPERATURE = 1e-4  # below it, logits / temperature overflow float32: use 0 (greedy)
MIN_TOP_P = 1e-6  # below it, top_p rounds to 0 in float32 (denormals flushed) and would keep no token
MAX_PROMPT_TOKENS = 1 << 22  # one sequence's prompt
GRAMMAR_KEY_CHARS = 32  # a grammar's key: the hex of a 128-bit hash of its text
# StepReply.finished of a sequence that fails alone: its numbers went bad (layers.sampling.unusable), or its
# grammar failed (StepReply.errors says how)
FAILED = "error"
MAX_PREFIX_STATES = 1 << 16  # saved recurrent states of a worker's prefix cache
MAX_STEP_PROMPT_TOKENS = 2 * MAX_PROMPT_TOKENS  # a step's prompts together, by default (a worker's --max-message-mb)


# --- sampling -------------------------------------------------------------------------------


@dataclass(frozen=True)
class SamplingParams:
    """Per-sequence sampling. temperature 0 means greedy; top_k 0 and top_p 1 mean no filter."""

    temperature: float = bounded(0.0, 100.0, 0.0)
    top_k: int = bounded(0, 1 << 30, 0)
    top_p: float = bounded(0.0, 1.0, 1.0)
    seed: int = bounded(0, 2**63 - 1, 0)
    # penalties on the target's logits, as vLLM applies them: repetition (tokens of the prompt and
    # the output; 1 = off), then frequency (per occurrence) and presence (once) over the output's
    presence_penalty: float = bounded(-2.0, 2.0, 0.0)
    frequency_penalty: float = bounded(-2.0, 2.0, 0.0)
    repetition_penalty: float = bounded(0.0, 100.0, 1.0)

    def __post_init__(self) -> None:
        if self.repetition_penalty <= 0.0:
            raise ValueError(f"repetition_penalty must be above 0, got {self.repetition_penalty}")
        if self.top_p < MIN_TOP_P:
            raise ValueError(f"top_p must be in [{MIN_TOP_P}, 1], got {self.top_p}")
        if 0.0 < self.temperature < MIN_TEMPERATURE:
            raise ValueError(f"temperature must be 0 (greedy) or at least {MIN_TEMPERATURE}, got {self.temperature}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def penalised(self) -> bool:
        return bool(self.presence_penalty or self.frequency_penalty) or self.repetition_penalty != 1.0


# --- the step -------------------------------------------------------------------------------


@dataclass(frozen=True)
class PrefillSpec:
    """A new sequence: its prompt is the next `length` ids of the step's `prompt_ids` tensor."""

    seq: int = bounded(0, 2**63 - 1)
    length: int = bounded(1, MAX_PROMPT_TOKENS)
    sampling: SamplingParams = field(default_factory=SamplingParams)
    max_tokens: int = bounded(1, 1 << 22, 1 << 22)  # the worker stops the sequence after this many
    stop_ids: list[int] = field(default_factory=list)  # ... or after emitting one of these
    # log-probabilities in the step replies: -1 none; N >= 0 each emitted token's and the top N
    logprobs: int = bounded(-1, MAX_LOGPROBS, -1)
    prompt_logprobs: int = bounded(-1, MAX_LOGPROBS, -1)  # the same for prompt tokens 1.. (prefill reply)
    blocks: list[int] = field(default_factory=list)  # its K/V blocks, in position order (BlockGrant)
    # the prefix cache: the first `cached` positions' K/V are in its blocks already, and their recurrent
    # state is saved state `state`; the prefill starts after them. copy_from >= 0: its block holding
    # position cached - 1 starts as a copy of that block (the saved boundary's, which it may not write)
    cached: int = bounded(0, MAX_PROMPT_TOKENS - 1, 0)
    state: int = bounded(-1, MAX_PREFIX_STATES - 1, -1)
    copy_from: int = bounded(-1, 2**31 - 1, -1)
    saves: list[SaveAt] = field(default_factory=list)  # recurrent states to save on the way, in position order
    # the last `output` tokens of the prompt are output it streamed before (a preempted request's
    # prefill again): the penalties count them as output
    output: int = bounded(0, MAX_PROMPT_TOKENS - 1, 0)
    # structured output: the key of the grammar (GrammarRequest) its tokens must match, the output's
    # tokens so far included; "": none
    grammar: str = text(GRAMMAR_KEY_CHARS)
    logit_bias: list[TokenBias] = field(default_factory=list)  # added to the target's and the drafts' logits
    min_tokens: int = bounded(0, 1 << 22, 0)  # its stop ids cannot end it before it has emitted this many


@dataclass(frozen=True)
class TokenBias:
    """`bias` added to the logit of `token` before sampling (OpenAI's logit_bias)."""

    token: int = bounded(0, 2**31 - 1)
    bias: float = bounded(-100.0, 100.0)


@dataclass(frozen=True)
class SaveAt:
    """Save a prefilling sequence's recurrent state after its first `position` tokens as saved state `state`."""

    position: int = bounded(1, MAX_PROMPT_TOKENS)
    state: int = bounded(0, MAX_PREFIX_STATES - 1)


@dataclass(frozen=True)
class BlockGrant:
    """More K/V blocks for a running sequence, appended to its block table in this order."""

    seq: int = bounded(0, 2**63 - 1)
    blocks: list[int] = field(default_factory=list)


@dataclass(frozen=True)
class StepRequest:
    """Prefill new sequences, then advance running ones: one token each, or with MTP verify the
    pending drafts, accept, and draft again. Finished sequences in `decode` are skipped. Every
    sequence's blocks must cover its length plus the worker's step_span (LoadReply)."""

    OP: ClassVar[str] = "step"
    prefill: list[PrefillSpec] = field(default_factory=list)
    decode: list[int] = field(default_factory=list)
    return_logits: bool = False
    grow: list[BlockGrant] = field(default_factory=list)  # blocks for decoding sequences, before the step runs


@dataclass(frozen=True)
class StepReply:
    """Per sequence that produced tokens (prefills first, then decodes, in request order): the new
    token ids, the drafts accepted this step (-1 for a prefill), the next drafts, and whether the
    sequence finished ("stop", "length", FAILED or "").

    logprob_rows: empty unless a sequence asked for log-probabilities; else per sequence the rows it
    owns, in order, of the reply's tensors `logprobs` (float32 [R]: the log-probability of the
    token), `top_logprobs` (float32 [R, W]) and `top_ids` (int64 [R, W]: the W most likely tokens,
    most likely first): its prompt's tokens 1.. on its prefill if it asked for prompt_logprobs,
    then one row per emitted token if it asked for logprobs."""

    OP: ClassVar[str] = "step"
    seqs: list[int]
    tokens: list[list[int]]
    accepted: list[int]
    drafts: list[list[int]]
    finished: list[str]
    step_s: float
    logprob_rows: list[int] = field(default_factory=list)
    errors: list[SequenceError] = field(default_factory=list)  # why sequences whose grammar failed did (FAILED)


@dataclass(frozen=True)
class SequenceError:
    """Why sequence `seq` failed alone (its grammar met an error or took too long)."""

    seq: int = bounded(0, 2**63 - 1)
    message: str = text(1000)
