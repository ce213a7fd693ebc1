"""Prometheus metrics of the api: its requests' counters and latency histograms. The scheduler and
each worker rank serve their own on ports of their own, so api replicas count nothing twice."""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

from prometheus_client import Metric

if TYPE_CHECKING:
    from services.api.engine_group import EngineGroup
from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

FIRST_TOKEN_BUCKETS = (
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
)
TOKEN_GAP_BUCKETS = (
    0.001,
    0.0025,
    0.005,
    0.01,
    0.015,
    0.02,
    0.025,
    0.03,
    0.04,
    0.05,
    0.075,
    0.1,
    0.15,
    0.2,
    0.3,
    0.4,
    0.5,
    0.75,
    1.0,
    2.5,
)
REQUEST_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0, 480.0)


class ApiMetrics:
    def __init__(self, engines: EngineGroup | None = None):
        self.registry = CollectorRegistry()
        if engines is not None:
            self.registry.register(EngineCollector(engines))
        self.requests = Counter(
            "pagedserve_requests",
            "ended requests by endpoint and finish reason (stop, length, abort, error)",
            ["endpoint", "finish_reason"],
            registry=self.registry,
        )
        self.time_to_first_token = Histogram(
            "pagedserve_time_to_first_token_seconds",
            "from a request's arrival at the api to its first token",
            buckets=FIRST_TOKEN_BUCKETS,
            registry=self.registry,
        )
        self.time_per_output_token = Histogram(
            "pagedserve_time_per_output_token_seconds",
            "between consecutive outputs of a request, per token",
            buckets=TOKEN_GAP_BUCKETS,
            registry=self.registry,
        )
        self.e2e_request_latency = Histogram(
            "pagedserve_e2e_request_latency_seconds",
            "from arrival to the last token, of requests that finished",
            buckets=REQUEST_BUCKETS,
            registry=self.registry,
        )
        self.prompt_tokens = Counter("pagedserve_prompt_tokens", "prompt tokens", registry=self.registry)
        self.generation_tokens = Counter("pagedserve_generation_tokens", "generated tokens", registry=self.registry)

    def render(self) -> bytes:
        return generate_latest(self.registry)


class EngineCollector:
    """Each engine behind this api, labelled by its index in --scheduler-endpoint: whether it is up,
    the requests this api routed to it, and the load it last reported."""

    def __init__(self, engines: EngineGroup):
        self.engines = engines

    def collect(self) -> Iterator[Metric]:
        families = {
            "up": GaugeMetricFamily("pagedserve_engine_up", "1 while the engine serves", labels=["engine"]),
            "in_flight": GaugeMetricFamily(
                "pagedserve_engine_requests_in_flight", "this api's requests on the engine now", labels=["engine"]
            ),
            "running": GaugeMetricFamily(
                "pagedserve_engine_requests_running",
                "requests running on the engine, as it last reported",
                labels=["engine"],
            ),
            "waiting": GaugeMetricFamily(
                "pagedserve_engine_requests_waiting",
                "requests waiting on the engine, as it last reported",
                labels=["engine"],
            ),
            "kv": GaugeMetricFamily(
                "pagedserve_engine_kv_usage",
                "share of the engine's device KV blocks in use, as it last reported",
                labels=["engine"],
            ),
        }
        routed = CounterMetricFamily(
            "pagedserve_engine_routed_requests", "requests this api sent to the engine", labels=["engine"]
        )
        for index, client in enumerate(self.engines.clients):
            engine, up = str(index), client.info is not None
            families["up"].add_metric([engine], float(up))
            families["in_flight"].add_metric([engine], client.in_flight)
            families["running"].add_metric([engine], client.load.running if up else 0)
            families["waiting"].add_metric([engine], client.load.waiting if up else 0)
            families["kv"].add_metric([engine], client.load.kv_usage if up else 0.0)
            routed.add_metric([engine], self.engines.routed[index])
        yield from families.values()
        yield routed
