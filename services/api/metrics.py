"""Prometheus metrics of the api: its own request counters and latency histograms, and the
scheduler's latest stats."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
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
        gauges = {
            "gpu_blocks_total": ("GPU KV blocks in the pool", stats.num_gpu_blocks),
            "gpu_blocks_free": ("GPU KV blocks free", stats.num_free_gpu_blocks),
            "gpu_blocks_cached": ("GPU KV blocks cached for prefix reuse, evictable", stats.num_cached_gpu_blocks),
            "gpu_blocks_used": (
                "GPU KV blocks referenced by sequences",
                stats.num_gpu_blocks - stats.num_free_gpu_blocks - stats.num_cached_gpu_blocks,
            ),
            "cpu_blocks_total": ("CPU swap-space blocks", stats.num_cpu_blocks),
            "cpu_blocks_used": ("CPU swap-space blocks in use", stats.num_cpu_blocks - stats.num_free_cpu_blocks),
            "num_requests_running": ("sequences running", stats.num_running),
            "num_requests_waiting": ("requests waiting", stats.num_waiting),
            "num_requests_swapped": ("requests swapped to CPU", stats.num_swapped),
        }
        for name, (help_text, value) in gauges.items():
            yield GaugeMetricFamily(f"pagedserve_{name}", help_text, value=value)
        used = gauges["gpu_blocks_used"][1]
        yield GaugeMetricFamily(
            "pagedserve_gpu_cache_usage_ratio", "fraction of GPU KV blocks referenced",
            value=used / stats.num_gpu_blocks if stats.num_gpu_blocks else 0.0,
        )
        referenced_slots = used * stats.block_size
        yield GaugeMetricFamily(
            "pagedserve_kv_utilization_ratio",
            "share of the referenced KV slots on the device that hold token states (the rest: the unfilled "
            "end of each sequence's last block)",
            value=stats.kv_slots_holding_tokens / referenced_slots if referenced_slots else 1.0,
        )
        swapped = CounterMetricFamily("pagedserve_blocks_swapped", "KV blocks moved between device and swap space",
                                      labels=["direction"])
        swapped.add_metric(["out"], stats.blocks_swapped_out)
        swapped.add_metric(["in"], stats.blocks_swapped_in)
        yield swapped
        yield CounterMetricFamily("pagedserve_blocks_copied", "KV blocks copied on write (a shared block written)",
                                  value=stats.blocks_copied)
        yield CounterMetricFamily("pagedserve_tokens_scheduled", "prompt and decode tokens run through the model; "
                                  "over pagedserve_steps_total, the tokens per step", value=stats.tokens_scheduled)
        preemptions = CounterMetricFamily("pagedserve_preemptions", "requests preempted", labels=["mode"])
        preemptions.add_metric(["swap"], stats.num_preemptions_swap)
        preemptions.add_metric(["recompute"], stats.num_preemptions_recompute)
        yield preemptions
        yield CounterMetricFamily("pagedserve_steps", "steps scheduled", value=stats.num_steps)
        yield CounterMetricFamily("pagedserve_worker_busy_seconds", "time the worker spent computing steps",
                                  value=stats.worker_busy_seconds)
        yield CounterMetricFamily(
            "pagedserve_worker_waiting_seconds",
            "time the worker waited for its next step while the scheduler had work (overhead, not idleness)",
            value=stats.worker_waiting_seconds,
        )
        yield CounterMetricFamily(
            "pagedserve_prompt_tokens_computed", "prompt tokens run through the model",
            value=stats.num_prompt_tokens_computed,
        )
        yield CounterMetricFamily(
            "pagedserve_prompt_tokens_cached", "prompt tokens served from the prefix cache",
            value=stats.num_prompt_tokens_cached,
        )


FIRST_TOKEN_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                       20.0, 40.0, 80.0)
TOKEN_GAP_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3,
                     0.4, 0.5, 0.75, 1.0, 2.5)
REQUEST_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0, 480.0)


class ApiMetrics:
    def __init__(self):
        self.registry = CollectorRegistry()
        self.scheduler = SchedulerStatsCollector()
        self.registry.register(self.scheduler)
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

    def render(self, stats: Stats | None) -> bytes:
        if stats is not None:
            self.scheduler.stats = stats
        return generate_latest(self.registry)
