"""The last stage's role (a single stage's too): prefill (prefill.LastStagePrefill), verify, accept,
draft; the replies.

One step verifies each sequence's k drafts with the target model, accepts a prefix (greedy: while a
draft equals the target's argmax; sampled: rejection sampling), commits it (the recurrent layers
replay the accepted tokens), re-runs the MTP layer over the accepted positions with the target's
true hidden states, and chains the MTP head k times to draft again. Nothing but token ids leaves
the worker. With pipeline stages the step's result also goes to the earlier stages as an
acceptance record (links.StageLinks.send_record).

Launch ahead (ahead.LaunchAhead): a single stage queues the next step's pass on the device behind the
current one, its rows built from the current pass's outputs, and reads this step's while it runs.

Lookahead (pipeline stages, eager passes): while one sequence decodes alone, the last stage sends
a guess of its next step once the step's record has left (guessing.Guessing), on which the stages
before run that step's pass before this step's record reaches them (stage.ForwardingStage).
"""

from __future__ import annotations

import contextlib
from pathlib import Path

import torch

from shardspec.layers.batch import Batch
from shardspec.layers.grammar import Constraint, apply_masks, masked_each
from shardspec.layers.sampling import accept_greedy, accept_sampled, resample, target_probs, unusable
from shardspec.protocol.messages import FAILED, LoadRequest, StepRequest, WorkerOptions
from shardspec.shard_worker import branches, constrained
from shardspec.shard_worker.ahead import LaunchAhead, Launched, NoLaunchAhead, Peek
from shardspec.shard_worker.grammars import GrammarStore
from shardspec.shard_worker.graphs import HostRows
from shardspec.shard_worker.guessing import Guessing
from shardspec.shard_worker.logprobs import token_rows
from shardspec.shard_worker.prefill import LastStagePrefill
from shardspec.shard_worker.results import RunnerStats, StepResult
from shardspec.shard_worker.runner import ModelRunner
from shardspec.shard_worker.sequences import Sequence
from shardspec.shard_worker.tails import TailPasses


