"""The model runner of one rank: cache slots, live sequences, and the forward passes of a step.

Every rank holds the same sequence table and receives the same commands, so every check here has
the same outcome on every rank and the collectives inside the model always line up.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from shardspec.layers.batch import Batch
from shardspec.layers.sampling import sample
from shardspec.models.qwen3_5 import Qwen3_5Model
from shardspec.protocol.errors import ErrorCode, ProtocolError
from shardspec.protocol.messages import PrefillSpec, SamplingParams, StepRequest


@dataclass
class Sequence:
    seq: int
    slot: int
    length: int  # tokens whose state is in the cache
    next_token: int  # sampled but not yet fed through the model
    sampling: SamplingParams
    generator: torch.Generator | None


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
    seqs: list[int]
    tokens: list[list[int]]
    logits: torch.Tensor | None  # [tokens processed this step, vocab] when asked for


class ModelRunner:
    def __init__(self, model: Qwen3_5Model, device: torch.device, max_slots: int, max_seq_len: int, prefill_chunk: int):
        self.model = model
        self.device = device
        self.max_seq_len = max_seq_len
        self.prefill_chunk = prefill_chunk
        self.slots = SlotAllocator(max_slots)
        self.sequences: dict[int, Sequence] = {}
        dtype = next(model.parameters()).dtype
        self.cache_bytes = model.allocate_caches(max_slots, max_seq_len, dtype, device)

    @torch.inference_mode()
    def step(self, request: StepRequest, prompt_ids: torch.Tensor) -> StepResult:
        prompts = self._check(request, prompt_ids)
        seqs, tokens, logits = [], [], []
        for spec, prompt in zip(request.prefill, prompts):
            token, step_logits = self._prefill(spec, prompt, request.return_logits)
            seqs.append(spec.seq)
            tokens.append([token])
            logits.append(step_logits)
        if request.decode:
            decoded, step_logits = self._decode(request.decode, request.return_logits)
            seqs += request.decode
            tokens += [[t] for t in decoded]
            logits.append(step_logits)
        return StepResult(seqs, tokens, torch.cat(logits).cpu() if request.return_logits else None)

    def release(self, seqs: list[int]) -> list[int]:
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
            if self.sequences[seq].length + 1 > self.max_seq_len:
                raise ProtocolError(ErrorCode.CAPACITY, f"sequence {seq} reached max_seq_len {self.max_seq_len}")
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
        too_long = [spec.seq for spec in request.prefill if spec.length >= self.max_seq_len]
        if too_long:
            raise ProtocolError(ErrorCode.CAPACITY, f"prompts of {too_long} do not fit max_seq_len {self.max_seq_len}")
        return list(prompt_ids.long().split(lengths)) if lengths else []

    def _prefill(self, spec: PrefillSpec, prompt: torch.Tensor, want_logits: bool) -> tuple[int, torch.Tensor | None]:
        slot = self.slots.take()
        slots = torch.tensor([slot], device=self.device)
        self.model.reset_slots(slots)
        prompt = prompt.to(self.device)
        chunk_logits = []
        for start in range(0, len(prompt), self.prefill_chunk):
            ids = prompt[start : start + self.prefill_chunk]
            positions = torch.arange(start, start + len(ids), device=self.device)[None]
            hidden = self.model(ids[None], Batch(slots, positions, start + len(ids)))
            if want_logits:
                chunk_logits.append(self.model.lm_head.logits(hidden[0]))
        last = self.model.lm_head.logits(hidden[0, -1:])[0]
        generator = None
        if not spec.sampling.greedy:
            generator = torch.Generator(self.device).manual_seed(spec.sampling.seed)
        token = sample(last, spec.sampling, generator)
        self.sequences[spec.seq] = Sequence(spec.seq, slot, len(prompt), token, spec.sampling, generator)
        return token, torch.cat(chunk_logits) if want_logits else None

    def _decode(self, seq_ids: list[int], want_logits: bool) -> tuple[list[int], torch.Tensor | None]:
        seqs = [self.sequences[s] for s in seq_ids]
        ids = torch.tensor([[s.next_token] for s in seqs], device=self.device)
        positions = torch.tensor([[s.length] for s in seqs], device=self.device)
        slots = torch.tensor([s.slot for s in seqs], device=self.device)
        hidden = self.model(ids, Batch(slots, positions, max(s.length for s in seqs) + 1))[:, 0]
        if not want_logits and all(s.sampling.greedy for s in seqs):
            tokens = self.model.lm_head.argmax(hidden).tolist()
            logits = None
        else:
            logits = self.model.lm_head.logits(hidden)
            tokens = [sample(row, s.sampling, s.generator) for row, s in zip(logits, seqs)]
        for s, token in zip(seqs, tokens):
            s.length += 1
            s.next_token = token
        return tokens, logits
