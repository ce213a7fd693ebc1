"""The scheduler's Prometheus metrics, served on its own port: queues, KV blocks on the device
and in swap, the memory manager's traffic, and how long planning a step takes.

The HTTP server runs in a thread of its own, so it never reads the scheduler's live state: each
scrape asks the loop for a `Stats` snapshot (`Snapshots`) and waits for it, a second at most.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator

import zmq
from prometheus_client import CollectorRegistry, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from services.scheduler.speculation import SpeculationStats
from services.scheduler.stats import LoraStats, Stats
from shared.sockets import Context

SCHEDULE_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25)
TOKENS_PER_STEP_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192)
QUEUE_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)


class SchedulerMetrics:
    def __init__(self, fresh_stats: Callable[[], tuple[Stats | None, str]]):
        self.registry = CollectorRegistry()
        self.registry.register(StatsCollector(fresh_stats))
        self.schedule_seconds = Histogram(
            "pagedserve_step_phase_seconds",
            "time of one phase of a step: schedule here, forward and sample on each worker rank",
            ["phase"],
            buckets=SCHEDULE_BUCKETS,
            registry=self.registry,
        ).labels("schedule")
        self.tokens_per_step = Histogram(
            "pagedserve_tokens_per_step",
            "prompt and decode tokens in one step",
            buckets=TOKENS_PER_STEP_BUCKETS,
            registry=self.registry,
        )
        self.queue_time = Histogram(
            "pagedserve_request_queue_time_seconds",
            "from a request's arrival at the scheduler to its first step, "
            "by tenant (an api key's tenant id, user for tenants named by the `user` field, none) and priority class "
            "(high: below 0, default: 0, low: above 0)",
            ["tenant", "priority"],
            buckets=QUEUE_BUCKETS,
            registry=self.registry,
        )


class Snapshots:
    """A scrape, in the HTTP thread, asks over an inproc socket; the loop, which polls `requests`,
    answers with `take`. A loop busy with a long step leaves the scrape the last snapshot."""

    def __init__(self, context: Context, name: str):
        self.context = context
        self.endpoint = f"inproc://scheduler-snapshot-{name}"
        self.requests = context.socket(zmq.PULL)
        self.requests.bind(self.endpoint)
        self.latest: tuple[Stats | None, str] = (None, "cpu")  # the stats, and the workers' device type
        self.taken = 0
        self.condition = threading.Condition()

    def fresh(self) -> tuple[Stats | None, str]:
        """For another thread: a snapshot the loop takes now."""
        with self.condition:
            wanted = self.taken + 1
        request = self.context.socket(zmq.PUSH)
        try:
            request.connect(self.endpoint)
            request.send(b"", zmq.NOBLOCK)
        finally:
            request.close(linger=0)
        with self.condition:
            self.condition.wait_for(lambda: self.taken >= wanted, timeout=1.0)
            return self.latest

    def take(self, snapshot: tuple[Stats | None, str]) -> None:
        """For the loop, when `requests` is readable."""
        while self.requests.poll(0, zmq.POLLIN):
            self.requests.recv()
        with self.condition:
            self.latest, self.taken = snapshot, self.taken + 1
            self.condition.notify_all()


class StatsCollector:
    """Gauges and counters of a fresh snapshot; none before the workers are ready."""

    def __init__(self, fresh_stats: Callable[[], tuple[Stats | None, str]]):
        self.fresh_stats = fresh_stats  # the snapshot, and the workers' device type

    def collect(self) -> Iterator[Metric]:
        stats, device = self.fresh_stats()
        if stats is None:
            return
        used = stats.num_used_gpu_blocks
        swap_used = stats.num_cpu_blocks - stats.num_free_cpu_blocks
        pools = {  # pool: (device, used, cached, free, total)
            "device": (device, used, stats.num_cached_gpu_blocks, stats.num_free_gpu_blocks, stats.num_gpu_blocks),
            "swap": ("cpu", swap_used, 0, stats.num_free_cpu_blocks, stats.num_cpu_blocks),
            "host_cache": (
                "cpu",
                0,
                stats.num_cached_host_blocks,
                stats.num_host_cache_blocks - stats.num_cached_host_blocks,
                stats.num_host_cache_blocks,
            ),
            "disk": (
                "disk",
                0,
                stats.num_disk_blocks,
                stats.disk_capacity_blocks - stats.num_disk_blocks,
                stats.disk_capacity_blocks,
            ),
        }
        blocks = GaugeMetricFamily(
            "pagedserve_kv_blocks",
            "KV blocks by pool (the device's cache; in CPU memory, "
            "the swap space and the host cache of --kv-offloading-size; files under "
            "--kv-cache-dir) and state: used by sequences, cached for prefix reuse "
            "(evictable), free",
            labels=["pool", "device", "state"],
        )
        capacity = GaugeMetricFamily(
            "pagedserve_kv_blocks_capacity", "KV blocks in the pool", labels=["pool", "device"]
        )
        usage = GaugeMetricFamily(
            "pagedserve_kv_usage_ratio", "share of the pool's KV blocks used by sequences", labels=["pool", "device"]
        )
        for pool, (device, in_use, cached, free, total) in pools.items():
            for state, value in (("used", in_use), ("cached", cached), ("free", free)):
                blocks.add_metric([pool, device, state], value)
            capacity.add_metric([pool, device], total)
            usage.add_metric([pool, device], in_use / total if total else 0.0)
        yield from (blocks, capacity, usage)
        referenced_slots = used * stats.block_size
        yield GaugeMetricFamily(
            "pagedserve_kv_utilization_ratio",
            "share of the KV slots in the device blocks used by sequences that hold token states (the rest: the "
            "unfilled end of each sequence's last block); the paper's memory utilization",
            value=stats.kv_slots_holding_tokens / referenced_slots if referenced_slots else 1.0,
        )
        slots = GaugeMetricFamily(
            "pagedserve_kv_slots",
            "token slots of the device blocks used by sequences: "
            "holding token states, reserved (empty, to be filled if each request runs to its "
            "max_tokens), or unused (never to be filled: internal fragmentation); and, under a "
            "reservation baseline, fragmented: free slots in runs too short for the waiting "
            "request's reservation (external fragmentation)",
            labels=["state"],
        )
        reserved = min(stats.kv_slots_reserved, referenced_slots - stats.kv_slots_holding_tokens)
        slots.add_metric(["tokens"], stats.kv_slots_holding_tokens)
        slots.add_metric(["reserved"], reserved)
        slots.add_metric(["unused"], max(0, referenced_slots - stats.kv_slots_holding_tokens - reserved))
        slots.add_metric(["fragmented"], stats.kv_slots_fragmented)
        yield slots
        for state, value in (
            ("running", stats.num_running),
            ("waiting", stats.num_waiting),
            ("swapped", stats.num_swapped),
        ):
            yield GaugeMetricFamily(
                f"pagedserve_num_requests_{state}",
                f"{'sequences' if state == 'running' else 'requests'} {state}",
                value=value,
            )
        yield labeled_counter(
            "pagedserve_preemptions",
            "requests preempted, by mode",
            "mode",
            {"swap": stats.num_preemptions_swap, "recompute": stats.num_preemptions_recompute},
        )
        yield labeled_counter(
            "pagedserve_blocks_swapped",
            "KV blocks moved between the device and swap space",
            "direction",
            {"out": stats.blocks_swapped_out, "in": stats.blocks_swapped_in},
        )
        yield labeled_counter(
            "pagedserve_blocks_offloaded",
            "KV blocks written back from the device to the host "
            "cache as the device evicted them, and loaded back for prefix hits",
            "direction",
            {"out": stats.blocks_offloaded, "in": stats.blocks_loaded},
        )
        yield labeled_counter(
            "pagedserve_blocks_on_disk",
            "KV blocks written to files under --kv-cache-dir, read "
            "back into the host cache, and refused when read (no whole file: computed again)",
            "direction",
            {
                "written": stats.blocks_written_to_disk,
                "read": stats.blocks_read_from_disk,
                "refused": stats.disk_reads_refused,
            },
        )
        yield labeled_counter(
            "pagedserve_kv_transfer_blocks",
            "prefill/decode disaggregation: KV blocks a prefill engine exported for decode engines, and blocks a "
            "decode engine fetched",
            "direction",
            {"sent": stats.blocks_exported, "received": stats.blocks_fetched},
        )
        yield labeled_counter(
            "pagedserve_kv_transfer_failures",
            "prefill/decode disaggregation: fetches that failed (the decode engine computed those blocks), and "
            "exports freed after their hold time with no decode engine's release",
            "kind",
            {"fetch_failed": stats.fetches_failed, "hold_expired": stats.holds_expired},
        )
        yield GaugeMetricFamily(
            "pagedserve_kv_transfer_held_blocks",
            "prefill/decode disaggregation: device blocks a prefill engine holds for decode engines to fetch",
            value=stats.blocks_held_for_fetch,
        )
        yield labeled_counter(
            "pagedserve_prefix_cache_tier_hits",
            "prompt tokens requests started on from cached "
            "blocks, by the tier that held them (counted at every start, a recomputed one again)",
            "tier",
            {"device": stats.prefix_hits_device_tokens, "host": stats.prefix_hits_host_tokens},
        )
        counters: dict[str, tuple[str, float]] = {
            "blocks_copied": ("KV blocks copied on write (a shared block written)", stats.blocks_copied),
            "tokens_scheduled": ("prompt and decode tokens run through the model", stats.tokens_scheduled),
            "steps": ("steps scheduled", stats.num_steps),
            "prompt_tokens_computed": (
                "prompt tokens run through the model (again after a recompute)",
                stats.num_prompt_tokens_computed,
            ),
            "prefix_cache_queries": (
                "prompt tokens looked up in the prefix cache, once per request",
                stats.prefix_cache_queries,
            ),
            "prefix_cache_hits": (
                "prompt tokens found in the prefix cache, once per request",
                stats.num_prompt_tokens_cached,
            ),
            "worker_busy_seconds": ("time rank 0 spent computing steps", stats.worker_busy_seconds),
            "worker_waiting_seconds": (
                "time rank 0 waited for its next step while the scheduler had work (overhead, not idleness)",
                stats.worker_waiting_seconds,
            ),
        }
        for name, (help_text, count) in counters.items():
            yield CounterMetricFamily(f"pagedserve_{name}", help_text, value=count)
        if stats.lora is not None:
            yield from lora_metrics(stats.lora)
        served = CounterMetricFamily(
            "pagedserve_served_tokens",
            "prompt tokens computed and output tokens sampled, "
            "by tenant and priority class (as pagedserve_request_queue_time_seconds)",
            labels=["tenant", "priority", "kind"],
        )
        for (tenant, priority), (prompt, output) in stats.served.items():
            served.add_metric([tenant, priority, "prompt"], prompt)
            served.add_metric([tenant, priority, "output"], output)
        yield served
        if stats.speculation is not None:
            yield from speculation_metrics(stats.speculation)


def speculation_metrics(stats: SpeculationStats) -> Iterator[Metric]:
    """vLLM's counters of speculative decoding, under our prefix. The acceptance rate is
    rate(..._num_accepted_tokens_total) / rate(..._num_draft_tokens_total), the mean acceptance
    length 1 + rate(..._num_accepted_tokens_total) / rate(..._num_drafts_total)."""
    for name, help_text, value in (
        ("num_drafts", "sequences' proposals verified, one per sequence and step", stats.num_drafts),
        ("num_draft_tokens", "proposed tokens verified", stats.num_draft_tokens),
        ("num_accepted_tokens", "proposed tokens the target model accepted", stats.num_accepted_tokens),
    ):
        yield CounterMetricFamily(f"pagedserve_spec_decode_{name}", help_text, value=value)
    yield labeled_counter(
        "pagedserve_spec_decode_num_accepted_tokens_per_pos",
        "proposals accepted, by their position in the sequence's proposals (from 0)",
        "position",
        {str(position): value for position, value in enumerate(stats.accepted_per_position)},
    )
    yield labeled_counter(
        "pagedserve_spec_decode_steps",
        "steps by whether they speculated (chosen by what each choice gave lately at the batch's size)",
        "choice",
        {"speculate": stats.steps_speculating, "plain": stats.steps_plain},
    )


def lora_metrics(lora: LoraStats) -> Iterator[Metric]:
    """With --enable-lora: adapters and their pages in the device pool, loads and evictions, requests by adapter."""
    yield GaugeMetricFamily(
        "pagedserve_lora_adapters", "LoRA adapters with pages in the device pool", value=lora.on_device
    )
    yield GaugeMetricFamily("pagedserve_lora_pages", "device blocks LoRA adapters' pages take", value=lora.pages)
    yield labeled_counter(
        "pagedserve_lora_adapter_loads",
        "LoRA adapters loaded into pages of the device pool, and evicted from it",
        "event",
        {"load": lora.loads, "eviction": lora.evictions},
    )
    yield labeled_counter(
        "pagedserve_lora_requests",
        "requests admitted, by the adapter they run under (base: none; other: past --max-cpu-loras names)",
        "adapter",
        {name or "base": count for name, count in lora.requests.items()},
    )


def labeled_counter(name: str, help_text: str, label: str, values: dict[str, float]) -> CounterMetricFamily:
    family = CounterMetricFamily(name, help_text, labels=[label])
    for label_value, value in values.items():
        family.add_metric([label_value], value)
    return family
