"""Prometheus metrics of the api: its requests' counters and latency histograms. The scheduler and
each worker rank serve their own on ports of their own, so api replicas count nothing twice."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest


FIRST_TOKEN_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                       20.0, 40.0, 80.0)
TOKEN_GAP_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3,
                     0.4, 0.5, 0.75, 1.0, 2.5)
REQUEST_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0, 480.0)


class ApiMetrics:
    def __init__(self):
        self.registry = CollectorRegistry()
        self.requests = Counter(
            "pagedserve_requests", "ended requests by endpoint and finish reason (stop, length, abort, error)",
            ["endpoint", "finish_reason"], registry=self.registry,
        )
        self.time_to_first_token = Histogram(
            "pagedserve_time_to_first_token_seconds", "from a request's arrival at the api to its first token",
            buckets=FIRST_TOKEN_BUCKETS, registry=self.registry,
        )
        self.time_per_output_token = Histogram(
            "pagedserve_time_per_output_token_seconds", "between consecutive outputs of a request, per token",
            buckets=TOKEN_GAP_BUCKETS, registry=self.registry,
        )
        self.e2e_request_latency = Histogram(
            "pagedserve_e2e_request_latency_seconds", "from arrival to the last token, of requests that finished",
            buckets=REQUEST_BUCKETS, registry=self.registry,
        )
        self.prompt_tokens = Counter("pagedserve_prompt_tokens", "prompt tokens", registry=self.registry)
        self.generation_tokens = Counter(
            "pagedserve_generation_tokens", "generated tokens", registry=self.registry
        )

    def render(self) -> bytes:
        return generate_latest(self.registry)
