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
    def __init__(self, engines: EngineGroup | None = None, model_name: str = ""):
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
        self.registry.register(VllmNames(self, engines, model_name))

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


# The api's own families under the names vLLM's ecosystem reads (routers, autoscalers, dashboards), same meaning.
VLLM_NAMES = {
    "pagedserve_time_to_first_token_seconds": "vllm:time_to_first_token_seconds",
    "pagedserve_time_per_output_token_seconds": "vllm:inter_token_latency_seconds",
    "pagedserve_e2e_request_latency_seconds": "vllm:e2e_request_latency_seconds",
    "pagedserve_prompt_tokens": "vllm:prompt_tokens",
    "pagedserve_generation_tokens": "vllm:generation_tokens",
}


class VllmNames:
    """vLLM's metric names for what this api measures and what its engines last reported, labelled by
    `model_name` (and `engine`) as vLLM's are: the request counters and latency histograms, requests running
    and waiting, the share of KV cache in use, and the ended requests by finish reason."""

    def __init__(self, metrics: ApiMetrics, engines: EngineGroup | None, model_name: str):
        self.metrics, self.engines, self.model_name = metrics, engines, model_name

    def collect(self) -> Iterator[Metric]:
        own = (
            self.metrics.time_to_first_token,
            self.metrics.time_per_output_token,
            self.metrics.e2e_request_latency,
            self.metrics.prompt_tokens,
            self.metrics.generation_tokens,
        )
        for family in (f for metric in own for f in metric.collect()):
            name = VLLM_NAMES[family.name]
            renamed = Metric(name, family.documentation, family.type)
            for sample in family.samples:
                if sample.name.endswith("_created"):
                    continue
                suffix = sample.name[len(family.name) :]
                renamed.add_sample(name + suffix, {"model_name": self.model_name, **sample.labels}, sample.value)
            yield renamed
        success = CounterMetricFamily(
            "vllm:request_success", "requests ended, by finish reason", labels=["model_name", "finished_reason"]
        )
        ended: dict[str, float] = {}
        for family in self.metrics.requests.collect():
            for sample in family.samples:
                reason = sample.labels.get("finish_reason", "")
                if sample.name.endswith("_total") and reason != "error":
                    ended[reason] = ended.get(reason, 0.0) + sample.value
        for reason, value in sorted(ended.items()):
            success.add_metric([self.model_name, reason], value)
        yield success
        if self.engines is None:
            return
        running = GaugeMetricFamily(
            "vllm:num_requests_running", "requests running on the engine", labels=["model_name", "engine"]
        )
        waiting = GaugeMetricFamily(
            "vllm:num_requests_waiting", "requests waiting on the engine", labels=["model_name", "engine"]
        )
        usage = GaugeMetricFamily(
            "vllm:kv_cache_usage_perc",
            "share of the engine's KV cache in use (1 = 100%)",
            labels=["model_name", "engine"],
        )
        for index, client in enumerate(self.engines.clients):
            up, labels = client.info is not None, [self.model_name, str(index)]
            running.add_metric(labels, client.load.running if up else 0)
            waiting.add_metric(labels, client.load.waiting if up else 0)
            usage.add_metric(labels, client.load.kv_usage if up else 0.0)
        yield from (running, waiting, usage)
