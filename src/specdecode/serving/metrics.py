"""Prometheus metrics of the server; the speculative counters are named like vLLM's (`spec_decode_*`)."""

from __future__ import annotations

from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, disable_created_metrics

from specdecode.stats import GenerationStats

disable_created_metrics()  # no `*_created` series: they double the output and nobody graphs them

LATENCY_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 40, 80, 160, 320)


class Metrics:
    """One registry per app, so several servers (or tests) in one process do not collide."""

    def __init__(self, running: Callable[[], int], waiting: Callable[[], int]) -> None:
        r = self.registry = CollectorRegistry()
        p = "specdecode_"
        self.requests = Counter(p + "requests", "HTTP requests by endpoint and status code",
                                ["endpoint", "status"], registry=r)
        self.latency = Histogram(p + "request_latency_seconds", "End-to-end latency of generation requests",
                                 ["endpoint"], buckets=LATENCY_BUCKETS, registry=r)
        self.ttft = Histogram(p + "time_to_first_token_seconds", "Time from request to its first token",
                              buckets=LATENCY_BUCKETS, registry=r)
        self.tokens_per_second = Histogram(p + "request_tokens_per_second", "Generated tokens/s per request",
                                           buckets=(0.5, 1, 2, 4, 8, 16, 32, 64, 128, 256, 512), registry=r)
        self.prompt_tokens = Counter(p + "prompt_tokens", "Prompt tokens of finished requests", registry=r)
        self.generation_tokens = Counter(p + "generation_tokens", "Generated tokens", registry=r)
        self.batch_size = Histogram(p + "batch_size", "Sequences per engine step (one target forward)",
                                    buckets=(1, 2, 3, 4, 6, 8, 12, 16, 32), registry=r)
        Gauge(p + "num_requests_running", "Sequences in the running batch", registry=r).set_function(running)
        Gauge(p + "num_requests_waiting", "Requests waiting for a batch slot", registry=r).set_function(waiting)
        self.num_drafts = Counter(p + "spec_decode_num_drafts", "Steps with a non-empty draft", registry=r)
        self.num_draft_tokens = Counter(p + "spec_decode_num_draft_tokens", "Draft tokens proposed", registry=r)
        self.num_accepted_tokens = Counter(p + "spec_decode_num_accepted_tokens", "Draft tokens accepted",
                                           registry=r)
        self.accepted_per_pos = Counter(p + "spec_decode_num_accepted_tokens_per_pos",
                                        "Draft tokens accepted, by position in the draft", ["position"], registry=r)

    def record_generation(self, stats: GenerationStats) -> None:
        """Counters of one finished (or abandoned) request, from the engine's own statistics."""
        self.prompt_tokens.inc(stats.prompt_tokens)
        self.generation_tokens.inc(stats.new_tokens)
        self.num_drafts.inc(stats.drafts)
        self.num_draft_tokens.inc(stats.drafted_tokens)
        self.num_accepted_tokens.inc(stats.accepted_tokens)
        for pos, n in enumerate(stats.accepted_by_position):
            self.accepted_per_pos.labels(position=str(pos)).inc(n)
        if stats.tokens_per_second:
            self.tokens_per_second.observe(stats.tokens_per_second)
