"""The model runner of one rank: what both pipeline roles share.

A runner holds the rank's sequence table, its caches and the forward passes of a step. Its role is
chosen once, when the model loads (loading.make_runner): the last stage (decoder.Decoder: samples,
accepts and drafts, as a single stage does) or a stage before the last (stage.ForwardingStage: runs
its layers and sends the hidden states on). With pipeline stages each stage runs its layers over
every pass of a step: the first from the token ids, the others from the hidden states the stage
before sends (links.StageLinks).

With MTP (draft_len k > 0) a sequence always carries k drafts for the positions after its pending
token. A verify pass runs the target model over [pending, d1..dk] of each sequence (sequences.Rows)
in one speculative pass that leaves the recurrent states alone until the accepted prefix commits.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import torch

from shardspec import kernels
from shardspec.layers.batch import BLOCK_TOKENS, Batch, CacheShape
from shardspec.models.base import CausalLM
from shardspec.protocol.errors import ErrorCode, ProtocolError
from shardspec.protocol.messages import (
    PrefillSpec,
    SaveFinished,
    StepRequest,
    WorkerOptions,
)
from shardspec.shard_worker.branches import MAX_BRANCHES, BranchSlots
from shardspec.shard_worker.graphs import StepPasses
from shardspec.shard_worker.links import StageLinks
from shardspec.shard_worker.results import RunnerStats, SpecCounters, StepResult
from shardspec.shard_worker.sequences import Paging, Rows, Sequence, SequenceTable

log = logging.getLogger("shardspec.worker")
# batch-invariant mode: rows per matmul block (layers.linear.linear). On a GPU a decode step's matmuls
# read the weights once up to this many rows anyway; on a CPU a block costs compute per row
INVARIANT_BLOCK_ROWS = {"cuda": 64, "cpu": 16}


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


def fixed_cache_bytes(slot_bytes: int, block_bytes: int, max_seqs: int, max_blocks: int, saved: int = 0) -> int:
    """What a cache sets aside before its K/V blocks: max_seqs + 1 recurrent states and block-table
    rows (one for padding rows), `saved` recurrent states of the prefix cache, and the scratch block."""
    return (max_seqs + 1) * (slot_bytes + 4 * max_blocks) + saved * slot_bytes + block_bytes


# the share of a cache (past its sequences' own states) the prefix cache's saved recurrent states may take
SAVED_STATES_SHARE = 1 / 8


def cache_plan(model: CausalLM, dtype: torch.dtype, max_seqs: int, max_blocks: int, budget: int | None,
               prefix_cache: bool) -> tuple[int, int]:
    """(K/V blocks, saved recurrent states) of a cache of `budget` bytes (None: no limit). The cache
    first sets aside max_seqs + 1 recurrent states and block tables and the scratch block; with the
    prefix cache, up to max_seqs saved states within SAVED_STATES_SHARE of the rest; the rest is K/V
    blocks, no more than max_seqs sequences of max_blocks each can use. ValueError when it holds
    fewer than one sequence at full length."""
    useful = max_seqs * max_blocks
    slot_bytes, block_bytes = model.cache_bytes_per(dtype)
    saved = max_seqs if prefix_cache else 0
    if budget is None or block_bytes == 0:  # (a stage without attention layers: its blocks cost nothing)
        return useful, saved
    fixed = fixed_cache_bytes(slot_bytes, block_bytes, max_seqs, max_blocks)
    if slot_bytes:
        saved = min(saved, max(0, int((budget - fixed) * SAVED_STATES_SHARE)) // slot_bytes)
    blocks = (budget - fixed - saved * slot_bytes) // block_bytes
    if blocks < max_blocks:
        raise ValueError(f"a cache of {budget / 2**20:.1f} MiB holds {max(blocks, 0) * BLOCK_TOKENS} positions of "
                         f"K/V after {max_seqs} sequences' recurrent states ({fixed / 2**20:.1f} MiB); one sequence "
                         f"of the longest length needs {max_blocks * BLOCK_TOKENS}: raise --cache-memory, or lower "
                         "--max-seq-len or --max-seqs")
    return min(useful, blocks), saved


# prefill passes (start position, tokens, prompts) run at load on a GPU besides a whole chunk of one
# prompt from 0: fla's chunked form on a length that is not a multiple of 16, alone and two prompts at
# once, and a cached turn's short tails (kernels.gdn.FLA_MIN_TOKENS: 64), each kind of length once
# (ModelRunner._warm_prefill)
WARM_PREFILLS = ((0, 77, 1), (0, 77, 2), (37, 61, 1), (5, 48, 1))


class ModelRunner:
    """What both roles share: the sequence table, the caches, the passes, the prefill chunks and the
    stage links' hidden states. A role supplies `step`, `_prefill_slots`, `_follow_pass` (after a
    verify pass: draft, or commit) and `_fused_pass` (None: the role has none)."""

    COPIES = 1  # graph copies per batch bucket (graphs.StepPasses)

    def __init__(
        self,
        model: CausalLM,
        device: torch.device,
        max_seqs: int,
        max_seq_len: int,
        prefill_chunk: int,
        draft_len: int = 0,
        forced_acceptance: float | None = None,
        cuda_graphs: bool = True,
        links: StageLinks | None = None,
        deterministic: bool = False,
        lookahead: str = "off",
        tree_width: int = 0,
        draft_head: str = WorkerOptions.draft_head,
        cache_bytes: int | None = None,
        prefix_cache: bool = False,
    ):
        if not (model.stage.first and model.stage.last) and links is None:
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
        self.rows = Rows(draft_len)
        self.forced = forced_acceptance
        self.graphed = cuda_graphs and device.type == "cuda"
        # lookahead (pipeline stages with MTP; eager passes only): decoder.Decoder and stage.ForwardingStage
        whole = model.stage.first and model.stage.last
        self.lookahead = bool(lookahead != "off" and draft_len and not whole and not self.graphed)
        if lookahead != "off" and draft_len and not whole and self.graphed:
            log.info("lookahead is off: it is not built for CUDA graphs yet")
        self.always_guess = lookahead == "on"
        self.branching = self.lookahead and lookahead == "tree"  # a tree of guesses (branches.py)
        self.tree_width = tree_width  # its branches per guess; 0: adaptive
        self.chain = 2 * draft_len + 1 if self.lookahead else draft_len  # a lone sequence's drafts and guess
        # batch-invariant mode: the model's layers (CausalLM.set_batch_invariant), and prompts prefilled one
        # at a time in chunks that depend on the prompt alone
        self.deterministic = deterministic
        model.set_batch_invariant(invariant_block_rows(device) if deterministic else 0)
        self.counters = SpecCounters(accepted_per_position=[0] * draft_len)
        # the model's dtype: of its weights, not of FP8 ones or their fp32 scales (layers.fp8)
        dtype = next(p.dtype for name, p in model.named_parameters()
                     if p.dtype.itemsize > 1 and not name.endswith("_scale_inv"))
        # a verify pass writes k positions past the accepted ones and the draft chain k - 1 more past
        # those (also for a sequence that finishes in that step): room for them; one more slot is
        # scratch space for the padding rows of graphed batches
        # (with lookahead: a verify pass k + 1 positions past those, and a chain of 2k + 1)
        self.context = max_seq_len + (4 * draft_len + 2 if self.lookahead else 2 * draft_len)
        max_blocks = -(-self.context // BLOCK_TOKENS)
        kv_blocks, self.prefix_states = cache_plan(model, dtype, max_seqs, max_blocks, cache_bytes, prefix_cache)
        spare = MAX_BRANCHES if self.branching else 0  # branch slots (branches.py)
        self.saved_rows = max_seqs + 1 + spare  # saved state i is recurrent-state row saved_rows + i (CacheShape.saved)
        self.paging = Paging(kv_blocks, BLOCK_TOKENS, max_blocks, self.context - max_seq_len + 1, self.context)
        self.table = SequenceTable(max_seqs, max_seq_len, model.config.vocab_size, device, forced_acceptance,
                                   self.paging, self.prefix_states, spare)
        self.branch_slots = BranchSlots(max_seqs + 1, kv_blocks + 1, spare, self.table.tables, BLOCK_TOKENS)
        self.cache_dtype = dtype
        # the stage links stay outside the graphs: a later stage's graphs read the received hidden
        # states from a buffer; an earlier one's end at its layers' output, and commit when the record comes
        inputs = None if model.stage.first else (model.config.hidden_size, dtype)
        self.passes = StepPasses(self._verify_pass, self._follow_pass, self._fused_pass, device, self.rows,
                                 scratch_slot=max_seqs, max_context=self.context, graphs=cuda_graphs, inputs=inputs,
                                 copies=self.COPIES)
        try:  # out of memory, say: leave no caches, fp8 head or graphs behind on the (kept) model
            self.draft_head = "cublas"
            if draft_len and model.lm_head is not None:
                self.draft_head = draft_head_mode(draft_head, model, dtype, device)
                model.lm_head.use_draft_kernel(self.draft_head)
            shape = CacheShape(self.saved_rows, kv_blocks + 1 + 2 * spare, self.table.tables, saved=self.prefix_states)
            self.cache_bytes = model.allocate_paged(shape, dtype, device) + self.table.tables.nbytes
            self.cache_bytes += self._allocate_boundaries(max_seqs + 1, self.prefix_states, dtype)
            started = time.perf_counter()
            with torch.inference_mode():
                captured = self.passes.capture_all(max_seqs) + self._capture_tails(max_seqs)
                warmed = time.perf_counter()
                shapes = self._warm_prefill(max_seqs) if device.type == "cuda" else 0
        except BaseException:
            self.close()
            raise
        if captured:
            log.info("captured %d CUDA graphs (batch buckets for up to %d sequences) in %.1fs; drafts' LM head: %s",
                     captured, max_seqs, warmed - started, self.draft_head)
        if shapes:
            log.info("ran %d prefill shapes to compile their kernels in %.1fs", shapes, time.perf_counter() - warmed)

    def _warm_prefill(self, scratch_slot: int) -> int:
        """A prefill pass of each of WARM_PREFILLS (start, tokens, prompts) on the scratch slot (its state
        and block are scratch space), through this stage's layers, its LM head and MTP layer: a GPU kernel is
        compiled the first time it meets a kind of shape (Triton specializes a length on its divisibility
        by 16; fla's chunked form, from FLA_MIN_TOKENS tokens on, also autotunes), which on a 9B-class
        model takes longer than the step watchdog gives a step; here it runs before the load's reply
        instead of inside a request's first step. Returns the passes run."""
        model, device = self.model, self.device
        chunk = min(self.chunk_length(1), self.context)
        shapes = sorted({(0, chunk, 1), *((s, t, b) for s, t, b in WARM_PREFILLS if s + t <= self.context)})
        for start, tokens, rows in shapes:
            slots = torch.full((rows,), scratch_slot, device=device)  # (rows of one slot: scratch writes)
            batch = Batch(slots, torch.arange(start, start + tokens, device=device).expand(rows, -1), start + tokens,
                          tail=True)
            ids = torch.zeros(rows, tokens, dtype=torch.long, device=device)
            x = ids if model.stage.first else torch.zeros(rows, tokens, model.config.hidden_size,
                                                            dtype=self.cache_dtype, device=device)
            hidden = model(x, batch)
            if model.stage.last:
                model.lm_head.logits(hidden[:, -1])
                if self.draft_len:  # (from a cached position, the hidden state before it first)
                    self._draft_prefill(ids, hidden, hidden[:, :1] if start else None, slots, batch)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        return len(shapes)

    def _capture_tails(self, scratch_slot: int) -> int:
        """A role's graphs of short prefills, captured after the passes' (Decoder); returns how many."""
        return 0

    def _draft_prefill(self, ids: torch.Tensor, hidden: torch.Tensor, hidden_before: torch.Tensor | None,
                       slots: torch.Tensor, batch: Batch) -> None:
        """The MTP layer over a prefill chunk (ids, the target's hidden states, their batch), one
        position behind: its entry i pairs hidden state i with token i + 1, from `hidden_before` [B, 1,
        H], the state before the chunk (None at position 0)."""
        pairs = hidden[:, :-1] if hidden_before is None else torch.cat([hidden_before, hidden[:, :-1]], 1)
        if pairs.shape[1]:
            n = pairs.shape[1]
            self.model.draft(ids[:, -n:], pairs, Batch(slots, batch.positions[:, -n:] - 1, batch.kv_len - 1,
                                                       tail=batch.lengths is None, lengths=batch.lengths))

    @property
    def sequences(self) -> dict[int, Sequence]:
        return self.table.sequences

    def close(self) -> None:
        """Free the caches, the fp8 head and the graphs (with what the passes saved in the graphs'
        memory pool), so that a new runner on the same model does not hold both."""
        self.passes.close()
        self.model.allocate_caches(0, 0, self.cache_dtype, self.device)  # (no blocks: frees them)
        if self.model.lm_head is not None:
            self.model.lm_head.use_draft_kernel("cublas")
        self.table.clear()

    def stats(self) -> RunnerStats:
        c = self.counters
        return RunnerStats(cache_bytes=self.cache_bytes, slots_total=self.table.slots.total,
                           slots_free=len(self.table.slots.free), live_sequences=sorted(self.sequences),
                           draft_len=self.draft_len, drafts=c.drafts, draft_tokens=c.draft_tokens,
                           accepted_tokens=c.accepted_tokens, accepted_per_position=list(c.accepted_per_position),
                           grammar_tokens=c.grammar_tokens, forced_tokens=c.forced_tokens, grammar_s=c.grammar_s,
                           grammar_steps=c.grammar_steps)

    # --- the step (the role's) ------------------------------------------------------------------

    def step(self, request: StepRequest, prompt_ids: torch.Tensor) -> StepResult:
        raise NotImplementedError

    @torch.inference_mode()  # (a commit a stage settles writes into the graphs' inference tensors)
    def release(self, seqs: list[int], saves: list[SaveFinished] = ()) -> list[int]:
        """Free the sequences of `seqs` that are live, after saving the states `saves` names."""
        self.table.check_saves(seqs, saves)
        if saves:
            slots = torch.tensor([self.sequences[save.seq].slot for save in saves], device=self.device)
            self._save_states(slots, [save.state for save in saves])
        return self.table.release(seqs)

    def _begin(self, request: StepRequest, prompt_ids: torch.Tensor) -> list[torch.Tensor]:
        """Check a step's request; returns its prompts."""
        prompts = self.table.check(request, prompt_ids)
        for grant in request.grow:
            self.table.grant(self.sequences[grant.seq], grant.blocks)
        self.steps, self.passes_run = self.steps + 1, 0
        return prompts

    # --- prefill --------------------------------------------------------------------------------

    def _prefill_all(self, request: StepRequest, prompts: list[torch.Tensor], result: StepResult) -> None:
        # prompts of one length, starting at one cached position and saving states at the same
        # positions, prefill together as one batch
        groups: dict[tuple, list[int]] = {}
        for i, spec in enumerate(request.prefill):
            key = (spec.length, spec.cached, tuple(save.position for save in spec.saves))
            groups.setdefault(key if not self.deterministic else (i,), []).append(i)
        for group in groups.values():
            self._prefill([request.prefill[i] for i in group], torch.stack([prompts[i] for i in group]), result,
                          request.return_logits)

    def _prefill(self, specs: list[PrefillSpec], prompts: torch.Tensor, result: StepResult, want_logits: bool) -> None:
        """Prefill same-length prompts [B, L] together (the role's _prefill_slots) into new slots,
        each from the same cached position (PrefillSpec.cached: its saved state restored, its boundary
        block copied)."""
        slot_ids = [self.table.slots.take() for _ in specs]
        try:
            slots = torch.tensor(slot_ids, device=self.device)
            if not specs[0].cached:  # (from a cached position the restore below writes the whole state)
                self.model.reset_slots(slots)
            seqs = [self.table.new(spec, slot, prompts.shape[1]) for spec, slot in zip(specs, slot_ids)]
            for seq, spec in zip(seqs, specs):
                self.table.grant(seq, spec.blocks)
            copies = [(spec.copy_from, spec.blocks[(spec.cached - 1) // self.paging.block_tokens])
                      for spec in specs if spec.copy_from >= 0]
            if copies:
                src, dst = (torch.tensor(ids, device=self.device) for ids in zip(*copies))
                self.model.copy_blocks(src, dst)
            if specs[0].cached:
                self._restore_states([spec.state for spec in specs], slots)
            self._prefill_slots(seqs, specs, prompts.to(self.device), slots, result, want_logits)
        except BaseException:
            for slot in slot_ids:
                self.table.tables[slot] = self.paging.scratch
                self.table.slots.give_back(slot)
            raise
        self.table.add(seqs)

    def _prefill_slots(self, seqs: list[Sequence], specs: list[PrefillSpec], prompts: torch.Tensor,
                       slots: torch.Tensor, result: StepResult, want_logits: bool) -> None:
        raise NotImplementedError

    # --- saved states (the prefix cache) -------------------------------------------------------------

    def _allocate_boundaries(self, rows: int, saved: int, dtype: torch.dtype) -> int:
        """What a role keeps per slot and per saved state beside the model's recurrent states (bytes)."""
        return 0

    def _save_states(self, slots: torch.Tensor, states: list[int]) -> None:
        """Save the recurrent states of `slots` as saved states `states`."""
        rows = torch.tensor(states, device=self.device) + self.saved_rows
        self.model.copy_states(slots, rows)

    def _restore_states(self, states: list[int], slots: torch.Tensor) -> None:
        rows = torch.tensor(states, device=self.device) + self.saved_rows
        self.model.copy_states(rows, slots)

    @staticmethod
    def _saves_by_position(specs: list[PrefillSpec]) -> dict[int, list[int]]:
        """The saved states a prefill batch writes, by position (the same positions for every spec)."""
        return {save.position: [spec.saves[i].state for spec in specs] for i, save in enumerate(specs[0].saves)}

    @property
    def keeps_finished_state(self) -> bool:
        """Whether a finished sequence's state stays at its last committed token until its release."""
        return True

    @property
    def one_pass_tokens(self) -> int:
        """The most new tokens a prefill from a saved state runs as one pass with a state saved within it
        (LoadReply.one_pass_tokens): none here (Decoder's tail graphs)."""
        return 0

    def chunk_length(self, prompts: int) -> int:
        """Tokens per prompt in one prefill pass: the pass takes at most prefill_chunk tokens in all,
        in whole multiples of 64 (fla's chunk) per prompt, but never fewer than 64 each (so more than
        prefill_chunk / 64 prompts overrun it); a prefill_chunk below 64 is taken as it is. Prompts
        prefill alone in deterministic mode."""
        if self.prefill_chunk < 64:
            return self.prefill_chunk
        share = self.prefill_chunk // prompts
        return max(64, share - share % 64)

    def _chunks(self, prompts: torch.Tensor, slots: torch.Tensor, start: int = 0, stops: tuple[int, ...] = ()):
        """(ids [B, T], the prefill batch of them) for each chunk of the prompts [B, L] from position
        `start`; a chunk ends at each of `stops` (where a state is saved: Batch.kv_len tells)."""
        chunk = self.chunk_length(len(prompts))
        for stop in sorted({*stops, prompts.shape[1]}):
            while start < stop:
                end = min(start + chunk, stop)
                positions = torch.arange(start, end, device=self.device).expand(len(prompts), -1)
                yield prompts[:, start:end], Batch(slots, positions, end, tail=True)
                start = end

    # --- the stage's layers and its links -------------------------------------------------------

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

    def _receive(self, index: int, tokens: tuple[int, ...], kind: str = "pass", guess_row: int = -1
                 ) -> torch.Tensor | None:
        """The stage before's hidden states for pass `index` over `tokens` [B, T] (on the host);
        None on the first stage, which starts from the token ids. A stage before the last runs the
        same passes as the stage before it, so the next message must be of its `kind`; the last
        stage takes row `guess_row` of a lookahead when it is >= 0 (else the pass, or the redo after it)."""
        if self.model.stage.first:
            return None
        last = self.model.stage.last
        x, got = self.links.recv_hidden(self.steps, index, tuple(tokens), guess_row if last else None)
        if got != kind and not last:
            raise ProtocolError(ErrorCode.INTERNAL, f"stage link out of step: expected a {kind!r} message for "
                                f"pass {index} of step {self.steps}, got a {got!r} one")
        if x.dtype != self.cache_dtype:
            raise ProtocolError(ErrorCode.BAD_MESSAGE, f"hidden states in {x.dtype}; this stage runs "
                                f"{self.cache_dtype}")
        return x

    def _send(self, index: int, hidden: torch.Tensor, kind: str = "pass") -> None:
        """Pass `index`'s output to the next stage (the last stage has none)."""

    def _verify_pass(self, packed: torch.Tensor, context: int, x: torch.Tensor | None,
                     keep_logits: bool = False) -> tuple[torch.Tensor, torch.Tensor | None, dict, torch.Tensor | None]:
        """The stage's layers over [pending, d1..dk] of each row, from the ids or the stage before's
        hidden states x: (hidden [B, k+1, H], greedy tokens [B, k+1] (None before the last stage),
        what the speculative pass saved for the commit, and with `keep_logits` on the last stage the
        LM head's raw logits [B, k+1, V / tp] the greedy tokens came from (else None))."""
        batch = Batch(self.rows.slots(packed), self.rows.positions(packed), context, speculative=self.draft_len > 0)
        hidden = self.model(self.rows.ids(packed) if x is None else x, batch)
        if not self.model.stage.last:
            return hidden, None, batch.saved, None
        raw = self.model.lm_head.raw_logits(hidden)
        return hidden, self.model.lm_head.argmax_of(raw), batch.saved, raw if keep_logits else None

    def _follow_pass(self, packed: torch.Tensor, accepts: torch.Tensor, hidden: torch.Tensor, saved: dict,
                     context: int) -> torch.Tensor | None:
        raise NotImplementedError

    _fused_pass: Any = None

    def _context(self, seqs: list[Sequence], ahead: int = 0, chain: int | None = None) -> int:
        """Keys a verify pass from `ahead` positions past the sequences' lengths attends over: up to the
        last draft of the chain after it (k drafts, or `chain`)."""
        return max(s.length for s in seqs) + ahead + self.draft_len + 1 + (chain or self.draft_len)

    def _verify_rows(self, seqs: list[Sequence]) -> list[list[int]]:
        return [self.rows.row(s) for s in seqs]
