"""The scheduler's periodic log line: throughput, queues, KV blocks and prefix-cache use."""

from __future__ import annotations

import logging
import time

from services.scheduler.stats import Stats

log = logging.getLogger("pagedserve.stats")


class StatsLog:
    """Writes one line per interval in which anything happened; silent while idle."""

    def __init__(self, interval: float):
        self.interval = interval
        self.generated = 0  # tokens sampled
        self.last_time = time.monotonic()
        self.last: tuple[int, int, int] = (0, 0, 0)  # prompt computed, prompt cached, generated

    def count(self, sampled: int) -> None:
        if self.generated == self.last[2]:  # the first tokens after a quiet spell: rates start now
            self.last_time = time.monotonic()
        self.generated += sampled

    def due_in(self) -> float | None:
        """Seconds until the next line is due, or None when there is nothing to report."""
        if self.interval <= 0 or self.generated == self.last[2]:
            return None
        return max(0.0, self.last_time + self.interval - time.monotonic())

    def write(self, stats: Stats) -> None:
        now = time.monotonic()
        elapsed = max(now - self.last_time, 1e-9)
        computed, cached, generated = stats.num_prompt_tokens_computed, stats.num_prompt_tokens_cached, self.generated
        new_computed, new_cached = computed - self.last[0], cached - self.last[1]
        used = stats.num_used_gpu_blocks
        hit_rate = new_cached / (new_computed + new_cached) if new_computed + new_cached else 0.0
        log.info(
            "prompt %.1f tok/s, generation %.1f tok/s; running %d, waiting %d, swapped %d; KV blocks %d/%d used "
            "(%.1f%%), %d cached; swap %d/%d used; prefix cache hits %.1f%% of prompt tokens; preemptions %d swap, "
            "%d recompute",
            new_computed / elapsed,
            (generated - self.last[2]) / elapsed,
            stats.num_running,
            stats.num_waiting,
            stats.num_swapped,
            used,
            stats.num_gpu_blocks,
            100 * used / max(stats.num_gpu_blocks, 1),
            stats.num_cached_gpu_blocks,
            stats.num_cpu_blocks - stats.num_free_cpu_blocks,
            stats.num_cpu_blocks,
            100 * hit_rate,
            stats.num_preemptions_swap,
            stats.num_preemptions_recompute,
        )
        self.last_time, self.last = now, (computed, cached, generated)
