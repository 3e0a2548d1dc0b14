"""The last stage's prefill (decoder.Decoder's): the prompts through the model from their cached
position, saving states on the way; the first token of each sampled; its first drafts chained.

A lone prompt's short chunks (a cached turn's new tokens) replay CUDA graphs where the worker
captured them (tails.TailPasses: the chunk padded to a bucket, the MTP layer's entries in the same
graph, a second graph for the first drafts); a turn that fits a bucket is one replay, with the prefix
cache's save within it if it has one; every other chunk runs eagerly.
"""

from __future__ import annotations

import logging

import torch

from shardspec import kernels
from shardspec.layers.batch import Batch
from shardspec.layers.sampling import sample, unusable
from shardspec.protocol.messages import FAILED, PrefillSpec
from shardspec.shard_worker.logprobs import chunk_prompt_rows, token_rows
from shardspec.shard_worker.penalties import TokenCounts
from shardspec.shard_worker.results import StepResult
from shardspec.shard_worker.sequences import Sequence
from shardspec.shard_worker.tails import Saves, TailPasses

log = logging.getLogger("shardspec.worker")


class LastStagePrefill:
    """Decoder's prefill, on ModelRunner's chunks and Decoder's MTP layer (_mtp, _chain)."""

    tails: TailPasses | None

    def _prefill_slots(self, seqs: list[Sequence], specs: list[PrefillSpec], prompts: torch.Tensor,
                       slots: torch.Tensor, result: StepResult, want_logits: bool) -> None:
        """The prompts [B, L] through the model from their cached position, saving states on the way,
        the MTP layer's cache filled one position behind; the first tokens sampled and drafted from."""
        # a lone prompt's short chunks (a cached turn's new tokens) replay a graph where there is one
        tails = self.tails if (self.tails is not None and len(specs) == 1 and not want_logits
                               and specs[0].prompt_logprobs < 0) else None
        last = self._prefill_chunks(specs, prompts, slots, result, want_logits, tails)
        self._first_tokens(seqs, specs, prompts, self.model.lm_head.logits(last), result)
        if self.draft_len:
            self._keep_last_hidden(slots, last)
            length = prompts.shape[1]
            if tails is not None and seqs[0].grammar is None and seqs[0].bias is None:  # (as _drafting_under)
                drafts = tails.follow(seqs[0].next_token, last, slots, length).tolist()
            else:
                first = torch.tensor([[s.next_token] for s in seqs], device=self.device)
                with self._drafting_under(seqs):
                    drafts = self._first_drafts(first, last, slots, torch.full_like(slots, length), length).tolist()
            for seq, d in zip(seqs, drafts):
                seq.drafts = [] if seq.finished else d
        for seq in seqs:
            if seq.finished != FAILED:
                result.add(seq, [seq.next_token], -1)

    def _prefill_chunks(self, specs: list[PrefillSpec], prompts: torch.Tensor, slots: torch.Tensor,
                        result: StepResult, want_logits: bool, tails: TailPasses | None) -> torch.Tensor:
        """The prompts' chunks through the model (and the MTP layer), the states saved at their
        positions; the target's hidden state at each prompt's last token [B, H]."""
        start, saves = specs[0].cached, self._saves_by_position(specs)
        # the target's hidden state just before the current chunk (for MTP): at a cached position, saved with its state
        hidden_before = None
        if start and self.draft_len:
            hidden_before = self.saved_hidden[torch.tensor([spec.state for spec in specs], device=self.device)][:, None]

        def replayed(chunk_start: int, n: int) -> bool:  # (with MTP a piece needs the hidden state before it)
            ready = hidden_before is not None or not self.draft_len
            return tails is not None and ready and tails.fits(chunk_start, n)

        if len(saves) <= 1 and replayed(start, prompts.shape[1] - start):  # one replay, any save within it
            save = None
            for position, (state,) in saves.items():
                save = (position - start, self.saved_rows + state, state)
            return tails.prefill(prompts[:, start:], start, slots, hidden_before, save)
        for ids, batch in self._chunks(prompts, slots, start, tuple(saves)):
            chunk_start = batch.kv_len - ids.shape[1]
            if replayed(chunk_start, ids.shape[1]):
                last = tails.prefill(ids, chunk_start, slots, hidden_before)
            else:
                hidden = self._forward(ids, batch)
                if want_logits:
                    result.logits.append(self.model.lm_head.logits(hidden).reshape(-1, self.model.config.vocab_size))
                chunk_prompt_rows(self.model.lm_head.logits, specs, prompts, chunk_start, hidden, result.pending_rows)
                if self.draft_len:
                    self._draft_prefill(ids, hidden, hidden_before, slots, batch)
                last = hidden[:, -1]
            hidden_before = last[:, None] if self.draft_len else None
            if batch.kv_len in saves:
                self._keep_last_hidden(slots, last)
                self._save_states(slots, saves[batch.kv_len])
        return last

    def _first_tokens(self, seqs: list[Sequence], specs: list[PrefillSpec], prompts: torch.Tensor,
                      last_logits: torch.Tensor, result: StepResult) -> None:
        """Each sequence's first token, sampled from the logits at its prompt's last token [B, V] as its
        penalties, bias and grammar shape them (a preempted request's output so far counted); a row
        with none usable fails alone."""
        for b, (seq, spec, logits) in enumerate(zip(seqs, specs, last_logits)):
            output = prompts[b, prompts.shape[1] - spec.output :].tolist()
            if spec.sampling.penalised:
                seq.counts = TokenCounts(prompts[b, : prompts.shape[1] - spec.output], self.model.config.vocab_size)
                seq.counts.add(output)
            seq.grammar = self.new_grammars.pop(spec.seq, None)
            if seq.grammar is not None:
                seq.grammar.accept(output)  # (a preempted request's output so far)
            shaped = seq.constrain(seq.penalise(logits[None], []), [])
            if not unusable(shaped):
                if seq.grammar is not None:
                    self.counters.constrained(shaped)
                seq.next_token = sample(shaped[0], spec.sampling, seq.generator)
            if unusable(shaped) or (seq.grammar is not None and not seq.grammar.accept([seq.next_token])):
                seq.next_token, seq.finished = 0, FAILED  # (the token is a placeholder: nothing is emitted)
                result.add(seq, [], -1)
                continue
            seq.seen(seq.emit([seq.next_token]))
            if seq.logprobs >= 0:
                token = torch.tensor([seq.next_token])
                result.pending_rows.setdefault(seq.seq, []).append(token_rows(logits[None], token, seq.logprobs))

    def _first_drafts(self, first: torch.Tensor, last: torch.Tensor, slots: torch.Tensor, lengths: torch.Tensor,
                      kv_len: int | None) -> torch.Tensor:
        """After a prefill of lengths[b] tokens: the MTP layer pairs the first token sampled [B, 1] with
        the target's hidden state `last` [B, H] at the prompt's last token, then chains the k drafts:
        [B, k]. kv_len: the prompts' length (None: the widest, as in a graph)."""
        context = self.context if kv_len is None else kv_len
        heads = self._mtp(first, last[:, None], slots, (lengths - 1)[:, None], context)[:, 0]
        return self._chain(heads, slots, lengths, min(context + self.draft_len, self.context))

    def _tail_prefill(self, ids: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor, lengths: torch.Tensor,
                      hidden_before: torch.Tensor | None, kv_len: int, saves: Saves | None = None) -> torch.Tensor:
        """A prefill padded past each row's lengths[b] tokens (tails.TailPasses): the layers and, with MTP,
        the MTP layer one position behind; the hidden state at each row's last token [B, H]. `saves`: the
        recurrent states after row b's first save_at[b] tokens into their rows (Batch.state_saves) and,
        with MTP, the hidden state at its last of them into saved_hidden (as _save_states keeps it)."""
        # (not `tail`: a graph's kv_len is the widest)
        batch = Batch(slots, positions, kv_len, lengths=lengths, state_saves=None if saves is None else saves[:2])
        hidden = self.model(ids, batch)
        if self.draft_len:
            self._draft_prefill(ids, hidden, hidden_before, slots, batch)
            if saves is not None:
                self.saved_hidden[saves[2]] = self._hidden_at(hidden, saves[0])
        return self._hidden_at(hidden, lengths)

    @staticmethod
    def _hidden_at(hidden: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        """hidden [B, T, H] at row b's token tokens[b] - 1: [B, H]."""
        return hidden.gather(1, (tokens - 1)[:, None, None].expand(-1, 1, hidden.shape[-1]))[:, 0]

    def _capture_tails(self, scratch_slot: int) -> int:
        """A whole model's graphs of short prefills (tails.TailPasses), on a GPU with graphs and kernels
        (--no-tail-graphs: none), at TP 1 (the only width they have run at), outside deterministic mode
        (whose prefill goes token by token). A capture that fails leaves the prefills eager."""
        if not (self.graphed and kernels.active() and kernels.settings.tail_graphs and self.model.stage.first
                and self.model.tp.size == 1 and not self.deterministic):
            return 0
        tails = TailPasses(self._tail_prefill, self._first_drafts, self.device, self.model.config.hidden_size,
                           self.cache_dtype, self.draft_len, self.context, scratch_slot, graphs=True,
                           scratch_hidden=self.prefix_states)
        try:
            captured = tails.capture_all()
        except (torch.OutOfMemoryError, RuntimeError) as e:  # (Triton's out of resources is a RuntimeError)
            tails.close()
            log.warning("short prefills run eagerly: their CUDA graphs could not be captured (%s)", e)
            return 0
        self.tails = tails
        return captured
