"""Bringing requests back and starting new ones, strictly in rank order: a swapped request swaps in, a waiting one
starts from its prefix-cache hits as the KV cache manager plans it (starts.py), once the KV connectors loaded what
they could from outside (block files, another engine), its adapter's pages acquired, within the step's budgets."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from services.scheduler.kv_records import PrefixMatch
from services.scheduler.request import RequestStatus

if TYPE_CHECKING:
    from services.scheduler.admission import Budgets
    from services.scheduler.kv_cache_manager import KVCacheManager
    from services.scheduler.planner import StepPlan, StepPlanner
    from services.scheduler.policy import SchedulingPolicy
    from services.scheduler.preemption import Preemption
    from services.scheduler.request import Request, Sequence
    from services.scheduler.request_queue import RequestQueues
    from services.scheduler.reservation import Reservation
    from services.scheduler.starts import StartPlan
    from services.scheduler.statistics import SchedulerStatistics


class Resumption:
    def __init__(
        self,
        kv_cache: KVCacheManager,
        budgets: Budgets,
        queues: RequestQueues,
        planner: StepPlanner,
        preemption: Preemption,
        policy: SchedulingPolicy,
        statistics: SchedulerStatistics,
        reservation: Reservation,
        reserved_blocks: Callable[[Request], int],
    ):
        self.kv_cache, self.budgets, self.queues, self.planner = kv_cache, budgets, queues, planner
        self.preemption, self.policy, self.statistics = preemption, policy, statistics
        self.reservation, self.reserved_blocks = reservation, reserved_blocks

    def could_resume(self, request: Request) -> bool:
        """Whether a waiting or swapped request has the seats and blocks to start now (before the running
        requests take this step's slots)."""
        if self.queues.num_running_seats() + request.num_seats > self.budgets.max_num_seqs:
            return False
        if request.status is RequestStatus.SWAPPED:
            return self.kv_cache.can_swap_in(request)
        return self._plan_start(request, self.budgets.max_num_batched_tokens) is not None

    def resume(self, plan: StepPlan, starts_prompts: bool = True, only_head: bool = False) -> None:
        """Bring back swapped requests and start waiting ones (where `starts_prompts`), strictly in rank
        order; with `only_head`, no prompt after the first: the step that starts an outranking request
        stays short."""
        while (request := self.queues.next_to_resume()) is not None:
            if self.queues.num_running_seats() + request.num_seats > self.budgets.max_num_seqs:
                break
            if request.status is RequestStatus.SWAPPED:
                if self.kv_cache.can_swap_in(request):
                    self.queues.swapped.pop(0)
                    self.kv_cache.swap_in(request)
                    self.queues.run(request)
                    wants = self.planner.wants(request, self.planner.room(request, plan), plan)
                    if wants and self.kv_cache.can_append(wants):
                        self.planner.take(wants, plan)
                    continue
                if self.queues.running:
                    break  # they will finish and free blocks
                self.preemption.recompute_instead(request)  # it cannot come back even into an idle pool
                continue
            if not starts_prompts or plan.tokens_left <= 0 or not self._start(request, plan) or only_head:
                break

    def _plan_start(self, request: Request, budget: int) -> StartPlan | None:
        """Its start on the blocks the engine holds (what is still to load from outside, `ready_to_start`)."""
        return self.kv_cache.plan_start(
            request,
            budget,
            self.budgets.chunked_prefill,
            self.reserved_blocks(request),
            watermark=self.reservation.paged,
            disk=False,
        )

    def _start(self, request: Request, plan: StepPlan) -> bool:
        if not self.kv_cache.connectors.ready_to_start(request):
            return False  # blocks of its prompt are on their way in (from disk, another engine): it starts on them
        start = self._plan_start(request, self.planner.room(request, plan))
        if start is None:
            return False
        self.queues.waiting.popleft()
        self.queues.run(request)
        leader = start.leader
        self._begin(leader, start.hits, from_cache=True)
        self.kv_cache.acquire_adapter(request)  # after its hits are held: loading the adapter evicts none of them
        self.kv_cache.reserve(leader, self.reserved_blocks(request))
        self.planner.take([(leader, start.num_tokens)] if start.num_tokens else [], plan)
        for seq, n in start.followers:
            self._begin(seq, PrefixMatch.on_device(leader.kv.block_table[: start.shared_blocks]), from_cache=False)
            self.planner.take([(seq, n)] if n else [], plan)
        # The prompt's cost counts when it is admitted, so that the next admission of this step sees it.
        self.policy.served(request, leader.num_tokens - leader.kv.num_computed, 0)
        if self.policy.ranks_by_service:
            self.queues.rerank_waiting()
        return True

    def _begin(self, seq: Sequence, computed: PrefixMatch, from_cache: bool) -> None:
        self.kv_cache.start(seq, computed)
        if from_cache:
            self.statistics.started(seq, computed)
