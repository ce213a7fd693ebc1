"""What the scheduler has done, for its metrics and its log line: an observer that the scheduler tells of each
start, step, preemption and service, and that reads the queues and the KV cache manager's counts (never its
pools) when a snapshot (`Stats`) is asked for."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from services.scheduler.admission import Budgets
from services.scheduler.kv_cache_manager import KVCacheManager
from services.scheduler.kv_records import PrefixMatch
from services.scheduler.policy import TenantLabels, priority_class
from services.scheduler.request import Request, Sequence
from services.scheduler.request_queue import RequestQueues
from services.scheduler.speculation import Speculation
from services.scheduler.stats import Stats


@dataclass(slots=True)
class Counters:
    """What the scheduler has done since it started."""

    preemptions_swap: int = 0
    preemptions_recompute: int = 0
    steps: int = 0
    prompt_tokens_computed: int = 0
    prompt_tokens_cached: int = 0  # counted once per request
    prompt_tokens_queried: int = 0  # looked up in the prefix cache, once per request
    # prompt tokens a request started on from cached blocks, by tier (counted at every start)
    hits_device_tokens: int = 0
    hits_host_tokens: int = 0
    tokens_scheduled: int = 0
    # (tenant label, priority class) -> [prompt tokens computed, output positions sampled]
    served: dict[tuple[str, str], list[int]] = field(default_factory=dict)


class SchedulerStatistics:
    def __init__(
        self,
        kv_cache: KVCacheManager,
        queues: RequestQueues,
        budgets: Budgets,
        speculation: Speculation | None,
        clock: Callable[[], float],
        reserved_blocks: Callable[[Request], int] | None = None,
    ):
        self.kv_cache, self.queues, self.budgets, self.speculation, self.clock = (
            kv_cache,
            queues,
            budgets,
            speculation,
            clock,
        )
        self.reserved_blocks = reserved_blocks  # under a reservation baseline: the blocks it holds for a request
        self.counters = Counters()
        # (seconds, tenant label, priority class) of requests started since the server last took them
        self.queue_times: list[tuple[float, str, str]] = []
        self.tenant_labels = TenantLabels()

    def started(self, seq: Sequence, computed: PrefixMatch) -> None:
        """A sequence started on `computed` blocks found in the prefix cache."""
        counters, size = self.counters, self.kv_cache.block_size
        loads = computed.num_loads
        counters.hits_device_tokens += (computed.num_blocks - loads) * size
        counters.hits_host_tokens += loads * size
        request = seq.request
        if request.first_scheduled is None:
            request.first_scheduled = self.clock()
            self.queue_times.append(
                (
                    request.first_scheduled - request.received,
                    self.tenant_labels(request.tenant),
                    priority_class(request.priority),
                )
            )
        if not request.looked_up and self.kv_cache.caching:
            request.looked_up = True
            counters.prompt_tokens_queried += request.num_prompt_tokens
        cached = min(seq.kv.num_computed, request.num_prompt_tokens)
        # Counted once per request: a recomputed request that hits its own blocks again is no new hit.
        counters.prompt_tokens_cached += max(0, cached - request.num_cached_prompt_tokens)
        request.num_cached_prompt_tokens = max(request.num_cached_prompt_tokens, cached)

    def served(self, request: Request, prompt_tokens: int, output_tokens: int) -> None:
        label = (self.tenant_labels(request.tenant), priority_class(request.priority))
        served = self.counters.served.get(label)
        if served is None:
            served = self.counters.served[label] = [0, 0]
        served[0] += prompt_tokens
        served[1] += output_tokens

    def stepped(self, prompt_tokens_computed: int, tokens_scheduled: int) -> None:
        counters = self.counters
        counters.prompt_tokens_computed += prompt_tokens_computed
        counters.tokens_scheduled += tokens_scheduled
        counters.steps += 1

    def load(self) -> tuple[int, int, float]:
        """Requests running (or swapped out), requests waiting, and the share of device blocks in use."""
        queues = self.queues
        return len(queues.running) + len(queues.swapped), len(queues.waiting), self.kv_cache.device_use()

    def stats(self) -> Stats:
        queues, counters = self.queues, self.counters
        holding, reserved = self._slot_use()
        return Stats(
            **self.kv_cache.stats(),
            num_running=sum(len(r.seqs) for r in queues.running),
            num_waiting=len(queues.waiting),
            num_swapped=len(queues.swapped),
            num_preemptions_swap=counters.preemptions_swap,
            num_preemptions_recompute=counters.preemptions_recompute,
            num_steps=counters.steps,
            num_prompt_tokens_computed=counters.prompt_tokens_computed,
            num_prompt_tokens_cached=counters.prompt_tokens_cached,
            prefix_hits_device_tokens=counters.hits_device_tokens,
            prefix_hits_host_tokens=counters.hits_host_tokens,
            tokens_scheduled=counters.tokens_scheduled,
            kv_slots_holding_tokens=holding,
            kv_slots_reserved=reserved,
            kv_slots_fragmented=self._fragmented_blocks() * self.kv_cache.block_size,
            prefix_cache_queries=counters.prompt_tokens_queried,
            speculation=self.speculation.snapshot() if self.speculation is not None else None,
            lora=self.kv_cache.lora_stats(),
            served={label: (prompt, output) for label, (prompt, output) in counters.served.items()},
        )

    def _fragmented_blocks(self) -> int:
        """While a request waits to start under a reservation baseline, the free blocks in runs too
        short for its reservation; none under paging, where any free block will do."""
        if self.reserved_blocks is None or not self.queues.waiting:
            return 0
        return self.kv_cache.fragmented_blocks(self.reserved_blocks(self.queues.waiting[0]))

    def _slot_use(self) -> tuple[int, int]:
        """Slots of the device's referenced blocks that hold token states (over all referenced slots:
        the paper's KV utilization), and those still empty that the request would fill by its
        max_tokens; a block shared by several sequences counted once."""
        held: dict[int, int] = {}
        wanted: dict[int, int] = {}
        size, context = self.kv_cache.block_size, self.budgets.max_model_len
        for request in self.queues.running:
            final = min(request.num_prompt_tokens + request.sampling.max_tokens, context)
            for seq in request.seqs:
                for i, block in enumerate(seq.kv.block_table):
                    held[block] = max(held.get(block, 0), min(size, max(0, seq.kv.num_computed - i * size)))
                    wanted[block] = max(wanted.get(block, 0), min(size, max(0, final - i * size)))
        holding = sum(held.values())
        return holding, sum(max(0, wanted[b] - held[b]) for b in held)
