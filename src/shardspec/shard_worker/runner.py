"""The model runner of one rank: cache slots, live sequences, and the forward passes of a step.

Every rank holds the same sequence table and receives the same commands, so every check here has
the same outcome on every rank and the collectives inside the model always line up.

With pipeline stages, each stage runs its layers over every pass of a step: the first from the
token ids, the others from the hidden states the stage before sends (links.StageLinks). The last
stage decides: it samples, accepts and drafts as a single stage does, replies, and sends the step's
result to the earlier stages as an acceptance record. An earlier stage does not wait for it: it
replies at once and runs the next step, of another micro-batch, while the later stages finish this
one. It applies a record (commits its speculative state, takes the next tokens and drafts) when a
later step or a release names one of that step's sequences.

With MTP (draft_len k > 0) a sequence always carries k drafts for the positions after its pending
token. One step verifies them with the target model ([pending, d1..dk] in one speculative pass that
leaves the recurrent states alone), accepts a prefix, commits it (the recurrent layers replay the
accepted tokens), re-runs the MTP layer over the accepted positions with the target's true hidden
states, and chains the MTP head k times to draft again. Nothing but token ids leaves the worker.

Launch ahead: a single stage at TP = 1 on a GPU whose next request is already queued (the
orchestrator keeps the next step on the wire) and continues the current one (the same sequences,
greedy, no prefill) queues that step's pass on the device right behind the current one, its rows
built on the device from the current pass's outputs (StepPasses.again). The host then reads this
step's outputs, replies and takes the next request while the device runs the next pass, instead of
the device waiting for the host between steps. The next step's rows hold the sequences this one may
finish; their rows run on and are dropped (a finished sequence's caches are never read again).
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from shardspec import kernels
from shardspec.layers.batch import Batch
from shardspec.layers.sampling import (
    accept_greedy,
    accept_sampled,
    forced_accepts,
    resample,
    sample,
    target_probs,
)
from shardspec.models.base import CausalLM
from shardspec.protocol.errors import ErrorCode, ProtocolError
from shardspec.protocol.messages import PrefillSpec, SamplingParams, StepReply, StepRequest, WorkerOptions
from shardspec.shard_worker.graphs import HostRows, StepPasses
from shardspec.shard_worker.links import StageLinks
from shardspec.shard_worker.logprobs import LogprobRows, prompt_rows, reply_tensors, token_rows
from shardspec.shard_worker.penalties import TokenCounts

log = logging.getLogger("shardspec.worker")
# on a stage before the last: graph copies per batch bucket, one per step whose record is still to
# come (one per micro-batch in flight: pp of them by default); more at once run eagerly
STAGE_COPIES = 4
# batch-invariant mode: rows per matmul block (layers.linear.linear). On a GPU a decode step's matmuls
# read the weights once up to this many rows anyway; on a CPU a block costs compute per row
INVARIANT_BLOCK_ROWS = {"cuda": 64, "cpu": 16}
# lookahead "auto": the last stage guesses while the moving share of a lone sequence's steps that kept
# all k drafts (a guess can hold only then; over about the last KEPT_ALL_STEPS steps) is at least this
KEPT_ALL_TO_GUESS = 0.5
KEPT_ALL_STEPS = 16


def invariant_block_rows(device: torch.device) -> int:
    return INVARIANT_BLOCK_ROWS.get(device.type, 16)


def draft_head_mode(requested: str, model: CausalLM, dtype: torch.dtype, device: torch.device) -> str:
    """The draft head `requested` (WorkerOptions.draft_head) where it can run: the kernel needs CUDA,
    Triton and a bf16/fp16 model, and fp8 weights need compute capability 8.9 (Ada, Hopper) or
    later; bf16 before that."""
    if not kernels.enabled(model.lm_head.weight) or dtype not in (torch.bfloat16, torch.float16):
        return "cublas"
    if requested == "fp8" and torch.cuda.get_device_capability(device) < (8, 9):
        return "bf16"
    return requested


@dataclass
class Sequence:
    seq: int
    slot: int
    length: int  # tokens whose state is in the target cache
    next_token: int  # sampled but not yet fed through the model
    sampling: SamplingParams
    generator: torch.Generator | None  # on the device: sampling
    remaining: int  # tokens it may still emit
    stop_ids: frozenset[int]
    drafts: list[int] = field(default_factory=list)
    finished: str = ""  # "", "stop" or "length"
    logprobs: int = -1  # top log-probabilities per emitted token in the replies; -1: none
    counts: TokenCounts | None = None  # with penalties: the tokens seen so far
    # lookahead: the last stage's guess of the tokens of the step after the next ([pending, d1..dk] if the
    # next keeps all its drafts), from its chain of 2k + 1 drafts; [] when it made none
    guess: list[int] = field(default_factory=list)
    guess_held: bool = False  # the last stage: its last step proved the guess the next step's lookahead ran on
    draws: torch.Generator | None = None  # on the host: benchmark-only forced acceptance (drawn with no device sync)

    def penalise(self, logits: torch.Tensor, drafts: list[int]) -> torch.Tensor:
        """logits [P, V] as this sequence samples from them (penalised, row j after drafts[:j])."""
        return logits if self.counts is None else self.counts.penalise(logits, drafts, self.sampling)

    def seen(self, tokens: list[int]) -> None:
        if self.counts is not None:
            self.counts.add(tokens)

    def emit(self, tokens: list[int]) -> list[int]:
        """Cut `tokens` at a stop id or the token budget, and mark the sequence finished there."""
        for i, token in enumerate(tokens):
            if token in self.stop_ids:
                tokens, self.finished = tokens[: i + 1], "stop"
                break
        tokens = tokens[: self.remaining]
        self.remaining -= len(tokens)
        if not self.finished and self.remaining == 0:
            self.finished = "length"
        return tokens


@dataclass
class Launched:
    """A pass queued ahead of its step (launch ahead): the sequences of its rows, its outputs' copy."""

    seqs: list[int]
    out: HostRows


