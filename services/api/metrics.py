"""Prometheus metrics of the api: its own request counters and the scheduler's latest stats."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from shared.protocol import Stats


class SchedulerStatsCollector:
    """Exposes the most recent `Stats` the scheduler reported."""

    def __init__(self):
        self.stats: Stats | None = None

    def collect(self):
        stats = self.stats
        if stats is None:
            return
        yield GaugeMetricFamily("pagedserve_gpu_blocks_total", "GPU KV blocks in the pool", value=stats.num_gpu_blocks)
        yield GaugeMetricFamily("pagedserve_gpu_blocks_free", "free GPU KV blocks", value=stats.num_free_gpu_blocks)
        used = stats.num_gpu_blocks - stats.num_free_gpu_blocks
        yield GaugeMetricFamily("pagedserve_gpu_blocks_used", "GPU KV blocks held by sequences", value=used)
        yield GaugeMetricFamily(
            "pagedserve_gpu_cache_usage_ratio", "fraction of GPU KV blocks in use",
            value=used / stats.num_gpu_blocks if stats.num_gpu_blocks else 0.0,
        )
        yield GaugeMetricFamily("pagedserve_num_requests_running", "sequences running", value=stats.num_running)
        yield GaugeMetricFamily("pagedserve_num_requests_waiting", "sequences waiting", value=stats.num_waiting)
        yield CounterMetricFamily("pagedserve_preemptions", "sequences preempted", value=stats.num_preemptions)
        yield CounterMetricFamily("pagedserve_steps", "steps scheduled", value=stats.num_steps)


class ApiMetrics:
    def __init__(self):
        self.registry = CollectorRegistry()
        self.scheduler = SchedulerStatsCollector()
        self.registry.register(self.scheduler)
        self.requests = Counter(
            "pagedserve_requests", "finished requests by endpoint and finish reason",
            ["endpoint", "finish_reason"], registry=self.registry,
        )
        self.prompt_tokens = Counter("pagedserve_prompt_tokens", "prompt tokens", registry=self.registry)
        self.generation_tokens = Counter(
            "pagedserve_generation_tokens", "generated tokens", registry=self.registry
        )

    def render(self, stats: Stats | None) -> bytes:
        if stats is not None:
            self.scheduler.stats = stats
        return generate_latest(self.registry)
