"""A snapshot of the scheduler's queues, KV pools and counters, for its metrics and its log line."""

from __future__ import annotations

from dataclasses import dataclass, field

from services.scheduler.speculation import SpeculationStats


@dataclass(slots=True)
class LoraStats:
    """LoRA adapters in the device pool."""

    on_device: int  # adapters with pages in the pool
    pages: int  # blocks those pages take
    loads: int  # adapters loaded into pages, since the start
    evictions: int  # adapters whose pages went back to the pool
    requests: dict[str, int]  # adapter name ("" the base model, "other" past the label limit) -> requests admitted


@dataclass(slots=True)
class Stats:
    num_gpu_blocks: int
    num_free_gpu_blocks: int  # free, not counting cached-and-evictable ones
    num_cached_gpu_blocks: int  # cached and evictable: reusable by a prefix hit
    num_cpu_blocks: int
    num_free_cpu_blocks: int
    num_running: int
    num_waiting: int
    num_swapped: int
    num_preemptions_swap: int
    num_preemptions_recompute: int
    num_steps: int
    num_prompt_tokens_computed: int
    num_prompt_tokens_cached: int
    worker_busy_seconds: float = 0.0  # rank 0's time computing steps
    worker_waiting_seconds: float = 0.0  # rank 0's time between steps while the scheduler had work
    blocks_swapped_out: int = 0
    blocks_swapped_in: int = 0
    blocks_copied: int = 0  # copy-on-write copies
    blocks_offloaded: int = 0  # device -> host cache, as the device evicted cached blocks
    blocks_loaded: int = 0  # host cache -> device, for prefix hits
    blocks_written_to_disk: int = 0  # with --kv-cache-dir
    blocks_read_from_disk: int = 0
    disk_reads_refused: int = 0  # no whole file for the key: computed again
    num_disk_blocks: int = 0
    # Prefill/decode disaggregation: blocks exported to decode engines, and fetched from prefill engines; fetches
    # that failed (their blocks computed); exports no decode engine released in time; blocks held for fetches now.
    blocks_exported: int = 0
    blocks_fetched: int = 0
    fetches_failed: int = 0
    holds_expired: int = 0
    blocks_held_for_fetch: int = 0
    disk_capacity_blocks: int = 0
    num_host_cache_blocks: int = 0  # with --kv-offloading-size
    num_cached_host_blocks: int = 0
    prefix_hits_device_tokens: int = 0  # prompt tokens started on from cached blocks, per start, by tier
    prefix_hits_host_tokens: int = 0
    tokens_scheduled: int = 0  # over all steps: prompt and decode tokens run through the model
    kv_slots_holding_tokens: int = 0  # in the device blocks referenced now, a shared block once
    kv_slots_reserved: int = 0  # in those blocks, empty but to be filled if each request runs to max_tokens
    kv_slots_fragmented: int = 0  # in free blocks, between reservations and too few for the next one
    block_size: int = 0
    prefix_cache_queries: int = 0  # prompt tokens looked up in the prefix cache, once per request
    speculation: SpeculationStats | None = None  # with --speculative-config
    lora: LoraStats | None = None  # with --enable-lora
    # (tenant label, priority class) -> (prompt tokens computed, output tokens sampled)
    served: dict[tuple[str, str], tuple[int, int]] = field(default_factory=dict)

    @property
    def num_used_gpu_blocks(self) -> int:
        """Device blocks referenced by sequences: neither free nor only cached."""
        return self.num_gpu_blocks - self.num_free_gpu_blocks - self.num_cached_gpu_blocks