@dataclass
class Forwarded:
    """A step an earlier stage has run its layers over, until the last stage's record comes."""

    step: int
    new: list[int]  # the sequences it prefilled
    running: list[Sequence]  # the sequences it verified
    commit: Callable[[list[list[int]]], Any] | None  # its verify pass's commit (accepts -> None)
    guessed: list[int] | None = None  # a lookahead: the tokens it verified, the last stage's guess
    snapshot: Any = None  # a lookahead ran after it, as if it kept all its drafts: the state before (CausalLM.snapshot)

    def names(self, seqs: set[int]) -> bool:
        return any(seq in seqs for seq in self.new) or any(s.seq in seqs for s in self.running)


class SlotAllocator:
    def __init__(self, num_slots: int):
        self.total = num_slots
        self.free = list(range(num_slots - 1, -1, -1))

    def take(self) -> int:
        return self.free.pop()

    def give_back(self, slot: int) -> None:
        self.free.append(slot)


@dataclass
class StepResult:
    seqs: list[int] = field(default_factory=list)
    tokens: list[list[int]] = field(default_factory=list)
    accepted: list[int] = field(default_factory=list)
    drafts: list[list[int]] = field(default_factory=list)
    finished: list[str] = field(default_factory=list)
    logits: list[torch.Tensor] = field(default_factory=list)  # per pass, when asked for
    logprob_rows: list[int] = field(default_factory=list)  # per sequence (see StepReply)
    guesses: list[list[int]] = field(default_factory=list)  # per sequence, for the record (AcceptRecord)
    rows: list[LogprobRows] = field(default_factory=list)
    pending_rows: dict[int, list[LogprobRows]] = field(default_factory=dict)  # by sequence, until `add`

    def reply(self, step_s: float = 0.0) -> StepReply:
        rows = self.logprob_rows if any(self.logprob_rows) else []
        return StepReply(seqs=self.seqs, tokens=self.tokens, accepted=self.accepted, drafts=self.drafts,
                         finished=self.finished, step_s=step_s, logprob_rows=rows)

    def tensors(self) -> dict[str, torch.Tensor]:
        """The reply's tensors: the logits when asked for, the log-probabilities when any sequence asked."""
        tensors = {"logits": torch.cat(self.logits).cpu()} if self.logits else {}
        return tensors | (reply_tensors(self.rows) if self.rows else {})

    def add(self, seq: Sequence, tokens: list[int], accepted: int) -> None:
        self.seqs.append(seq.seq)
        self.tokens.append(tokens)
        self.accepted.append(accepted)
        self.drafts.append(list(seq.drafts))
        self.finished.append(seq.finished)
        self.guesses.append(list(seq.guess))
        rows = self.pending_rows.pop(seq.seq, [])
        self.rows.extend(rows)
        self.logprob_rows.append(sum(len(r.chosen) for r in rows))


@dataclass
class SpecCounters:
    drafts: int = 0
    draft_tokens: int = 0
    accepted_tokens: int = 0
    accepted_per_position: list[int] = field(default_factory=list)


