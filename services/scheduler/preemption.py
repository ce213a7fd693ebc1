"""Preemption: a running request gives back all its blocks, every sequence together, when a request ahead of it
needs them. It is swapped out to the worker's host memory (its blocks come back as they were) or dropped and
recomputed later from its tokens, whichever `PreemptionPolicy` says costs less; a swapped request that cannot
come back even into an idle pool is recomputed instead (`recompute_instead`)."""

from __future__ import annotations

import logging
from dataclasses import dataclass

from services.scheduler.kv_cache_manager import KVCacheManager
from services.scheduler.request import Request
from services.scheduler.request_queue import RequestQueues
from services.scheduler.sequences import SequenceRegistry
from services.scheduler.statistics import Counters

log = logging.getLogger("services.scheduler.scheduler")


@dataclass(slots=True)
class PreemptionPolicy:
    """`auto` compares the measured cost of moving a request's blocks out and back in with
    the cost of recomputing its tokens."""

    mode: str = "auto"  # swap | recompute | auto (--preemption-mode's default)
    block_bytes: int = 0
    swap_bytes_per_second: float = 0.0
    prefill_tokens_per_second: float = 0.0

    def prefers_swap(self, num_blocks: int, num_tokens: int) -> bool:
        if self.mode != "auto":
            return self.mode == "swap"
        if self.swap_bytes_per_second <= 0 or self.prefill_tokens_per_second <= 0:
            return False
        swap_seconds = 2 * num_blocks * self.block_bytes / self.swap_bytes_per_second
        return swap_seconds < num_tokens / self.prefill_tokens_per_second


class Preemption:
    def __init__(
        self,
        policy: PreemptionPolicy,
        queues: RequestQueues,
        kv_cache: KVCacheManager,
        registry: SequenceRegistry,
        counters: Counters,
    ):
        self.policy, self.queues, self.kv_cache = policy, queues, kv_cache
        self.registry, self.counters = registry, counters

    def preempt(self, request: Request) -> None:
        """A running request off the running queue, swapped out or back to waiting."""
        # Alone and still short of blocks (its samples' copies of a shared block): swapping out
        # and back in would give the same state, while a recompute starts its samples unshared.
        alone = self.queues.running == [request]
        self.queues.running.remove(request)
        manager = self.kv_cache
        num_blocks = manager.num_blocks_held(request)
        num_tokens = sum(seq.kv.num_computed for seq in request.seqs)
        for seq in request.seqs:
            seq.flight.drop_drafts()
        if not alone and self.policy.prefers_swap(num_blocks, num_tokens) and manager.can_swap_out(request):
            log.info("preempting %s by swapping %d blocks out", request.request_id, num_blocks)
            self.counters.preemptions_swap += 1
            self.queues.swap_out(request)
            manager.swap_out(request)
            return
        log.info("preempting %s by recompute", request.request_id)
        self.counters.preemptions_recompute += 1
        self._recompute(request)

    def recompute_instead(self, request: Request) -> None:
        """A swapped request that cannot swap back in, even with nothing running: recomputed instead."""
        log.info("%s cannot swap back in; recomputing it instead", request.request_id)
        self.queues.swapped.remove(request)
        self._recompute(request, release_adapter=False)  # a swapped request holds none

    def recompute(self, request: Request) -> None:
        """A running request (already off the running queue) computed again from its tokens: its step failed."""
        self._recompute(request)

    def _recompute(self, request: Request, release_adapter: bool = True) -> None:
        if release_adapter:
            self.kv_cache.release_adapter(request)
        for seq in request.seqs:
            self.registry.preempt_by_recompute(seq)
        self.queues.wait(request)
