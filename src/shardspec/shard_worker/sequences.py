"""The sequence table of one rank: cache slots, the live sequences, and the rows a step's passes take.

Every rank holds the same table and receives the same commands, so every check here has the same
outcome on every rank and the collectives inside the model always line up.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from shardspec.layers.grammar import Constraint, masked
from shardspec.layers.sampling import forced_accepts
from shardspec.protocol.errors import ErrorCode, ProtocolError
from shardspec.protocol.messages import PrefillSpec, SamplingParams, SaveFinished, StepRequest
from shardspec.shard_worker.penalties import TokenCounts


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
    finished: str = ""  # "", "stop", "length" or protocol.messages.FAILED (its numbers went bad: it fails alone)
    logprobs: int = -1  # top log-probabilities per emitted token in the replies; -1: none
    counts: TokenCounts | None = None  # with penalties: the tokens seen so far
    # lookahead: the last stage's guess of the tokens of the step after the next ([pending, d1..dk] if the
    # next keeps all its drafts), its chain after the record; [] when it made none
    guess: list[int] = field(default_factory=list)
    guess_step: int = -1  # a stage before the last: the step whose guesses (still on the link) hold its guess
    # the last stage: the row of the stages' pass on a guess (one, or a tree's branches) that its last step
    # proved, which its next step takes; -1: none
    guess_row: int = -1
    draws: torch.Generator | None = None  # on the host: benchmark-only forced acceptance (drawn with no device sync)
    blocks: int = 0  # K/V blocks in its block table (granted by the orchestrator)
    grammar: Constraint | None = None  # structured output: its grammar, at its emitted tokens (the last stage)
    bias: torch.Tensor | None = None  # logit_bias: [V], added to the target's and the drafts' logits
    early: int = 0  # tokens it must still emit before a stop id may end it (min_tokens)

    def penalise(self, logits: torch.Tensor, drafts: list[int]) -> torch.Tensor:
        """logits [P, V] as this sequence samples from them (penalised, row j after drafts[:j])."""
        return logits if self.counts is None else self.counts.penalise(logits, drafts, self.sampling)

    @property
    def shaped(self) -> bool:
        """Its request shapes the logits it samples from (constrain), so its steps decide on the host."""
        return self.grammar is not None or self.bias is not None or self.early > 0

    def constrain(self, logits: torch.Tensor, drafts: list[int], masks: torch.Tensor | None = None) -> torch.Tensor:
        """logits [P, V] as its request shapes them, row j after drafts[:j]: its logit_bias added, its
        stop ids barred while it is short of min_tokens, limited to what its grammar allows (`masks`:
        its grammar's rows computed before, Constraint.masks)."""
        if self.bias is not None:
            logits = logits.float() + self.bias
        if self.early > 0 and self.stop_ids:
            barred = torch.zeros_like(logits, dtype=torch.bool)
            barred[: self.early, list(self.stop_ids)] = True
            logits = logits.float().masked_fill(barred, float("-inf"))
        return logits if self.grammar is None else masked(logits, self.grammar, drafts, masks)

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
        self.early = max(0, self.early - len(tokens))
        if not self.finished and self.remaining == 0:
            self.finished = "length"
        return tokens

    def cap(self) -> int:
        """The most drafts its next step may keep: none past a stop token among them or past its token
        budget, so that its caches hold only tokens it emits (a greedy step's tokens are the same)."""
        stop = next((i for i, d in enumerate(self.drafts) if d in self.stop_ids), len(self.drafts))
        return max(0, min(stop, self.remaining - 1))

    def forced(self, rate: float | None) -> int:
        """Benchmark mode: the drafts this sequence keeps, drawn before the pass; -1 otherwise."""
        return -1 if rate is None else forced_accepts(len(self.drafts), rate, self.draws)


@dataclass(frozen=True)
class Rows:
    """The columns of the int64 rows a verify pass takes, one row per sequence:

        [pending, d1..dk | length | slot | forced | cap | guess g0..gk]

    forced: the drafts to keep (benchmark mode), -1 to let the model decide; cap: the most drafts it
    may keep (Sequence.cap); guess (only with lookahead, eager passes of the last stage): the tokens
    the stages before verify next, -1s for none (lookahead "tree": the branches, branches.flatten)."""

    draft_len: int

    @property
    def width(self) -> int:
        """Columns of a row without a guess."""
        return self.draft_len + 5

    def row(self, s: Sequence, forced: int = -1) -> list[int]:
        return [s.next_token, *s.drafts, s.length, s.slot, forced, s.cap()]

    def with_guess(self, row: list[int], s: Sequence) -> list[int]:
        return [*row, *(s.guess or [-1] * (self.draft_len + 1))]

    def padding(self, scratch_slot: int) -> list[int]:
        """A row that touches only the scratch slot (graphed batches pad with it)."""
        return [0] * (self.draft_len + 2) + [scratch_slot, -1, 0]

    def ids(self, rows: torch.Tensor) -> torch.Tensor:
        return rows[:, : self.draft_len + 1]

    def lengths(self, rows: torch.Tensor) -> torch.Tensor:
        return rows[:, self.draft_len + 1]

    def positions(self, rows: torch.Tensor) -> torch.Tensor:
        """[B, k + 1]: the positions of each row's pending token and drafts."""
        return self.lengths(rows)[:, None] + torch.arange(self.draft_len + 1, device=rows.device)

    def slots(self, rows: torch.Tensor) -> torch.Tensor:
        return rows[:, self.draft_len + 2].contiguous()  # (the kernels index slots[b]: a contiguous copy)

    def forced(self, rows: torch.Tensor) -> torch.Tensor:
        return rows[:, self.draft_len + 3]

    def cap(self, rows: torch.Tensor) -> torch.Tensor:
        return rows[:, self.draft_len + 4]

    def guess(self, rows: torch.Tensor) -> torch.Tensor | None:
        return rows[:, self.width :] if rows.shape[1] > self.width else None

    def following(self, rows: torch.Tensor, out: torch.Tensor, forced: torch.Tensor | None) -> torch.Tensor:
        """The rows of the step after a greedy pass over `rows` with result `out` [B, 2 + k] =
        (accepted, token, drafts): [token, drafts, length + accepted + 1, slot, forced, k] (`forced`
        [B, 1]; None: as before; no cap: the host has not seen the drafts)."""
        k = self.draft_len
        length = self.lengths(rows) + out[:, 0] + 1
        slot = rows[:, k + 2 : k + 3]
        forced = rows[:, k + 3 : k + 4] if forced is None else forced
        return torch.cat([out[:, 1:], length[:, None], slot, forced, torch.full_like(slot, k), rows[:, k + 5 :]], 1)


class SlotAllocator:
    def __init__(self, num_slots: int):
        self.total = num_slots
        self.free = list(range(num_slots - 1, -1, -1))

    def take(self) -> int:
        return self.free.pop()

    def give_back(self, slot: int) -> None:
        self.free.append(slot)


@dataclass(frozen=True)
class Paging:
    """How a rank's K/V pool is shared out: `kv_blocks` blocks of `block_tokens` positions (one more,
    the scratch block, for padding rows and unused table entries), at most `max_blocks` a sequence,
    whose blocks must cover its length plus `span` positions (what one step may write), up to `context`."""

    kv_blocks: int
    block_tokens: int
    max_blocks: int
    span: int
    context: int

    @property
    def scratch(self) -> int:
        return self.kv_blocks

    def needed(self, length: int) -> int:
        """Blocks a sequence of `length` positions must hold before a step runs it."""
        return -(-min(length + self.span, self.context) // self.block_tokens)


class SequenceTable:
    """The live sequences by id, the cache slots they hold, and their block tables (`tables`: a row
    per slot, on the device; the layers read it, CacheShape)."""

    def __init__(self, max_seqs: int, max_seq_len: int, vocab_size: int, device: torch.device,
                 forced_acceptance: float | None, paging: Paging, prefix_states: int = 0, spare: int = 0):
        self.slots = SlotAllocator(max_seqs)
        self.sequences: dict[int, Sequence] = {}
        self.max_seq_len = max_seq_len
        self.vocab_size = vocab_size
        self.device = device
        self.forced = forced_acceptance
        self.paging = paging
        self.prefix_states = prefix_states  # saved states of the prefix cache (ids 0 .. prefix_states - 1)
        # one row more: the scratch slot of padding rows; `spare` more: branch slots (branches.BranchSlots)
        self.tables = torch.full((max_seqs + 1 + spare, paging.max_blocks), paging.scratch, dtype=torch.int32,
                                 device=device)

    def __getitem__(self, seq: int) -> Sequence:
        return self.sequences[seq]

    def running(self, request: StepRequest) -> list[Sequence]:
        """The step's decoding sequences that have not finished."""
        return [s for s in (self.sequences[seq] for seq in request.decode) if not s.finished]

    def live(self) -> int:
        return sum(not s.finished for s in self.sequences.values())

    def check(self, request: StepRequest, prompt_ids: torch.Tensor) -> list[torch.Tensor]:
        """The step's prompts, one tensor each, once the request is one this table can take."""
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
        vocab = self.vocab_size
        if prompt_ids.numel() and (int(prompt_ids.min()) < 0 or int(prompt_ids.max()) >= vocab):
            raise ProtocolError(ErrorCode.BAD_REQUEST, f"prompt token ids must lie in [0, {vocab})")
        if any(b.token >= vocab for spec in request.prefill for b in spec.logit_bias):
            raise ProtocolError(ErrorCode.BAD_REQUEST, f"logit_bias token ids must lie in [0, {vocab})")
        too_long = [s.seq for s in request.prefill if s.length >= self.max_seq_len]
        if too_long:
            raise ProtocolError(ErrorCode.CAPACITY, f"prompts of {too_long} do not fit max_seq_len {self.max_seq_len}")
        self._check_blocks(request)
        for spec in request.prefill:
            self._check_cached(spec)
        return list(prompt_ids.long().split(lengths)) if lengths else []

    def _check_blocks(self, request: StepRequest) -> None:
        """Block ids in the pool, no table past max_blocks, and every sequence the step runs covered
        for what it may write."""
        paging, held = self.paging, {seq: self.sequences[seq].blocks for seq in request.decode}
        grants = [(spec.seq, spec.blocks) for spec in request.prefill] + [(g.seq, g.blocks) for g in request.grow]
        for seq, blocks in grants:
            if seq not in held and seq not in {spec.seq for spec in request.prefill}:
                raise ProtocolError(ErrorCode.BAD_REQUEST, f"blocks granted to sequence {seq}, which the step does "
                                    "not run")
            if any(not 0 <= b < paging.kv_blocks for b in blocks):
                raise ProtocolError(ErrorCode.BAD_REQUEST, f"block ids must lie in [0, {paging.kv_blocks})")
            held[seq] = held.get(seq, 0) + len(blocks)
            if held[seq] > paging.max_blocks:
                raise ProtocolError(ErrorCode.BAD_REQUEST, f"sequence {seq} would hold {held[seq]} blocks; at most "
                                    f"{paging.max_blocks}")
        lengths = {spec.seq: spec.length for spec in request.prefill}
        lengths |= {seq: self.sequences[seq].length for seq in request.decode if not self.sequences[seq].finished}
        short = [seq for seq, length in lengths.items() if held.get(seq, 0) < paging.needed(length)]
        if short:
            raise ProtocolError(ErrorCode.CAPACITY, f"sequences {short[:8]} hold too few K/V blocks for this step "
                                f"({paging.block_tokens} positions a block, {paging.span} past the length)")

    def _check_cached(self, spec: PrefillSpec) -> None:
        """A prefill's use of the prefix cache: a saved state to start from at a cached position inside
        the prompt, a boundary block to copy, states to save at block boundaries past it."""
        where, states = f"sequence {spec.seq}", self.prefix_states
        if spec.cached >= spec.length:
            raise ProtocolError(ErrorCode.BAD_REQUEST, f"{where}: {spec.cached} cached positions of a "
                                f"{spec.length}-token prompt; at least its last token must prefill")
        if (spec.cached > 0) != (spec.state >= 0) or spec.state >= states:
            raise ProtocolError(ErrorCode.BAD_REQUEST, f"{where}: cached positions need a saved state in "
                                f"[0, {states}) to start from, and a saved state needs cached positions")
        if spec.copy_from >= 0 and (spec.cached == 0 or spec.copy_from >= self.paging.kv_blocks):
            raise ProtocolError(ErrorCode.BAD_REQUEST, f"{where}: copy_from needs cached positions and a block "
                                f"id in [0, {self.paging.kv_blocks})")
        if spec.cached and spec.prompt_logprobs >= 0:
            raise ProtocolError(ErrorCode.BAD_REQUEST, f"{where}: prompt log-probabilities need the whole "
                                "prompt prefilled (cached = 0)")
        if spec.output >= spec.length:
            raise ProtocolError(ErrorCode.BAD_REQUEST, f"{where}: {spec.output} output tokens of a {spec.length}-token "
                                "prefill; its prompt must have one at least")
        positions = [save.position for save in spec.saves]
        if (positions != sorted(set(positions)) or any(not spec.cached < p <= spec.length for p in positions)
                or any(save.state >= states for save in spec.saves)):
            raise ProtocolError(ErrorCode.BAD_REQUEST, f"{where}: states are saved at increasing positions in "
                                f"({spec.cached}, {spec.length}], as saved states in [0, {states})")

    def check_saves(self, seqs: list[int], saves: list[SaveFinished]) -> None:
        """A release's saves: of live sequences it releases, as saved states in [0, prefix_states)."""
        states = self.prefix_states
        for save in saves:
            if save.seq not in seqs or save.seq not in self.sequences or save.state >= states:
                raise ProtocolError(ErrorCode.BAD_REQUEST, f"a release saves the state of sequence {save.seq} as "
                                    f"{save.state}: the sequence must be live and released, the state in [0, {states})")

    def grant(self, seq: Sequence, blocks: list[int]) -> None:
        """Append blocks to a sequence's table (checked by `check`)."""
        if blocks:
            self.tables[seq.slot, seq.blocks : seq.blocks + len(blocks)] = torch.tensor(blocks, dtype=torch.int32)
            seq.blocks += len(blocks)

    def new(self, spec: PrefillSpec, slot: int, length: int) -> Sequence:
        """A sequence for a prompt of `length` tokens prefilled into `slot` (not yet in the table)."""
        generator = draws = None
        if not spec.sampling.greedy:
            generator = torch.Generator(self.device).manual_seed(spec.sampling.seed)
        if self.forced is not None:
            draws = torch.Generator().manual_seed(spec.sampling.seed)
        budget = min(spec.max_tokens, self.max_seq_len - length)
        bias = None
        if spec.logit_bias:
            bias = torch.zeros(self.vocab_size, dtype=torch.float32, device=self.device)
            bias[torch.tensor([b.token for b in spec.logit_bias], device=self.device)] = torch.tensor(
                [b.bias for b in spec.logit_bias], device=self.device)
        return Sequence(spec.seq, slot, length, -1, spec.sampling, generator, budget, frozenset(spec.stop_ids),
                        logprobs=spec.logprobs, draws=draws, bias=bias, early=spec.min_tokens)

    def add(self, seqs: list[Sequence]) -> None:
        for s in seqs:
            self.sequences[s.seq] = s

    def release(self, seqs: list[int]) -> list[int]:
        """Free the slots of those of `seqs` that are live; returns them."""
        released = [s for s in dict.fromkeys(seqs) if s in self.sequences]
        for seq in released:
            slot = self.sequences.pop(seq).slot
            self.tables[slot] = self.paging.scratch
            self.slots.give_back(slot)
        return released

    def clear(self) -> None:
        self.sequences.clear()
        self.tables.fill_(self.paging.scratch)