class Decoder(LastStagePrefill, ModelRunner):
    """The last stage: samples, accepts and drafts, replies, and sends the earlier stages the step's
    record. `launch_ahead` ("auto": on a GPU; "on"; "off") takes effect on a single stage given `peek`."""

    def __init__(self, *args, launch_ahead: str = WorkerOptions.launch_ahead, peek: Peek | None = None,
                 tokenizer_file: Path | None = None, grammar_budget_s: float = LoadRequest.grammar_budget_s,
                 **kwargs):
        # before the runner's set-up: it captures the passes (which draft through _chain) on a GPU,
        # and close() drops `ahead` and `grammars` if that fails
        self.chain_rows: list[Sequence] = []  # while drafting with some rows shaped: the sequence of each row
        self.new_grammars: dict[int, Constraint] = {}  # a step's new sequences' grammars, until they prefill
        self.ahead: LaunchAhead | NoLaunchAhead = NoLaunchAhead()
        self.grammars: GrammarStore | None = None
        self.grammar_budget_s = grammar_budget_s  # the most a sequence's masks may take in one step
        self.tails: TailPasses | None = None  # short prefills from graphs (captured with the passes)
        super().__init__(*args, **kwargs)
        config = self.model.config
        self.grammars = GrammarStore(tokenizer_file, config.vocab_size, list(config.eos_token_ids))
        whole = self.model.stage.first
        wanted = launch_ahead == "on" or (launch_ahead == "auto" and self.graphed)
        self.ahead = LaunchAhead(peek) if whole and wanted and peek is not None else NoLaunchAhead()
        self.guessing = Guessing(self.draft_len, self.always_guess, self.branching, self.tree_width)
        self.chain_end: tuple | None = None  # with lookahead: where the last chain stopped (Guessing.guess)
        self.chain_heads: list[torch.Tensor] = []  # with lookahead: the last chain's MTP heads, one per draft

    def release(self, seqs: list[int], saves=()) -> list[int]:
        self.ahead.drop()  # (a release comes between steps: never before the step a pass was launched for)
        return super().release(seqs, saves)

    def close(self) -> None:
        self.ahead.drop()
        if self.grammars is not None:
            self.grammars.close()
        if self.tails is not None:
            self.tails.close()
        super().close()

    # --- structured output ----------------------------------------------------------------------

    @contextlib.contextmanager
    def _drafting_under(self, seqs: list[Sequence]):
        """The MTP chain (_chain) drafts each row from its sequence's biased and masked logits while this
        lasts (an error included)."""
        self.chain_rows = seqs if any(s.grammar is not None or s.bias is not None for s in seqs) else []
        try:
            yield
        finally:
            self.chain_rows = []

    def _new_grammars(self, request: StepRequest) -> dict[int, Constraint]:
        """The grammar of each new sequence that names one (PrefillSpec.grammar), built before
        (GrammarRequest): a copy of its matcher."""
        return {spec.seq: self.grammars.constraint(spec.grammar) for spec in request.prefill if spec.grammar}

    def stats(self) -> RunnerStats:
        stats = super().stats()
        stats.launched_ahead = self.ahead.count
        return stats

    @torch.inference_mode()
    def step(self, request: StepRequest, prompt_ids: torch.Tensor) -> StepResult:
        launched = self.ahead.take(request)  # (first: a step that fails does not leave it to the next)
        grammars = self._new_grammars(request)  # (a grammar not built here refuses the step before it runs)
        prompts = self._begin(request, prompt_ids)
        self.new_grammars = grammars
        result = StepResult()
        self._prefill_all(request, prompts, result)
        running = self.table.running(request)
        decided = bool(running) and self._verify(running, result, request.return_logits, launched)
        constrained.fail_over_budget(self.sequences, result, self.grammar_budget_s, self.model.lm_head.tp,
                                     self.counters, self.device)
        if decided and self._decides(running):  # (a step the host will decide again: its verify, now)
            self.ahead.verify_next(self, running)
        if self.links is not None and result.seqs:  # a step of finished sequences only has no record
            due = self.guessing.take_due()
            self.links.send_record(self.steps, result.reply(), guessed=due is not None)
            if due is not None:
                due.guess = self.guessing.guess(self, due)
                self.links.send_guesses(self.steps, {due.seq: due.guess})
        return result

    # --- saved states: with MTP, the target's hidden state before the saved position beside each ------

    def _allocate_boundaries(self, rows: int, saved: int, dtype: torch.dtype) -> int:
        """With MTP: each slot's last committed hidden state and each saved state's, which the MTP layer
        pairs with the token after a cached position."""
        hidden = self.model.config.hidden_size if self.draft_len else 0
        self.last_hidden = torch.zeros(rows, hidden, dtype=dtype, device=self.device)
        self.saved_hidden = torch.zeros(saved + 1, hidden, dtype=dtype, device=self.device)  # (+ tails' scratch row)
        return self.last_hidden.nbytes + self.saved_hidden.nbytes

    def _keep_last_hidden(self, slots: torch.Tensor, hidden: torch.Tensor) -> None:
        if self.draft_len:
            self.last_hidden[slots] = hidden

    def _save_states(self, slots: torch.Tensor, states: list[int]) -> None:
        super()._save_states(slots, states)
        if self.draft_len:
            self.saved_hidden[torch.tensor(states, device=self.device)] = self.last_hidden[slots]

    @property
    def one_pass_tokens(self) -> int:
        return max(self.tails.tails, default=0) if self.tails is not None else 0

    @property
    def keeps_finished_state(self) -> bool:
        """Not where a pass launched ahead may run on past a sequence that finished (LaunchAhead)."""
        return isinstance(self.ahead, NoLaunchAhead)

    # --- verify, accept, draft ------------------------------------------------------------------

    def _verify(self, seqs: list[Sequence], result: StepResult, want_logits: bool, launched: Launched | None) -> bool:
        """The step of the running sequences; whether the host decided it (a verify pass, then the
        host's acceptance: LaunchAhead.verify_next may then launch the next step's verify)."""
        k = self.draft_len
        # lookahead: after the record, the chain of the one live sequence goes on for the guess of the step
        # after the next, for the stages before to run that step's pass on before this step's record
        # reaches them (with more live sequences, even in micro-batches of one, they have other work)
        ahead = self.lookahead and self.table.live() == 1  # (seqs: that one)
        guessing = ahead and self.guessing.now()
        # the rows carry the guess made before when it may hold: the chain must then keep the guessed drafts
        with_guess = ahead and bool(seqs[0].guess)
        x = self._receive(self._next_pass(), (len(seqs), k + 1), guess_row=seqs[0].guess_row if ahead else -1)
        context = self._context(seqs, chain=self.chain if ahead else k)
        wants_logprobs = any(s.logprobs >= 0 for s in seqs)
        plain = self._plain(seqs)
        biased = any(s.bias is not None for s in seqs)  # (its drafts: from its biased logits, on the host)
        # a pass launched ahead for this step sets its route (the step must take it: it has run; a masked
        # pass stays masked when its rows under a grammar have finished since)
        decided = want_logits or self._decides(seqs) if launched is None else launched.verify is not None
        if not decided and (plain if launched is None else not launched.masked):
            # greedy (or forced) acceptance needs no host decision: the whole step is one pass
            out = self._greedy(seqs, context, x, with_guess, launched)
            accepted, tokens, drafts = [r[0] for r in out], [r[1] for r in out], [r[2:] for r in out]
        elif not decided:
            accepted, tokens = [0] * len(seqs), self._masked_greedy(seqs, context, x, launched)
        else:
            if launched is not None:
                if launched.seqs != [s.seq for s in seqs]:
                    raise RuntimeError("a verify pass launched ahead came to a step of other rows")
                hidden, argmax, draft, raw = launched.verify
            else:
                hidden, argmax, draft, raw = self.launch_verify(seqs, context, x, with_guess)
            masks = constrained.grammar_masks(seqs, k + 1)  # (on the host, while the device runs the pass)
            accepted, tokens, logits = self._accept(seqs, hidden, argmax, result if want_logits else None,
                                                    wants_logprobs or not plain, masks, raw)
            for s, n, token in zip(seqs, accepted, tokens):  # (the drafts after them are masked from there)
                if s.grammar is not None and s.finished != FAILED and not s.grammar.accept([*s.drafts[:n], token]):
                    s.finished = FAILED
            if k:
                with self._drafting_under(seqs if biased else []):
                    drafts = draft(constrained.follow_rows(seqs, accepted, tokens, k)).tolist()
        if k:
            self.counters.count(accepted, k)
        emitted = []
        for s, n, token in zip(seqs, accepted, tokens):
            emitted.append([] if s.finished == FAILED else s.emit([*s.drafts[:n], token]))
            s.seen(emitted[-1])
            s.length += n + 1
            s.next_token = token
            s.drafts = []
        if k:
            if ahead:  # (one sequence) whether the stages' pass on its guess holds; whether to guess on
                self.guessing.after(self, seqs[0], accepted[0], tokens[0], drafts[0][:k], guessing)
            for s, d in zip(seqs, drafts):
                s.guess_row = s.guess_row if ahead else -1
                s.drafts, s.guess = [] if s.finished else d[:k], []
        for i, (s, n, new) in enumerate(zip(seqs, accepted, emitted)):
            if s.logprobs >= 0 and new:  # token j of [d1..dn, bonus] was drawn from the target's logits at position j
                result.pending_rows[s.seq] = [token_rows(logits[i, : len(new)], torch.tensor(new), s.logprobs)]
            result.add(s, new, n if k else -1)
        return decided

    def launch_verify(self, seqs: list[Sequence], context: int | None = None, x: torch.Tensor | None = None,
                      with_guess: bool = False) -> tuple:
        """The verify pass over the sequences' rows (this step's, or the next step's launched ahead:
        LaunchAhead.verify_next): (hidden, argmax, its follow, its raw logits). A biased row drafts on
        the host (its follow runs eagerly)."""
        biased = any(s.bias is not None for s in seqs)
        hidden, argmax, draft = self.passes.verify(self._rows(seqs, with_guess), context or self._context(seqs), x,
                                                   eager_follow=biased)
        return hidden, argmax, draft, self.passes.logits

    def _rows(self, seqs: list[Sequence], with_guess: bool, forced: bool = False) -> list[list[int]]:
        """The verify rows (sequences.Rows), with each row's forced count when `forced` and its guess
        when `with_guess` (the chain then runs 2k + 1 drafts: _draft_pass)."""
        rows = [self.rows.row(s, s.forced(self.forced) if forced else -1) for s in seqs]
        return [self.rows.with_guess(row, s) for row, s in zip(rows, seqs)] if with_guess else rows

    def _greedy(self, seqs: list[Sequence], context: int, x: torch.Tensor | None, with_guess: bool,
                launched: Launched | None) -> list[list[int]]:
        """The greedy pass's [accepted, token, *drafts] of each sequence: the pass launched ahead for
        this step if there is one, else this step's; before reading it, the next step's launched ahead
        where the next request comes while this pass runs and continues this step."""
        if launched is None:
            rows = self._rows(seqs, with_guess, forced=True)
            launched = Launched([s.seq for s in seqs], HostRows.copy(self.passes.greedy(rows, context, x)))
        # the orchestrator sends the next step once it has read the reply before this one: while this
        # pass runs, as a rule
        self.ahead.follow(self, launched)
        out = launched.out.rows()
        row = {seq: i for i, seq in enumerate(launched.seqs)}
        return [out[row[s.seq]] for s in seqs]

    @staticmethod
    def _plain(seqs: list[Sequence]) -> bool:
        """Every row greedy, unpenalised and unshaped: the step is one fused pass (_greedy)."""
        return all(s.sampling.greedy and not s.sampling.penalised and not s.shaped for s in seqs)

    def _decides(self, seqs: list[Sequence]) -> bool:
        """Whether the host decides a step of these sequences (a verify pass, then the host's acceptance:
        sampled, penalised, shaped, log-probabilities), not one greedy pass (_greedy, _masked_greedy)."""
        return any(s.logprobs >= 0 for s in seqs) or not (self._plain(seqs) or self._masks_alone(seqs))

    def _masks_alone(self, seqs: list[Sequence]) -> bool:
        """Whether a step's tokens are the argmax of its logits under its grammars' masks alone (k = 0,
        every row greedy, no penalties, bias or min_tokens): _masked_greedy decides it on the device."""
        return (not self.draft_len and self.passes.keeps_logits(len(seqs))
                and all(s.sampling.greedy and not s.sampling.penalised and s.bias is None and s.early <= 0
                        for s in seqs))

    def _masked_greedy(self, seqs: list[Sequence], context: int, x: torch.Tensor | None,
                       launched: Launched | None) -> list[int]:
        """Each sequence's token (k = 0): the argmax of the greedy pass's logits under its grammar's mask,
        chosen on the device. The pass is the one launched ahead for this step, or this step's; its
        masks are computed on the host while it runs. Before the tokens are read, the next step's pass
        is launched ahead on them (LaunchAhead), so that this host work, the reply and the next step's
        masks run beside the device's next pass. A sequence whose grammar fails fails alone."""
        if launched is None:
            self.passes.greedy(self._rows(seqs, False), context, x, keep_logits=True)
            order = [s.seq for s in seqs]
        elif not launched.masked:
            raise RuntimeError("a pass launched ahead without masks came to a step under a grammar")
        else:
            order = launched.seqs
        raw = self.passes.logits  # [B, 1, V / tp]: the pass's, until the next one (the next launched below)
        live = {s.seq: s for s in seqs}
        words = constrained.mask_words([live.get(seq) for seq in order], self.model.config.vocab_size, self.counters)
        for s in seqs:
            if s.grammar is not None and s.grammar.failure:
                s.finished = FAILED
        logits = apply_masks(self.model.lm_head.logits_of(raw)[:, 0], self.passes.device_words(words))
        out = torch.stack([torch.zeros_like(raw[:, 0, 0], dtype=torch.long), logits.argmax(-1)], 1)
        self.passes.settle(out)
        # a row is unusable (its sequence fails, as on the host: sampling.unusable) with a NaN or +inf
        # logit or none its mask allows
        bad = (torch.isnan(logits) | torch.isposinf(logits)).any(-1) | ~torch.isfinite(logits).any(-1)
        current = Launched(order, HostRows.copy(torch.cat([out, bad[:, None].long()], 1)), masked=True)
        self.ahead.follow(self, current)
        row = {seq: (token, unusable) for seq, (_, token, unusable) in zip(order, current.out.rows())}
        tokens = []
        for s in seqs:
            token, unusable = row[s.seq]
            if s.finished != FAILED and (unusable or (s.grammar is not None and not s.grammar.accept([token]))):
                s.finished = FAILED
            tokens.append(s.next_token if s.finished == FAILED else token)  # (a placeholder: nothing is emitted)
        return tokens

    def continues(self, request: StepRequest | None, seqs: list[int], greedy: bool = True) -> bool:
        """Whether `request` is the step after this one over the same rows (the sequences `seqs`, in
        order, no prefill, no logits, no blocks granted), none of them known to be finished (a finished sequence's row
        would run on past its length, which the host no longer advances), none that can run past the
        caches (the pass runs before the host knows how far this step took them: at most k + 1
        positions), and, for a `greedy` pass run `again`, the graph serves the next context."""
        if request is None or request.prefill or request.return_logits or request.grow or request.decode != seqs:
            return False  # (a grant changes the block tables after the pass would have been queued)
        limit = self.max_seq_len - 2 * (self.draft_len + 1)
        rows = [self.sequences[seq] for seq in seqs]
        return all(not s.finished and s.length <= limit for s in rows) and (not greedy or self.passes.can_go_again())

    def _accept(self, seqs: list[Sequence], hidden: torch.Tensor, argmax: torch.Tensor,
                logits_out: StepResult | None, wants_logits: bool = False, masks: dict | None = None,
                raw: torch.Tensor | None = None):
        """Per sequence: (drafts accepted, the token after them), and the target's logits [B, k+1, V]
        where they were computed (None where they were not). `masks`: the grammar rows computed before;
        `raw`: the verify pass's raw logits where it kept them (the head is then not read again)."""
        sampled = [i for i, s in enumerate(seqs) if not s.sampling.greedy or s.shaped]
        logits = None
        if logits_out is not None or sampled or wants_logits:
            head = self.model.lm_head
            logits = head.logits(hidden) if raw is None else head.logits_of(raw)  # [B, k+1, V]
            if logits_out is not None:
                logits_out.logits.append(logits.reshape(-1, logits.shape[-1]))
        shaped_rows = constrained.grammar_rows(seqs, logits, masks or {})
        argmax = argmax.tolist()
        accepted, tokens = [], []
        for i, s in enumerate(seqs):
            target, bad, greedy, single = shaped_rows.get(i, (None, False, None, None))
            if i not in shaped_rows and logits is not None:
                target = s.constrain(s.penalise(logits[i], s.drafts), s.drafts, (masks or {}).get(s.seq))
                bad = (s.shaped or not s.sampling.greedy or s.counts is not None) and unusable(target)
            if bad:
                s.finished = FAILED  # its request fails alone; the step goes on for the others
                accepted.append(0)
                tokens.append(s.next_token)  # (a placeholder for the draft pass: nothing is emitted)
                continue
            if (s.counts is not None or s.shaped) and s.sampling.greedy:  # (else target: None)
                argmax[i] = greedy if greedy is not None else target.argmax(-1).tolist()
            probs = None if s.sampling.greedy else target_probs(target, s.sampling)
            if self.forced is not None:
                n = s.forced(self.forced)
            elif probs is None:
                n = accept_greedy(argmax[i], s.drafts)
            else:
                n = accept_sampled(probs, s.drafts, s.generator)
            if n > (cap := s.cap()) and self.forced is None:  # the draft after the cap ends the sequence
                n, token = cap, s.drafts[cap]
            elif probs is None:
                token = argmax[i][n]
            else:
                token = resample(probs, s.drafts, n, s.generator)
            if single is not None:
                self.counters.constrained_counted(n + 1, sum(single[: n + 1]))
            elif s.grammar is not None:
                self.counters.constrained(target[: n + 1])
            accepted.append(n)
            tokens.append(token)
        return accepted, tokens, logits

    # --- the device passes (graphs.StepPasses captures them) -------------------------------------

    def _follow_pass(self, packed: torch.Tensor, accepts: torch.Tensor, hidden: torch.Tensor, saved: dict,
                     context: int) -> torch.Tensor:
        """The draft pass: commit the accepted prefix, run the MTP layer over it with the target's
        hidden states, and chain k new drafts: [B, k]."""
        ids, positions, slots = self.rows.ids(packed), self.rows.positions(packed), self.rows.slots(packed)
        index, new_tokens = accepts[:, 0], accepts[:, 1]
        self.model.commit(saved, slots, index)
        if self.prefix_states:  # the hidden state at the last committed position, for a state saved at its release
            self._keep_last_hidden(slots, hidden.gather(1, index[:, None, None].expand(-1, 1, hidden.shape[-1]))[:, 0])
        # MTP entry j pairs hidden j with token j+1: the accepted drafts, then the new token
        following = torch.cat([ids[:, 1:], ids[:, -1:]], 1).scatter(1, index[:, None], new_tokens[:, None])
        heads = self._mtp(following, hidden, slots, positions, context)
        head = heads.gather(1, index[:, None, None].expand(-1, 1, heads.shape[-1]))[:, 0]
        lengths = positions[:, 0] + index + 1
        guess = self.rows.guess(packed)
        if guess is None:  # (accepts past [accepted, token]: the forced drafts of constrained.follow_rows)
            return self._chain(head, slots, lengths, context, forced=accepts[:, 2:] if accepts.shape[1] > 2 else None)
        # lookahead (one sequence, eagerly): where the guess holds (all drafts kept, the new token the
        # guessed one) the chain keeps the guessed drafts, which the stages before already run the next
        # pass on
        if self.guessing.tree is not None:  # (deterministic: a branch holds only with the drafts chained anyway)
            kept = None if self.deterministic else branches.kept_drafts(guess, index, new_tokens, self.draft_len)
            return self._chain(head, slots, lengths, context, kept=kept)
        holds = bool(guess[0, 0] == new_tokens[0]) and int(index[0]) == self.draft_len
        return self._chain(head, slots, lengths, context, kept=guess[:, 1:] if holds else None)

    def _fused_pass(self, packed: torch.Tensor, context: int, x: torch.Tensor | None) -> torch.Tensor:
        """Verify, accept on the device (drafts while they equal the target's argmax, or the forced
        count when it is >= 0), and draft: [B, 2 + k] = (accepted, token, drafts)."""
        hidden, argmax, saved, _ = self._verify_pass(packed, context, x)
        k = self.draft_len
        matches = (argmax[:, :k] == self.rows.ids(packed)[:, 1:]).long().cumprod(1).sum(1)
        forced = self.rows.forced(packed)
        accepted = torch.where(forced >= 0, forced, torch.minimum(matches, self.rows.cap(packed)))
        accepts = torch.stack([accepted, argmax.gather(1, accepted[:, None])[:, 0]], 1)
        return torch.cat([accepts, self._follow_pass(packed, accepts, hidden, saved, context)], 1)

    def _mtp(self, next_ids: torch.Tensor, hidden: torch.Tensor, slots: torch.Tensor, positions: torch.Tensor,
             context: int, tail: bool = False):
        """MTP layer over (token t+1, target hidden t) pairs at positions t < context; -> its normed output."""
        return self.model.draft(next_ids, hidden, Batch(slots, positions, context, tail=tail))

    def _chain(self, head: torch.Tensor, slots: torch.Tensor, lengths: torch.Tensor, context: int,
               length: int | None = None, kept: torch.Tensor | None = None,
               forced: torch.Tensor | None = None) -> torch.Tensor:
        """Chain the MTP head `length` (default k) times: draft i is its argmax, or kept[:, i] for the
        drafts `kept` gives, or in row b forced[b, 1 + i] for i < forced[b, 0]; its output and draft i
        feed draft i+1 ([B, length])."""
        length = length or self.draft_len
        rows = self.chain_rows or None
        grammars = [s.grammar for s in rows] if rows else None
        drafts, consumed, self.chain_heads = [], [0] * len(rows or []), []
        for i in range(length):
            self.chain_heads.append(head)
            if kept is not None and i < kept.shape[1]:
                token = kept[:, i]
            elif rows is None:
                token = self.model.lm_head.draft_argmax(head)  # vocabulary-parallel: (max, index) per rank
            else:  # logit_bias, structured output: each row drafts from its biased logits what its grammar allows
                logits = self.model.lm_head.logits(head).float()
                if biased := [b for b, s in enumerate(rows) if s.bias is not None]:
                    logits[biased] += torch.stack([rows[b].bias for b in biased])
                if constrained := [b for b, s in enumerate(rows) if s.grammar is not None]:
                    logits[constrained] = masked_each(logits[constrained], [rows[b].grammar for b in constrained])
                token = logits.argmax(-1)
            if forced is not None and i < forced.shape[1] - 1:
                token = torch.where(forced[:, 0] > i, forced[:, 1 + i], token)
            if grammars is not None:
                for b, (grammar, t) in enumerate(zip(grammars, token.tolist())):
                    if grammar is not None and consumed[b] == i:  # (past a refused token: nothing more)
                        consumed[b] += grammar.advance([t])
            drafts.append(token)
            if i + 1 < length:
                head = self._mtp(token[:, None], head[:, None], slots, (lengths + i)[:, None], context)[:, 0]
        if self.lookahead:  # (eager passes only)
            self.chain_end = (head, token, slots, lengths + length - 1, context)
        for grammar, n in zip(grammars or [], consumed):
            if grammar is not None:
                grammar.rollback(n)
        return torch.stack(drafts, 1)
