"""Prometheus metrics of one server (its own `CollectorRegistry`, so several apps in one
process never share counters). Served as text at GET /metrics.

Gauges are set by the engine thread after every round; token and latency metrics as tokens
are emitted; the speculation counters (target steps, drafted and accepted tokens, by depth)
when a request finishes, from its `GenerationStats`.

    treespec_requests_running / _waiting              requests in a lane / queued (gauges)
    treespec_kv_slots_used                            KV cache slots reserved by live requests
    treespec_prompt_tokens_total, _generated_tokens_total
    treespec_target_steps_total                       target forwards (rounds), summed over requests
    treespec_drafted_tokens_total                     draft tree nodes sent to the target
    treespec_accepted_tokens_total                    draft tokens the target accepted
    treespec_accepted_by_depth_total{depth}           rounds that accepted a draft token at depth d
    treespec_attempted_by_depth_total{depth}          rounds that tried a proposal at depth d
    treespec_acceptance_rate                          accepted / drafted, over finished requests
    treespec_mean_accepted_length                     accepted draft tokens per target step
    treespec_tokens_per_step                          generated tokens per target step
    treespec_time_to_first_token_seconds              arrival -> first token (histogram)
    treespec_inter_token_latency_seconds              per token of each emission after the first:
                                                      the gap since the previous emission / its tokens
    treespec_request_latency_seconds                  arrival -> finished (histogram)
    treespec_requests_total{finish_reason}            eos, length, stop, cancelled, error
    treespec_requests_rejected_total{status}          answered 4xx before running (400, 404, 429, 503)
"""

from __future__ import annotations

import threading

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from ..stats import GenerationStats

_LATENCY_BUCKETS = (
    0.001,
    0.0025,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.15,
    0.2,
    0.3,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
)
_TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.2, 0.4, 0.8, 1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 64.0)
_E2E_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0, 320.0)


class Metrics:
    content_type = CONTENT_TYPE_LATEST

    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        self.running = Gauge("treespec_requests_running", "Requests holding a lane", registry=r)
        self.waiting = Gauge("treespec_requests_waiting", "Requests queued for a lane", registry=r)
        self.kv_slots = Gauge(
            "treespec_kv_slots_used", "KV cache slots reserved by live requests", registry=r
        )
        self.prompt_tokens = Counter(
            "treespec_prompt_tokens", "Prompt tokens of accepted requests", registry=r
        )
        self.generated = Counter("treespec_generated_tokens", "Tokens generated", registry=r)
        self.steps = Counter(
            "treespec_target_steps", "Target forward passes (rounds), per request", registry=r
        )
        self.drafted = Counter("treespec_drafted_tokens", "Draft tokens (tree nodes) verified", registry=r)
        self.accepted = Counter("treespec_accepted_tokens", "Draft tokens accepted", registry=r)
        self.accepted_by_depth = Counter(
            "treespec_accepted_by_depth",
            "Rounds that accepted a draft token at this depth",
            ["depth"],
            registry=r,
        )
        self.attempted_by_depth = Counter(
            "treespec_attempted_by_depth",
            "Rounds that tried a draft token at this depth",
            ["depth"],
            registry=r,
        )
        self.acceptance_rate = Gauge(
            "treespec_acceptance_rate", "Accepted / drafted tokens over finished requests", registry=r
        )
        self.mean_accepted_length = Gauge(
            "treespec_mean_accepted_length", "Accepted draft tokens per target step (finished)", registry=r
        )
        self.tokens_per_step = Gauge(
            "treespec_tokens_per_step", "Generated tokens per target step (finished requests)", registry=r
        )
        self.ttft = Histogram(
            "treespec_time_to_first_token_seconds",
            "Arrival to first token",
            buckets=_TTFT_BUCKETS,
            registry=r,
        )
        self.itl = Histogram(
            "treespec_inter_token_latency_seconds",
            "Per token after the first: gap since the previous emission / tokens it carried",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.e2e = Histogram(
            "treespec_request_latency_seconds", "Arrival to finish", buckets=_E2E_BUCKETS, registry=r
        )
        self.finished = Counter("treespec_requests", "Finished requests", ["finish_reason"], registry=r)
        self.rejected = Counter(
            "treespec_requests_rejected", "Requests answered 4xx/5xx before running", ["status"], registry=r
        )
        for reason in ("eos", "length", "stop", "cancelled", "error"):
            self.finished.labels(reason)
        self._lock = threading.Lock()
        self._totals = GenerationStats()  # pooled over finished requests: the derived gauges

    def engine_state(self, running: int, waiting: int, kv_slots: int) -> None:
        self.running.set(running)
        self.waiting.set(waiting)
        self.kv_slots.set(kv_slots)

    def tokens(self, n: int, first_latency: float | None, gap: float | None) -> None:
        """`n` tokens emitted in one round: the request's first emission (`first_latency`
        since arrival: time to first token; the tokens that came with the first are not
        counted as inter-token latencies), or a later one (`gap` since the previous emission,
        observed once per token as gap / n)."""
        if n <= 0:
            return
        self.generated.inc(n)
        if first_latency is not None:
            self.ttft.observe(first_latency)
        elif gap is not None:
            for _ in range(n):
                self.itl.observe(gap / n)

    def finish(self, reason: str, stats: GenerationStats | None, latency: float) -> None:
        self.finished.labels(reason).inc()
        self.e2e.observe(latency)
        if stats is None:
            return
        self.steps.inc(stats.target_steps)
        self.drafted.inc(stats.tree_nodes)
        self.accepted.inc(stats.accepted_tokens)
        for d, (a, t) in enumerate(zip(stats.accepted_by_depth, stats.attempted_by_depth), start=1):
            self.accepted_by_depth.labels(str(d)).inc(a)
            self.attempted_by_depth.labels(str(d)).inc(t)
        with self._lock:
            self._totals.add(stats)
            self.acceptance_rate.set(self._totals.acceptance_rate)
            self.mean_accepted_length.set(self._totals.mean_accepted_length)
            self.tokens_per_step.set(self._totals.tokens_per_step)

    def reject(self, status: int) -> None:
        self.rejected.labels(str(status)).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)
