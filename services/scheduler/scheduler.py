"""Continuous batching with whole-request preemption, in the order of a scheduling policy.

Each call to `schedule` decides one iteration. Running requests come first (one token per
sequence for a decode, a chunk for a prompt), then preempted and new requests resume in
rank order, swapped and waiting alike, while the token, sequence and block budgets allow.
When a running request needs blocks that are not there, the lowest-ranked running request is
preempted, all its sequences together: swapped to the worker's CPU memory, or freed and
recomputed later from its tokens. The rank is the policy's (services/scheduler/policy.py):
arrival order under FCFS, the default, which the rest of this says.

Liveness: admission refuses a request whose samples could together outgrow the pool, so the
earliest request, alone, always fits. Every running request arrived before every waiting or
swapped one, so the earliest request is either running (scheduled first, never a victim) or
resumes as soon as nothing runs; it gains at least one token per step. A swapped request that
cannot come back even then is recomputed instead. Under the other policies a request ranks by
arrival once it is older than the policy's queue delay, and a waiting request that outranks a
running one may preempt it to start: once every request present is that old, this is FCFS.

The parts: request_queue.py, starts.py (behind the KV cache manager), preemption.py, planner.py (budgets,
planning ahead, speculation), steps_in_flight.py, quarantine.py (failed steps) and statistics.py.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from services.scheduler.admission import Admission, Budgets, ConfigError
from services.scheduler.kv_cache_manager import KVCacheManager
from services.scheduler.planner import StepPlan, StepPlanner, in_prompt
from services.scheduler.policy import Rank, SchedulingPolicy
from services.scheduler.preemption import Preemption, PreemptionPolicy
from services.scheduler.quarantine import MAX_FAILURES, StepFailures
from services.scheduler.request import Request, RequestStatus
from services.scheduler.request_queue import RequestQueues
from services.scheduler.reservation import Reservation
from services.scheduler.results import ResultProcessor, error_output
from services.scheduler.resumption import Resumption
from services.scheduler.sequences import SequenceRegistry
from services.scheduler.speculation import Speculation
from services.scheduler.statistics import SchedulerStatistics
from services.scheduler.stats import Stats
from services.scheduler.steps_in_flight import StepsInFlight
from services.scheduler.stopping import StopRule
from shared.protocol import AddRequest, PoolingSpec, RequestOutput, SequenceDelta, Step, StepResult
from shared.sampling import InvalidParameter

__all__ = ["Budgets", "ConfigError", "PreemptionPolicy", "Scheduler"]

log = logging.getLogger(__name__)


class Scheduler:
    def __init__(
        self,
        kv_cache: KVCacheManager,
        budgets: Budgets,
        eos_token_ids: list[int],
        preemption: PreemptionPolicy | None = None,
        vocab_size: int | None = None,
        reservation: Reservation | None = None,
        speculation: Speculation | None = None,
        policy: SchedulingPolicy | None = None,
        clock: Callable[[], float] = time.monotonic,
    ):
        budgets.check()
        self.reservation = reservation or Reservation()
        if not self.reservation.paged and kv_cache.caching:
            raise ConfigError(
                f"--kv-reservation {self.reservation.policy} is a baseline without sharing: "
                "it cannot run with prefix caching"
            )
        if not self.reservation.paged and speculation is not None:
            raise ConfigError(f"--kv-reservation {self.reservation.policy} is a baseline: it does not speculate")
        self.kv_cache = kv_cache
        self.budgets = budgets
        self.policy = policy or SchedulingPolicy()
        self.clock = clock
        self.admission = Admission(budgets, kv_cache, self.reservation, vocab_size or None, self.policy)
        self.speculation = speculation
        self.registry = SequenceRegistry(kv_cache, StopRule(frozenset(eos_token_ids), budgets.max_model_len))
        self.results = ResultProcessor(self.registry, kv_cache)
        self.queues = RequestQueues(self.policy)
        self.statistics = SchedulerStatistics(
            kv_cache,
            self.queues,
            budgets,
            speculation,
            clock,
            None if self.reservation.paged else self._reserved_blocks,
        )
        self.preemption = Preemption(
            preemption or PreemptionPolicy(), self.queues, kv_cache, self.registry, self.statistics.counters
        )
        self.planner = StepPlanner(budgets, kv_cache, self.queues, speculation)
        self.in_flight = StepsInFlight(kv_cache, self.registry, self.policy, self.statistics)
        self.failures = StepFailures(self.registry, self.queues, self.preemption)
        self.resumption = Resumption(
            kv_cache,
            budgets,
            self.queues,
            self.planner,
            self.preemption,
            self.policy,
            self.statistics,
            self.reservation,
            self._reserved_blocks,
        )
        self.needs_drain = False  # the last plan stopped short of a preemption
        self.pooling: PoolingSpec | None = None  # the workers pool prompts (--runner pooling): what they give
        self._next_order = 0
        # Views for the server and the tests (each object is its owner's, changed in place only)
        self.requests, self.sequences = self.registry.requests, self.registry.sequences
        self.waiting, self.running, self.swapped = self.queues.waiting, self.queues.running, self.queues.swapped
        self.counters, self.queue_times = self.statistics.counters, self.statistics.queue_times

    # --- requests coming in --------------------------------------------------------------

    def add(self, message: AddRequest) -> RequestOutput | None:
        """Queue a request; returns an error output instead if it can never run."""
        problem: str | None
        try:
            if message.request_id in self.requests:
                problem = f"request id {message.request_id!r} is already in use"
            else:
                problem = self.admission.problem(message)
        except InvalidParameter as exc:
            problem = f"{exc.param}: {exc}"
        if problem is None and bool(message.sampling.pooling) != (self.pooling is not None):
            problem = "this model pools prompts: it does not generate" if self.pooling else "this model does not pool"
        if problem is not None:
            return error_output(message.request_id, len(message.prompt_token_ids), problem, "rejected")
        request = Request(
            message.request_id,
            list(message.prompt_token_ids),
            message.sampling,
            message.arrival_time,
            self._next_order,
            message.cache_salt,
            message.priority,
            message.tenant,
            self.clock(),
            message.lora,
        )
        request.whole_prompt = self.pooling is not None and self.pooling.needs_every_token
        request.kv_send, request.kv_source = message.kv_send, message.kv_source
        self._next_order += 1
        self.kv_cache.count_request(request)
        self.registry.add(request)
        self.policy.arrived(request)
        self.queues.wait(request)
        return None

    def abort(self, request_id: str) -> RequestOutput | None:
        request = self.requests.get(request_id)
        if request is None:
            return None
        self.finish_request(request)
        deltas = [SequenceDelta(i, [], [], [], "abort") for i in range(request.sampling.n)]
        return RequestOutput(request_id, request.num_prompt_tokens, deltas, True)

    def _reserved_blocks(self, request: Request) -> int:
        return self.admission.reserved_blocks(request.num_prompt_tokens, request.sampling)

    # --- one iteration -------------------------------------------------------------------

    def has_work(self) -> bool:
        return self.queues.has_work()

    def schedule(self) -> Step | None:
        """Decide the next step, or None when there is nothing to run."""
        budget = self.budgets.max_num_batched_tokens
        preempted = False
        ahead = bool(self.in_flight)
        self.needs_drain = False
        if ahead and self.policy.reorders and self.planner.prompt_heavy():
            self.needs_drain = True
            return None
        speculating = self.speculation is not None and self.speculation.decide(self.planner.num_decoding())
        self.policy.begin_step(self.clock())
        self.queues.rerank()
        plan = StepPlan(budget, self.policy.prompt_budget(budget), speculating)
        held, head_rank = self._make_room_for_head(ahead)

        queue = list(self.running)
        next_index, end = 0, len(queue)  # victims are taken from the end
        while next_index < end:
            request = queue[next_index]
            next_index += 1
            if held and self.policy.rank(request) > head_rank and in_prompt(request):
                continue  # the head it ranks below starts first, in a step no longer for this chunk
            wants = self.planner.wants(request, self.planner.room(request, plan) - held, plan)
            if not wants:
                continue
            if ahead and not self.kv_cache.can_append(wants):
                self.needs_drain = True
                break
            while not self.kv_cache.can_append(wants):
                if end > next_index:
                    end -= 1
                    victim = queue[end]
                else:
                    victim = request
                self.preemption.preempt(victim)
                preempted = True
                if victim is request:
                    break
            if request.status is RequestStatus.RUNNING:
                self.planner.take(wants, plan)

        if not (preempted and self.running) and not self.needs_drain:  # the head resumes once nothing runs
            results_in = self.in_flight.results_in
            self.resumption.resume(
                plan,
                starts_prompts=not ahead
                or bool(held)
                or self.planner.deferred(results_in)
                or self.planner.prompts_fill(plan.tokens_left, results_in),
                only_head=bool(held),
            )

        if not (plan.scheduled or self.kv_cache.has_transfers or (self.kv_cache.reads_pending and not ahead)):
            return None  # with reads from disk pending and no step in flight, an empty step hears of them
        step = self.in_flight.build(plan.scheduled, plan.speculating)
        if self.speculation is not None:
            self.speculation.built(plan.speculating)
        return step

    def _make_room_for_head(self, ahead: bool) -> tuple[int, Rank]:
        """Under a policy that reorders, for the first request to resume while it outranks the lowest-ranked
        running one: while it does not fit and the policy says so, preempt that one (not in a step planned
        ahead: the steps in flight drain first). A waiting one that fits starts in this step, even one
        planned ahead: the tokens of its prompt are held back from the running requests, and no prompt it
        outranks runs in this step, so that the step is short. Returns those tokens and its rank, or
        (0, ()) when nothing is held."""
        if not self.policy.reorders:
            return 0, ()
        rank = self.policy.rank
        while self.running and (head := self.queues.next_to_resume()) is not None:
            head_rank = rank(head)
            if not head_rank < rank(self.queues.lowest_running()):
                break
            if self.resumption.could_resume(head):
                if head.status is RequestStatus.WAITING:
                    return min(head.seqs[0].num_tokens, self.budgets.max_num_batched_tokens), head_rank
                break
            if not self.policy.preempts(head, self.running):
                break
            if ahead:
                self.needs_drain = True
                break
            self.preemption.preempt(self.queues.lowest_running())
        return 0, ()

    # --- sequences and requests ending ---------------------------------------------------

    def finish_request(self, request: Request) -> None:
        self.registry.release(request)
        self._dequeue(request)
        self.failures.ended(request)

    def _dequeue(self, request: Request) -> None:
        self.kv_cache.release_adapter(request)
        self.kv_cache.connectors.forget(request)
        self.queues.take(request)
        if request.status is not RequestStatus.FINISHED:
            self.policy.left(request)
        request.status = RequestStatus.FINISHED

    def recover(self, step_id: int, error: str, culprits: list[int]) -> list[RequestOutput]:
        """A step failed on the worker, which forgot every sequence: the requests that made it fail end, every
        other request is recomputed (services/scheduler/quarantine.py)."""
        failed = self.in_flight.take(step_id)
        self.in_flight.forget()
        ending = self.failures.failed(failed.scheduled if failed is not None else [], culprits)
        if ending is None:
            return self.fail_all(f"the worker failed {MAX_FAILURES} steps in a row and restarts; the last: {error}")
        for request in ending:
            self.finish_request(request)
        self.failures.recompute_the_rest()
        return [
            error_output(r.request_id, r.num_prompt_tokens, f"the worker failed on this request: {error}", "rejected")
            for r in ending
        ]  # its own inputs: a 4xx, not a server error

    def fail_all(self, error: str) -> list[RequestOutput]:
        """End every request: the worker could not run a step."""
        outputs: list[RequestOutput] = []
        self.in_flight.forget()
        for request in list(self.requests.values()):
            self.finish_request(request)
            outputs.append(error_output(request.request_id, request.num_prompt_tokens, error, "error"))
        return outputs

    def update(self, result: StepResult, worker_wait_ms: float = 0.0) -> list[RequestOutput]:
        """Apply a step's result; steps' results come in the order the steps were planned.
        `worker_wait_ms`: how long the worker waited for this step while the scheduler had work."""
        step = self.in_flight.settle(result.step_id)
        if step is None:
            return []
        self.kv_cache.connectors.on_result(result)
        self.failures.ran(step.scheduled)
        applied = self.results.apply(result, step.scheduled, step.drafts)
        for request in applied.ended:
            self._dequeue(request)
        for output in applied.outputs:
            if output.finished:
                output.kv_handoff = self.kv_cache.remote.handoff(output.request_id)
        if self.speculation is not None:
            self.speculation.verified(applied.verified)
            if not step.has_prompt_tokens:  # a prompt's cost would hide what speculating costs
                self.speculation.observe(
                    step.num_decoding,
                    step.speculated,
                    applied.num_tokens,
                    result.forward_ms + result.sample_ms + worker_wait_ms,
                )
        return applied.outputs

    # --- what the metrics read -------------------------------------------------------------

    def load(self) -> tuple[int, int, float]:
        """Requests running (or swapped out), requests waiting, and the share of device blocks in use."""
        return self.statistics.load()

    def stats(self) -> Stats:
        return self.statistics.stats()
