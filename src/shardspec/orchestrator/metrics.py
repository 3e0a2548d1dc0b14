"""Prometheus metrics of a serving engine: requests, tokens, speculative decoding, latencies, slots.

Each `ServingMetrics` has its own registry, so several engines (or tests) in one process never
share counters. The engine feeds `on_step` (as its StepObserver); the server counts requests and
tokens; `refresh` copies the engine's queues and the workers' slot usage into gauges before a
scrape.
"""

from __future__ import annotations

from collections import deque
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from shardspec.orchestrator.requests import FirstToken

CONTENT_TYPE = CONTENT_TYPE_LATEST
LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                   10.0, 30.0, 60.0)
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)
RECENT_STEPS = 512  # the steps the status page's step-time percentiles are over


class ServingMetrics:
    def __init__(self, draft_tokens: int) -> None:
        self.registry = CollectorRegistry()
        self._counters()
        self._histograms()
        self._gauges()
        for position in range(1, draft_tokens + 1):  # every position shows up, at 0 before any step
            self.accepted_per_position.labels(position=str(position))
        self.draft_tokens_per_step = draft_tokens
        # for the status page: the last steps' times, and the counts behind MTP's acceptance
        self.recent_steps: deque[float] = deque(maxlen=RECENT_STEPS)
        self.steps_seen = 0
        self.verified = 0  # sequences' verify steps that checked drafts
        self.kept_at = [0] * draft_tokens  # of them, those that kept the draft at each position

    def _counters(self) -> None:
        r = self.registry
        self.requests = Counter("shardspec_requests", "Generation requests by endpoint and outcome "
                                "(finished, cancelled, failed, rejected)", ["endpoint", "outcome"], registry=r)
        self.prompt_tokens = Counter("shardspec_prompt_tokens", "Prompt tokens of the requests sent to the "
                                     "engine", registry=r)
        self.generated_tokens = Counter("shardspec_generation_tokens", "Tokens generated for requests",
                                        registry=r)
        self.drafts = Counter("shardspec_spec_decode_drafts", "Verify steps of one sequence that checked MTP "
                              "drafts", registry=r)
        self.draft_tokens = Counter("shardspec_spec_decode_draft_tokens", "MTP draft tokens verified",
                                    registry=r)
        self.accepted_tokens = Counter("shardspec_spec_decode_accepted_tokens", "MTP draft tokens accepted",
                                       registry=r)
        self.accepted_per_position = Counter("shardspec_spec_decode_accepted_per_position",
                                             "Acceptances of the draft at each position (1 = first draft)",
                                             ["position"], registry=r)

    def _histograms(self) -> None:
        r = self.registry
        self.step_seconds = Histogram("shardspec_step_seconds", "Time of one batched step on the workers "
                                      "(slowest rank)", buckets=LATENCY_BUCKETS, registry=r)
        self.step_sequences = Histogram("shardspec_step_sequences", "Sequences that advanced in one step",
                                        buckets=BATCH_BUCKETS, registry=r)
        self.time_to_first_token = Histogram("shardspec_time_to_first_token_seconds", "From a request's "
                                             "arrival to its first generated token", buckets=LATENCY_BUCKETS,
                                             registry=r)
        self.request_seconds = Histogram("shardspec_request_seconds", "From a request's arrival to its last "
                                         "token", buckets=LATENCY_BUCKETS, registry=r)
        self.first_token_phases = Histogram(
            "shardspec_time_to_first_token_phase_seconds", "Where a request's time to first token goes: prepare "
            "(arrival to the scheduler's queue: the prompt's template, tokens and checks, its grammar), queue "
            "(to its prefill step's sending), first step (the slowest worker's time in it), wire (the rest of "
            "that step's round trip), stream (its reply to the first token handed to the response)",
            ["phase"], buckets=LATENCY_BUCKETS, registry=r)

    def first_token(self, timeline: FirstToken, elapsed: float) -> None:
        """A request's first token is out, `elapsed` seconds after its arrival."""
        for phase, seconds in timeline.phases().items():
            self.first_token_phases.labels(phase=phase).observe(max(seconds, 0.0))
        self.first_token_phases.labels(phase="stream").observe(max(elapsed - timeline.replied, 0.0))
        self.time_to_first_token.observe(elapsed)

    def _gauges(self) -> None:
        r = self.registry
        self.running = Gauge("shardspec_requests_running", "Sequences being generated", registry=r)
        self.waiting = Gauge("shardspec_requests_waiting", "Requests queued for a slot or K/V blocks", registry=r)
        self.healthy = Gauge("shardspec_workers_healthy", "1 when every worker is connected, else 0", registry=r)
        self.slots_total = Gauge("shardspec_worker_slots_total", "Cache slots of each worker", ["rank"],
                                 registry=r)
        self.slots_free = Gauge("shardspec_worker_slots_free", "Free cache slots of each worker", ["rank"],
                                registry=r)
        self.live_sequences = Gauge("shardspec_worker_live_sequences", "Sequences live on each worker",
                                    ["rank"], registry=r)
        self.cache_usage = Gauge("shardspec_cache_usage", "Fraction of the workers' K/V blocks held by "
                                 "sequences", registry=r)
        self.preemptions = Counter("shardspec_preemptions", "Requests preempted (their blocks taken back, "
                                   "their tokens prefilled again later) when the K/V blocks ran out", registry=r)
        self.preemptions_seen = 0
        self.prefix_queries = Counter("shardspec_prefix_cache_queries", "Prompt tokens looked up in the prefix "
                                      "cache", registry=r)
        self.grammar_tokens = Counter("shardspec_grammar_tokens", "Tokens generated under a grammar (structured "
                                      "output, forced tool calls)", registry=r)
        self.forced_tokens = Counter("shardspec_grammar_forced_tokens", "Tokens generated under a grammar that "
                                     "allowed no other (jump-forward: with MTP, drafted and accepted without a "
                                     "choice)", registry=r)
        self.grammar_seen = (0, 0)  # the workers' totals at the last refresh
        self.prefix_hits = Counter("shardspec_prefix_cache_hits", "Prompt tokens found in the prefix cache (not "
                                   "prefilled again)", registry=r)
        self.prefix_seen: tuple[Any, int, int] = (None, 0, 0)  # (the cache, its queries, its hits) last counted

    def on_step(self, step_s: float, accepted: list[int]) -> None:
        """The engine's StepObserver hook: one call per step reply."""
        self.step_seconds.observe(step_s)
        self.step_sequences.observe(len(accepted))
        self.recent_steps.append(step_s)
        self.steps_seen += 1
        verified = [n for n in accepted if n >= 0]
        if not verified or not self.draft_tokens_per_step:
            return
        self.verified += len(verified)
        for position in range(self.draft_tokens_per_step):
            self.kept_at[position] += sum(n > position for n in verified)
        self.drafts.inc(len(verified))
        self.draft_tokens.inc(len(verified) * self.draft_tokens_per_step)
        self.accepted_tokens.inc(sum(verified))
        for position in range(1, max(verified) + 1):
            self.accepted_per_position.labels(position=str(position)).inc(sum(n >= position for n in verified))

    def refresh(self, scheduler: Any, healthy: bool, worker_stats: list[Any]) -> None:
        """Gauges from the engine's scheduler and the workers' StatsReplies (rank order)."""
        self.running.set(len(scheduler.running))
        self.waiting.set(len(scheduler.waiting))
        self.cache_usage.set(scheduler.pool.usage if scheduler.pool is not None else 0.0)
        self.preemptions.inc(scheduler.preemptions - self.preemptions_seen)
        self.preemptions_seen = scheduler.preemptions
        cache = scheduler.cache
        if cache is not None:
            _, queries, hits = self.prefix_seen if self.prefix_seen[0] is cache else (cache, 0, 0)
            self.prefix_queries.inc(cache.queries - queries)
            self.prefix_hits.inc(cache.hits - hits)
            self.prefix_seen = (cache, cache.queries, cache.hits)
        self.healthy.set(1 if healthy else 0)
        self._grammar_counts(worker_stats)
        for rank, stats in enumerate(worker_stats):
            self.slots_total.labels(rank=str(rank)).set(stats.slots_total)
            self.slots_free.labels(rank=str(rank)).set(stats.slots_free)
            self.live_sequences.labels(rank=str(rank)).set(len(stats.live_sequences))

    def _grammar_counts(self, worker_stats: list[Any]) -> None:
        """The last stage's grammar counts (each of its ranks has them; the others count none), as
        increments of the counters; workers that started again count from 0."""
        if not worker_stats:
            return
        totals = (max(s.grammar_tokens for s in worker_stats), max(s.forced_tokens for s in worker_stats))
        for counter, total, seen in zip((self.grammar_tokens, self.forced_tokens), totals, self.grammar_seen):
            counter.inc(total - seen if total >= seen else total)
        self.grammar_seen = totals

    def summary(self) -> dict[str, Any]:
        """Step times (p50/p95 over the last RECENT_STEPS, ms) and MTP's acceptance: the share of
        verify steps that kept the draft at each position, and the mean acceptance length."""
        steps = sorted(self.recent_steps)

        def percentile(q: float) -> float | None:
            return round(1e3 * steps[min(len(steps) - 1, int(q * len(steps)))], 3) if steps else None

        kept = [round(n / self.verified, 4) if self.verified else None for n in self.kept_at]
        mal = round(1 + sum(self.kept_at) / self.verified, 3) if self.verified else None
        return {"steps": self.steps_seen, "step_ms_p50": percentile(0.5), "step_ms_p95": percentile(0.95),
                "draft_tokens": self.draft_tokens_per_step, "acceptance_per_position": kept,
                "mean_acceptance_length": mal}

    def render(self) -> bytes:
        return generate_latest(self.registry)