class ModelRunner:
    def __init__(
        self,
        model: CausalLM,
        device: torch.device,
        max_slots: int,
        max_seq_len: int,
        prefill_chunk: int,
        draft_len: int = 0,
        forced_acceptance: float | None = None,
        cuda_graphs: bool = True,
        links: StageLinks | None = None,
        deterministic: bool = False,
        lookahead: str = "off",
        draft_head: str = WorkerOptions.draft_head,
        launch_ahead: str = WorkerOptions.launch_ahead,
    ):
        whole = model.stage.first and model.stage.last
        if not whole and links is None:
            raise ValueError("a model stage needs links to the other stages")
        if draft_len and model.stage.last and not model.has_mtp:
            raise ValueError("draft_len > 0 needs a model with an MTP head")
        self.model = model
        self.links = links
        self.steps = 0  # steps run: the same count on every stage, which names a step on the links
        self.passes_run = 0  # forward passes in the current step
        self.device = device
        self.max_seq_len = max_seq_len
        self.prefill_chunk = prefill_chunk
        self.draft_len = draft_len
        self.forced = forced_acceptance
        # lookahead (pipeline stages with MTP; eager passes only): when a step advances one sequence alone, the stages
        # before the last run its next verify pass on the last stage's guess of its tokens instead of
        # waiting for the step's record, and run it again when the record proves the guess wrong;
        # "auto": the last stage guesses while most lone steps keep all their drafts (KEPT_ALL_TO_GUESS)
        graphed = cuda_graphs and device.type == "cuda"
        self.lookahead = bool(lookahead != "off" and draft_len and not whole and not graphed)
        if lookahead != "off" and draft_len and not whole and graphed:
            log.info("lookahead is off: it is not built for CUDA graphs yet")
        self.always_guess = lookahead == "on"
        self.kept_all = 1.0  # the last stage: moving share of lone steps that kept all k drafts (from 1: guess first)
        self.chain = 2 * draft_len + 1 if self.lookahead else draft_len  # drafts chained for a lone sequence
        # launch ahead: `peek(until)` (set by the worker where its TP group is one rank) returns the next
        # request as soon as it is queued, or None once until() is true (the current pass is done)
        # ("on" also on a CPU, where it only reorders the work: tests)
        self.launch_ahead = whole and (launch_ahead == "on" or (launch_ahead == "auto" and graphed))
        self.peek: Callable[[Callable[[], bool]], StepRequest | None] | None = None
        self.launched: Launched | None = None  # the pass queued for the next step
        self.launches_ahead = 0  # passes launched ahead (a count, for the tests)
        # batch-invariant mode: the model's layers (CausalLM.set_batch_invariant), and prompts prefilled one
        # at a time in chunks that depend on the prompt alone
        self.deterministic = deterministic
        model.set_batch_invariant(invariant_block_rows(device) if deterministic else 0)
        self.slots = SlotAllocator(max_slots)
        self.sequences: dict[int, Sequence] = {}
        self.forwarded: deque[Forwarded] = deque()  # on an earlier stage: steps whose record is to come
        self.forwarded_max = 0
        self.lookaheads = self.lookaheads_right = 0  # verify passes run on a guess; those whose guess held
        self.counters = SpecCounters(accepted_per_position=[0] * draft_len)
        # the model's dtype: of its weights, not of FP8 ones or their fp32 scales (layers.fp8)
        dtype = next(p.dtype for name, p in model.named_parameters()
                     if p.dtype.itemsize > 1 and not name.endswith("_scale_inv"))
        # a verify pass writes k positions past the accepted ones and the draft chain k - 1 more past
        # those (also for a sequence that finishes in that step): room for them; one more slot is
        # scratch space for the padding rows of graphed batches
        # (with lookahead: a verify pass k + 1 positions past those, and a chain of 2k + 1)
        self.context = max_seq_len + (4 * draft_len + 2 if self.lookahead else 2 * draft_len)
        self.cache_dtype = dtype
        # the stage links stay outside the graphs: a later stage's graphs read the received hidden
        # states from a buffer; an earlier one's end at its layers' output, and commit when the record comes
        last = model.stage.last
        inputs = None if model.stage.first else (model.config.hidden_size, dtype)
        self.passes = StepPasses(self._verify_pass, self._draft_pass if last else self._commit_pass,
                                 self._fused_pass if last else None, device, draft_len, scratch_slot=max_slots,
                                 max_context=self.context, graphs=cuda_graphs, inputs=inputs,
                                 copies=1 if last else STAGE_COPIES)
        try:  # out of memory, say: leave no caches, fp8 head or graphs behind on the (kept) model
            self.draft_head = "cublas"
            if draft_len and model.lm_head is not None:
                self.draft_head = draft_head_mode(draft_head, model, dtype, device)
                model.lm_head.use_draft_kernel(self.draft_head)
            self.cache_bytes = model.allocate_caches(max_slots + 1, self.context, dtype, device)
            started = time.perf_counter()
            with torch.inference_mode():
                captured = self.passes.capture_all(max_slots)
        except BaseException:
            self.close()
            raise
        if captured:
            log.info("captured %d CUDA graphs (batch buckets for up to %d sequences) in %.1fs; drafts' LM head: %s",
                     captured, max_slots, time.perf_counter() - started, self.draft_head)

    def close(self) -> None:
        """Free the caches, the fp8 head and the graphs (with what the passes saved in the graphs'
        memory pool), so that a new runner on the same model does not hold both."""
        self.launched = None
        self.passes.close()
        self.model.allocate_caches(0, 0, self.cache_dtype, self.device)
        if self.model.lm_head is not None:
            self.model.lm_head.use_draft_kernel("cublas")
        self.sequences.clear()

    # --- the step -------------------------------------------------------------------------------

    @torch.inference_mode()
    def step(self, request: StepRequest, prompt_ids: torch.Tensor) -> StepResult:
        prompts = self._check(request, prompt_ids)
        self.steps, self.passes_run = self.steps + 1, 0
        if not self.model.stage.last:
            return self._stage_step(request, prompts)
        result = StepResult()
        if self.launched is not None and (request.prefill or request.return_logits
                                          or request.decode != self.launched.seqs):
            self.launched = None  # (its sequences' caches ran a step ahead of the host: a bug, said as one)
            raise RuntimeError("a pass was launched ahead for a step that did not come next")  # (_continues)
        self._prefill_all(request, prompts, result)
        running = [self.sequences[s] for s in request.decode if not self.sequences[s].finished]
        if running:
            self._verify(running, result, request.return_logits)
        self.launched = self.launched if running else None  # (all its rows' sequences have finished)
        if self.links is not None and result.seqs:  # a step of finished sequences only has no record
            self.links.send_record(self.steps, result.reply(), result.guesses if any(result.guesses) else None)
        return result

    @torch.inference_mode()  # (a commit it settles writes into the graphs' inference tensors)
    def release(self, seqs: list[int]) -> list[int]:
        self._settle(set(seqs))  # a slot is free once the commit of its last step has landed
        released = [s for s in dict.fromkeys(seqs) if s in self.sequences]
        for seq in released:
            self.slots.give_back(self.sequences.pop(seq).slot)
        return released

    def _check(self, request: StepRequest, prompt_ids: torch.Tensor) -> list[torch.Tensor]:
        new = [spec.seq for spec in request.prefill]
        if len(set(new)) != len(new) or len(set(request.decode)) != len(request.decode):
            raise ProtocolError(ErrorCode.BAD_REQUEST, "a sequence id appears twice in one step")
        for seq in new:
            if seq in self.sequences or seq in request.decode:
                raise ProtocolError(ErrorCode.BAD_REQUEST, f"sequence {seq} is already live")
        for seq in request.decode:
            if seq not in self.sequences:
                raise ProtocolError(ErrorCode.NOT_FOUND, f"sequence {seq} is not live on this worker")
        if len(new) > len(self.slots.free):
            raise ProtocolError(ErrorCode.CAPACITY, f"{len(new)} new sequences but {len(self.slots.free)} free slots")
        lengths = [spec.length for spec in request.prefill]
        if prompt_ids.dim() != 1 or prompt_ids.dtype not in (torch.int32, torch.int64):
            raise ProtocolError(ErrorCode.BAD_REQUEST, "prompt_ids must be a 1-D int32/int64 tensor")
        if sum(lengths) != prompt_ids.numel():
            raise ProtocolError(
                ErrorCode.BAD_REQUEST, f"prefill lengths sum to {sum(lengths)}, prompt_ids has {prompt_ids.numel()}"
            )
        vocab = self.model.config.vocab_size
        if prompt_ids.numel() and (int(prompt_ids.min()) < 0 or int(prompt_ids.max()) >= vocab):
            raise ProtocolError(ErrorCode.BAD_REQUEST, f"prompt token ids must lie in [0, {vocab})")
        too_long = [s.seq for s in request.prefill if s.length >= self.max_seq_len]
        if too_long:
            raise ProtocolError(ErrorCode.CAPACITY, f"prompts of {too_long} do not fit max_seq_len {self.max_seq_len}")
        return list(prompt_ids.long().split(lengths)) if lengths else []

    # --- prefill --------------------------------------------------------------------------------

    def _prefill_all(self, request: StepRequest, prompts: list[torch.Tensor], result: StepResult) -> None:
        by_length: dict[int, list[int]] = {}  # prompts of one length prefill together, as one batch
        for i, spec in enumerate(request.prefill):
            by_length.setdefault(spec.length, []).append(i)
        groups = by_length.values() if not self.deterministic else [[i] for i in range(len(request.prefill))]
        for group in groups:
            self._prefill([request.prefill[i] for i in group], torch.stack([prompts[i] for i in group]), result,
                          request.return_logits)

    def _prefill(self, specs: list[PrefillSpec], prompts: torch.Tensor, result: StepResult, want_logits: bool) -> None:
        """Prefill same-length prompts [B, L] together, sample their first tokens, draft."""
        slot_ids = [self.slots.take() for _ in specs]
        try:
            seqs = self._prefill_slots(specs, slot_ids, prompts.to(self.device), result, want_logits)
        except BaseException:
            for slot in slot_ids:
                self.slots.give_back(slot)
            raise
        for seq in seqs:
            self.sequences[seq.seq] = seq
            result.add(seq, [seq.next_token], -1)

    def chunk_length(self, prompts: int) -> int:
        """Tokens per prompt in one prefill pass: the pass takes at most prefill_chunk tokens in all,
        in whole multiples of 64 (fla's chunk) per prompt, but never fewer than 64 each (so more than
        prefill_chunk / 64 prompts overrun it); a prefill_chunk below 64 is taken as it is. Prompts
        prefill alone in deterministic mode."""
        if self.prefill_chunk < 64:
            return self.prefill_chunk
        share = self.prefill_chunk // prompts
        return max(64, share - share % 64)

    def _prefill_slots(self, specs, slot_ids, prompts, result: StepResult, want_logits: bool) -> list[Sequence]:
        slots = torch.tensor(slot_ids, device=self.device)
        self.model.reset_slots(slots)
        length = prompts.shape[1]
        if not self.model.stage.last:  # the first tokens and drafts come with the last stage's record
            for start in range(0, length, chunk := self.chunk_length(len(specs))):
                ids = prompts[:, start : start + chunk]
                positions = torch.arange(start, start + ids.shape[1], device=self.device).expand(len(specs), -1)
                self._forward(ids, Batch(slots, positions, start + ids.shape[1], tail=True))
            return [self._new_sequence(spec, slot, length, -1) for spec, slot in zip(specs, slot_ids)]
        hidden_before = None  # the target's hidden state just before the current chunk (for MTP)
        for start in range(0, length, chunk := self.chunk_length(len(specs))):
            ids = prompts[:, start : start + chunk]
            positions = torch.arange(start, start + ids.shape[1], device=self.device).expand(len(specs), -1)
            hidden = self._forward(ids, Batch(slots, positions, start + ids.shape[1], tail=True))
            if want_logits:
                result.logits.append(self.model.lm_head.logits(hidden).reshape(-1, self.model.config.vocab_size))
            self._prompt_logprobs(specs, prompts, start, hidden, result)
            if self.draft_len:  # MTP entry i pairs hidden i with token i+1: one position behind
                pairs = hidden[:, :-1] if hidden_before is None else torch.cat([hidden_before, hidden[:, :-1]], 1)
                if pairs.shape[1]:
                    n = pairs.shape[1]
                    self._mtp(ids[:, -n:], pairs, slots, positions[:, -n:] - 1, start + ids.shape[1] - 1, tail=True)
                hidden_before = hidden[:, -1:]
        last_logits = self.model.lm_head.logits(hidden[:, -1])
        seqs = []
        for b, (spec, slot, logits) in enumerate(zip(specs, slot_ids, last_logits)):
            seq = self._new_sequence(spec, slot, length, -1)
            if spec.sampling.penalised:
                seq.counts = TokenCounts(prompts[b], self.model.config.vocab_size)
            seq.next_token = sample(seq.penalise(logits[None], [])[0], spec.sampling, seq.generator)
            seq.seen(seq.emit([seq.next_token]))
            if seq.logprobs >= 0:
                token = torch.tensor([seq.next_token])
                result.pending_rows.setdefault(seq.seq, []).append(token_rows(logits[None], token, seq.logprobs))
            seqs.append(seq)
        if self.draft_len:
            first = torch.tensor([[s.next_token] for s in seqs], device=self.device)
            heads = self._mtp(first, hidden_before, slots, torch.full_like(first, length - 1), length)[:, 0]
            lengths = torch.full_like(slots, length)
            drafts = self._chain(heads, slots, lengths, min(length + self.draft_len, self.context)).tolist()
            for seq, d in zip(seqs, drafts):
                seq.drafts = [] if seq.finished else d
        return seqs

    def _new_sequence(self, spec: PrefillSpec, slot: int, length: int, token: int) -> Sequence:
        generator = draws = None
        if not spec.sampling.greedy:
            generator = torch.Generator(self.device).manual_seed(spec.sampling.seed)
        if self.forced is not None:
            draws = torch.Generator().manual_seed(spec.sampling.seed)
        budget = min(spec.max_tokens, self.max_seq_len - length)
        return Sequence(spec.seq, slot, length, token, spec.sampling, generator, budget, frozenset(spec.stop_ids),
                        logprobs=spec.logprobs, draws=draws)

    def _prompt_logprobs(self, specs: list[PrefillSpec], prompts: torch.Tensor, start: int, hidden: torch.Tensor,
                         result: StepResult) -> None:
        """The rows of the prompt tokens after this prefill chunk's positions, for the sequences that
        asked (every rank takes the same branch: the specs are the same on all)."""
        for b, spec in enumerate(specs):
            if spec.prompt_logprobs >= 0:
                targets = prompts[b, start + 1 : start + 1 + hidden.shape[1]]
                rows = prompt_rows(self.model.lm_head.logits, hidden[b, : len(targets)], targets, spec.prompt_logprobs)
                result.pending_rows.setdefault(spec.seq, []).extend(rows)

    # --- a stage before the last ----------------------------------------------------------------

    def _forward(self, ids: torch.Tensor, batch: Batch) -> torch.Tensor:
        """The stage's layers over one (prefill) pass: from the token ids on the first stage, from the
        stage before's hidden states on the others; a stage before the last sends its output on."""
        index = self._next_pass()
        x = self._receive(index, ids.shape)
        hidden = self.model(ids if x is None else x.to(self.device, copy=True), batch)  # (a frame is read-only)
        self._send(index, hidden)
        return hidden

    def _next_pass(self) -> int:
        """The number of the step's next pass, which names its messages on the stage links."""
        index, self.passes_run = self.passes_run, self.passes_run + 1
        return index

    def _receive(self, index: int, tokens: tuple[int, ...], kind: str = "pass", guess_held: bool = False
                 ) -> torch.Tensor | None:
        """The stage before's hidden states for pass `index` over `tokens` [B, T] (on the host);
        None on the first stage, which starts from the token ids. A stage before the last runs the
        same passes as the stage before it, so the next message must be of its `kind`; the last
        stage takes a lookahead only when `guess_held` (else the pass, or the redo after it)."""
        if self.model.stage.first:
            return None
        x, got = self.links.recv_hidden(self.steps, index, tuple(tokens),
                                        guess_held if self.model.stage.last else None)
        if got != kind and not self.model.stage.last:
            raise ProtocolError(ErrorCode.INTERNAL, f"stage link out of step: expected a {kind!r} message for "
                                f"pass {index} of step {self.steps}, got a {got!r} one")
        if x.dtype != self.cache_dtype:
            raise ProtocolError(ErrorCode.BAD_MESSAGE, f"hidden states in {x.dtype}; this stage runs "
                                f"{self.cache_dtype}")
        return x

    def _send(self, index: int, hidden: torch.Tensor, kind: str = "pass") -> None:
        """A stage before the last: pass `index`'s output to the next stage (one copy off the device)."""
        if not self.model.stage.last:
            self.links.send_hidden(self.steps, index, hidden, kind)

    def _stage_step(self, request: StepRequest, prompts: list[torch.Tensor]) -> StepResult:
        """A step on a stage before the last: the stage's layers over every pass of the step, sent on;
        its result is the last stage's (an empty reply here), its record applied later (_settle)."""
        if (ahead := self._ahead_of(request)) is not None:
            self._lookahead_step(ahead)
            return StepResult()
        self._settle(set(request.decode))
        before = set(self.sequences)
        self._prefill_all(request, prompts, StepResult())
        running = [self.sequences[s] for s in request.decode if not self.sequences[s].finished]
        commit = None
        if running:
            commit = self._stage_verify(self._next_pass(), self._rows(running), self._context(running))
        new = [s for s in self.sequences if s not in before]
        if new or running:  # else the last stage has nothing to run either (the same finished flags): no record
            self.forwarded.append(Forwarded(self.steps, new, running, commit))
            self.forwarded_max = max(self.forwarded_max, len(self.forwarded))
        return StepResult()

    def _ahead_of(self, request: StepRequest) -> Sequence | None:
        """The sequence a step runs a lookahead for: it advances one sequence alone, whose previous
        step, of it alone, is the one step still waiting for its record, and whose record before
        that carried a guess. Every stage before the last sees the same commands and records, so
        they all decide alike."""
        if not self.lookahead or request.prefill or len(request.decode) != 1 or len(self.forwarded) != 1:
            return None
        s, previous = self.sequences[request.decode[0]], self.forwarded[0]
        if s.finished or not s.guess or previous.new or [r.seq for r in previous.running] != [s.seq]:
            return None
        return s

    def _lookahead_step(self, s: Sequence) -> None:
        """Run this step's verify pass on the guess of the record before the last (as if the step
        still in flight keeps all its drafts and its new token is the guessed one), send it on, then
        apply the record of the step in flight: a wrong guess sends the pass again (_resolve)."""
        k, previous = self.draft_len, self.forwarded[0]
        slots = torch.tensor([s.slot], device=self.device)
        previous.snapshot = self.model.snapshot(slots)
        previous.commit([[k, 0]])  # as if it keeps all its drafts
        guessed = list(s.guess)
        rows = [[*guessed, s.length + k + 1, s.slot, -1]]  # at the positions after the in-flight step's
        commit = self._stage_verify(self._next_pass(), rows, self._context([s], k + 1), "lookahead")
        self.lookaheads += 1
        self.forwarded.append(Forwarded(self.steps, [], [s], commit, guessed=guessed))
        self.forwarded_max = max(self.forwarded_max, len(self.forwarded))
        self._apply(self.forwarded.popleft())

    def _stage_verify(self, index: int, rows: list[list[int]], context: int, kind: str = "pass") -> Callable:
        """A stage before the last: its layers over a verify pass (pass `index` of the step, `rows` as
        _rows packs them), sent on as a `kind` message; returns the pass's commit."""
        x = self._receive(index, (len(rows), self.draft_len + 1), kind)
        hidden, _, commit = self.passes.verify(rows, context, x)
        self._send(index, hidden, kind)
        return commit

    def _settle(self, seqs: set[int]) -> None:
        """Apply the records of the forwarded steps that name any of `seqs`, and of every step before
        them (records come in step order)."""
        last = max((i for i, f in enumerate(self.forwarded) if f.names(seqs)), default=-1)
        for _ in range(last + 1):
            self._apply(self.forwarded.popleft())

    def _apply(self, step: Forwarded) -> None:
        """The last stage's record of a forwarded step: commit the accepted prefixes, take the next
        tokens, drafts and guesses."""
        body = self.links.recv_record(step.step)
        record, running, new = body.reply, step.running, step.new
        if record.seqs != new + [s.seq for s in running]:
            raise ProtocolError(ErrorCode.INTERNAL, "the last stage's record does not list this step's sequences")
        guesses = body.guesses or [[] for _ in record.seqs]
        vocab = self.model.config.vocab_size
        if any(g and (len(g) != self.draft_len + 1 or not all(0 <= t < vocab for t in g)) for g in guesses):
            raise ProtocolError(ErrorCode.BAD_MESSAGE, f"a record's guess is not {self.draft_len + 1} token ids")
        for seq, tokens, drafts, finished, guess in zip(new, record.tokens, record.drafts, record.finished, guesses):
            s = self.sequences[seq]
            s.next_token, s.drafts, s.finished, s.guess = tokens[0], drafts, finished, guess
        accepted = [max(n, 0) for n in record.accepted[len(new) :]]
        if self.draft_len and running:
            if step.snapshot is None:  # (else the lookahead committed it as if it kept all; _resolve)
                step.commit([[n, 0] for n in accepted])  # without drafts the pass wrote its state itself
            self._count(accepted)
        tail = zip(running, accepted, record.tokens[len(new) :], record.drafts[len(new) :], record.finished[len(new) :],
                   guesses[len(new) :])
        for s, n, tokens, drafts, finished, guess in tail:
            s.length += n + 1
            s.next_token, s.drafts, s.finished, s.guess = tokens[-1], drafts, finished, guess
        if step.snapshot is not None:
            self._resolve(step, accepted[0])

    def _resolve(self, step: Forwarded, accepted: int) -> None:
        """The record of a step a lookahead ran on top of, which committed it as if it kept all its
        drafts: the guess was right when it did and its new token and drafts are the guessed ones.
        Else put the state back, commit what was kept and run the next step's pass again on the
        record's tokens. A finished sequence leaves the lookahead with no record to come."""
        s, ahead = step.running[0], self.forwarded[0]
        if s.finished:  # the last stage skips it from now on
            self.forwarded.popleft()
        elif accepted != self.draft_len or [s.next_token, *s.drafts] != ahead.guessed:
            self.model.restore(step.snapshot, torch.tensor([s.slot], device=self.device))
            step.commit([[accepted, 0]])
            # the lookahead's pass again, as pass 0 of its step (a lookahead step has no other)
            ahead.commit = self._stage_verify(0, self._rows([s]), self._context([s]), "redo")
        else:
            self.lookaheads_right += 1

    # --- verify, accept, draft ------------------------------------------------------------------

    def _verify(self, seqs: list[Sequence], result: StepResult, want_logits: bool) -> None:
        k = self.draft_len
        # lookahead: the chain of the one live sequence runs 2k + 1 drafts, the last k + 1 the guess of the
        # step after the next, for the stages before to run that step's pass on before this step's record
        # reaches them (with more live sequences, even in micro-batches of one, they have other work)
        ahead = self.lookahead and sum(not s.finished for s in self.sequences.values()) == 1  # (seqs: that one)
        guessing = ahead and (self.always_guess or self.kept_all >= KEPT_ALL_TO_GUESS)
        # the rows carry the guess (the chain then runs 2k + 1 drafts) when this step makes one, and when
        # the one it made before may hold: the chain must then keep the guessed drafts
        with_guess = guessing or (ahead and bool(seqs[0].guess))
        x = self._receive(self._next_pass(), (len(seqs), k + 1), guess_held=ahead and seqs[0].guess_held)
        context = self._context(seqs, chain=self.chain if ahead else k)
        wants_logprobs = any(s.logprobs >= 0 for s in seqs)
        plain = all(s.sampling.greedy and not s.sampling.penalised for s in seqs)
        if not want_logits and not wants_logprobs and plain:
            # greedy (or forced) acceptance needs no host decision: the whole step is one pass
            out = self._greedy(seqs, context, x, with_guess)
            accepted, tokens, drafts = [r[0] for r in out], [r[1] for r in out], [r[2:] for r in out]
        else:
            hidden, argmax, draft = self.passes.verify(self._rows(seqs, guesses=with_guess), context, x)
            accepted, tokens, logits = self._accept(seqs, hidden, argmax, result if want_logits else None,
                                                    wants_logprobs or not plain)
            if k:
                drafts = draft([[n, token] for n, token in zip(accepted, tokens)]).tolist()
        if k:
            self._count(accepted)
        emitted = []
        for s, n, token in zip(seqs, accepted, tokens):
            emitted.append(s.emit([*s.drafts[:n], token]))
            s.seen(emitted[-1])
            s.length += n + 1
            s.next_token = token
            s.drafts = []
        if k:
            for s, n, token, d in zip(seqs, accepted, tokens, drafts):
                # the guess the stages before ran this step's successor on holds when this step kept all
                # its drafts and its new token is the guessed one (the chain then kept the guessed drafts)
                s.guess_held = ahead and bool(s.guess) and n == k and token == s.guess[0]
                s.drafts = [] if s.finished else d[:k]
                s.guess = d[k:] if guessing and not s.finished else []
                if ahead:
                    self.kept_all += (float(n == k) - self.kept_all) / KEPT_ALL_STEPS
        for i, (s, n, new) in enumerate(zip(seqs, accepted, emitted)):
            if s.logprobs >= 0:  # token j of [d1..dn, bonus] was drawn from the target's logits at position j
                result.pending_rows[s.seq] = [token_rows(logits[i, : len(new)], torch.tensor(new), s.logprobs)]
            result.add(s, new, n if k else -1)

    def _greedy(self, seqs: list[Sequence], context: int, x: torch.Tensor | None, with_guess: bool) -> list[list[int]]:
        """The greedy pass's [accepted, token, *drafts] of each sequence: the pass launched ahead for
        this step if there is one, else this step's; before reading it, the next step's launched ahead
        where the next request comes while this pass runs and continues this step."""
        launched, self.launched = self.launched, None
        if launched is None:
            rows = self._rows(seqs, [self._forced(s) for s in seqs], with_guess)
            launched = Launched([s.seq for s in seqs], HostRows.copy(self.passes.greedy(rows, context, x)))
        # the orchestrator sends the next step once it has read the reply before this one: while this
        # pass runs, as a rule
        following = self.peek(launched.out.ready) if self.launch_ahead and self.peek is not None else None
        if self._continues(following, launched.seqs):
            forced = [self._forced(self.sequences[seq]) for seq in launched.seqs] if self.forced is not None else None
            self.launched = Launched(launched.seqs, HostRows.copy(self.passes.again(forced)))
            self.launches_ahead += 1
        out = launched.out.rows()
        row = {seq: i for i, seq in enumerate(launched.seqs)}
        return [out[row[s.seq]] for s in seqs]

    def _continues(self, request: StepRequest | None, seqs: list[int]) -> bool:
        """Whether `request` is the step after this one over the same rows (the sequences `seqs`, in
        order, no prefill, no logits), none of them known to be finished (a finished sequence's row
        would run on past its length, which the host no longer advances), none that can run past the
        caches (the pass runs before the host knows how far this step took them: at most k + 1
        positions), and the graph serves the next context."""
        if request is None or request.prefill or request.return_logits or request.decode != seqs:
            return False
        limit = self.max_seq_len - 2 * (self.draft_len + 1)
        rows = [self.sequences[seq] for seq in seqs]
        return all(not s.finished and s.length <= limit for s in rows) and self.passes.can_go_again()

    def _forced(self, s: Sequence) -> int:
        """Benchmark mode: the drafts this sequence keeps, drawn before the pass; -1 otherwise."""
        return -1 if self.forced is None else forced_accepts(len(s.drafts), self.forced, s.draws)

    def _verify_pass(self, packed: torch.Tensor, context: int,
                     x: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor | None, dict]:
        """The stage's layers over [pending, d1..dk] of each row, from the ids or the stage before's
        hidden states x: (hidden [B, k+1, H], greedy tokens [B, k+1] (None before the last stage),
        what the speculative pass saved for the commit)."""
        ids, batch = self._verify_batch(packed, context)
        hidden = self.model(ids if x is None else x, batch)
        return hidden, self.model.lm_head.argmax(hidden) if self.model.stage.last else None, batch.saved

    def _rows(self, seqs: list[Sequence], forced: list[int] | None = None, guesses: bool = False) -> list[list[int]]:
        """The packed rows of a verify pass (see _unpack); with `guesses`, each row's guess after them
        (-1s for none): the chain then runs 2k + 1 drafts (_draft_pass)."""
        forced = forced or [-1] * len(seqs)
        rows = [[s.next_token, *s.drafts, s.length, s.slot, n] for s, n in zip(seqs, forced)]
        if guesses:
            rows = [[*row, *(s.guess or [-1] * (self.draft_len + 1))] for row, s in zip(rows, seqs)]
        return rows

    def _context(self, seqs: list[Sequence], ahead: int = 0, chain: int | None = None) -> int:
        """Keys a verify pass from `ahead` positions past the sequences' lengths attends over: up to the
        last draft of the chain after it (k drafts, or `chain`)."""
        return max(s.length for s in seqs) + ahead + self.draft_len + 1 + (chain or self.draft_len)

    def _verify_batch(self, packed: torch.Tensor, context: int) -> tuple[torch.Tensor, Batch]:
        """The ids of a verify pass and its (speculative, with MTP) batch."""
        ids, positions, slots = self._unpack(packed)
        return ids, Batch(slots, positions, context, speculative=self.draft_len > 0)

    def _draft_pass(self, packed: torch.Tensor, accepts: torch.Tensor, hidden: torch.Tensor, saved: dict,
                    context: int) -> torch.Tensor:
        """Commit the accepted prefix, run the MTP layer over it with the target's hidden states, and
        chain k new drafts: [B, k]."""
        ids, positions, slots = self._unpack(packed)
        index, new_tokens = accepts[:, 0], accepts[:, 1]
        self.model.commit(saved, slots, index)
        # MTP entry j pairs hidden j with token j+1: the accepted drafts, then the new token
        following = torch.cat([ids[:, 1:], ids[:, -1:]], 1).scatter(1, index[:, None], new_tokens[:, None])
        heads = self._mtp(following, hidden, slots, positions, context)
        head = heads.gather(1, index[:, None, None].expand(-1, 1, heads.shape[-1]))[:, 0]
        lengths = positions[:, 0] + index + 1
        k = self.draft_len
        if packed.shape[1] == k + 4:
            return self._chain(head, slots, lengths, context)
        # lookahead (one sequence, eagerly): where the guess holds (all drafts kept, the new token the
        # guessed one) the chain keeps the guessed drafts, which the stages before already run the next
        # pass on, and drafts on
        guess = packed[0, k + 4 :]
        holds = bool(guess[0] == new_tokens[0]) and int(index[0]) == k
        return self._chain(head, slots, lengths, context, self.chain, guess[None, 1:] if holds else None)

    def _commit_pass(self, packed: torch.Tensor, accepts: torch.Tensor, hidden: torch.Tensor, saved: dict,
                     context: int) -> None:
        """A stage before the last: keep the accepted prefix of its verify pass (the record's counts)."""
        self.model.commit(saved, self._unpack(packed)[2], accepts[:, 0])

    def _fused_pass(self, packed: torch.Tensor, context: int, x: torch.Tensor | None) -> torch.Tensor:
        """Verify, accept on the device (drafts while they equal the target's argmax, or the forced
        count in packed's last column when it is >= 0), and draft: [B, 2 + k] = (accepted, token, drafts)."""
        hidden, argmax, saved = self._verify_pass(packed, context, x)
        k = self.draft_len
        matches = (argmax[:, :k] == packed[:, 1 : k + 1]).long().cumprod(1).sum(1)
        forced = packed[:, k + 3]
        accepted = torch.where(forced >= 0, forced, matches)
        accepts = torch.stack([accepted, argmax.gather(1, accepted[:, None])[:, 0]], 1)
        return torch.cat([accepts, self._draft_pass(packed, accepts, hidden, saved, context)], 1)

    def _unpack(self, packed: torch.Tensor):
        """packed rows: [pending, d1..dk, length, slot, forced accepts or -1], and with lookahead on the
        last stage the row's guess [pending, d1..dk] of the step after the next (-1s: none; _draft_pass)."""
        k = self.draft_len
        # the kernels index slots[b]: a contiguous copy of the column
        ids, starts, slots = packed[:, : k + 1], packed[:, k + 1], packed[:, k + 2].contiguous()
        return ids, starts[:, None] + torch.arange(k + 1, device=packed.device), slots

    def _accept(self, seqs: list[Sequence], hidden: torch.Tensor, argmax: torch.Tensor,
                logits_out: StepResult | None, wants_logits: bool = False):
        """Per sequence: (drafts accepted, the token after them), and the target's logits [B, k+1, V]
        where they were computed (None where they were not)."""
        sampled = [i for i, s in enumerate(seqs) if not s.sampling.greedy]
        logits = None
        if logits_out is not None or sampled or wants_logits:
            logits = self.model.lm_head.logits(hidden)  # [B, k+1, V]
            if logits_out is not None:
                logits_out.logits.append(logits.reshape(-1, logits.shape[-1]))
        argmax = argmax.tolist()
        accepted, tokens = [], []
        for i, s in enumerate(seqs):
            target = None if logits is None else s.penalise(logits[i], s.drafts)  # None: greedy, no penalties
            if s.counts is not None and s.sampling.greedy:
                argmax[i] = target.argmax(-1).tolist()
            probs = None if s.sampling.greedy else target_probs(target, s.sampling)
            if self.forced is not None:
                n = self._forced(s)
            elif probs is None:
                n = accept_greedy(argmax[i], s.drafts)
            else:
                n = accept_sampled(probs, s.drafts, s.generator)
            if probs is None:
                token = argmax[i][n]
            else:
                token = resample(probs, s.drafts, n, s.generator)
            accepted.append(n)
            tokens.append(token)
        return accepted, tokens, logits

    def _mtp(self, next_ids: torch.Tensor, hidden: torch.Tensor, slots: torch.Tensor, positions: torch.Tensor,
             context: int, tail: bool = False):
        """MTP layer over (token t+1, target hidden t) pairs at positions t < context; -> its normed output."""
        return self.model.draft(next_ids, hidden, Batch(slots, positions, context, tail=tail))

    def _chain(self, head: torch.Tensor, slots: torch.Tensor, lengths: torch.Tensor, context: int,
               length: int | None = None, kept: torch.Tensor | None = None) -> torch.Tensor:
        """Chain the MTP head `length` (default k) times: draft i is its argmax, or kept[:, i] for the
        drafts `kept` gives; its output and draft i feed draft i+1 ([B, length])."""
        length = length or self.draft_len
        drafts = []
        for i in range(length):
            if kept is not None and i < kept.shape[1]:
                token = kept[:, i]
            else:
                token = self.model.lm_head.draft_argmax(head)  # vocabulary-parallel: (max, index) per rank
            drafts.append(token)
            if i + 1 < length:
                head = self._mtp(token[:, None], head[:, None], slots, (lengths + i)[:, None], context)[:, 0]
        return torch.stack(drafts, 1)

    def _count(self, accepted: list[int]) -> None:
        c = self.counters
        c.drafts += len(accepted)
        c.draft_tokens += len(accepted) * self.draft_len
        c.accepted_tokens += sum(accepted)
        for n in accepted:
            for j in range(n):
                c.accepted_per_position[j] += 1
