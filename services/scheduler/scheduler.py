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

Planning ahead: `schedule` may be called again before the result of the step in flight is in,
so that the workers never wait for the scheduler. A sequence whose sample that step will bring
is then scheduled at the position of the token not yet known (the worker appends the tokens it
samples itself), unless the sample may change what comes next: beam search, the first sample of
a request that forks, or a sample that may be its last by length. An end by a stop token costs
one wasted position. Nothing is preempted ahead: a running request that finds no blocks ends the
plan, and the next one waits for the steps in flight to finish (`needs_drain`).

Speculation: in a step that speculates (`Speculation` decides which do), each decoding sequence
also runs up to k tokens that the worker proposes, which take blocks only where blocks are free
and never cause a preemption. The worker returns the proposals its model agrees with and one
token after them; the rest of the positions count as not computed again, and their blocks go
back. Until then the scheduler counts every proposal as kept: a step planned ahead schedules a
sequence's next positions as if they all were, with blocks for that many, and the worker, which
knows by then how many were kept, starts the sequence where its tokens end.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from services.scheduler.admission import Admission, Budgets, ConfigError
from services.scheduler.kv_cache_manager import KVCacheManager, PrefixMatch
from services.scheduler.policy import Rank, SchedulingPolicy, TenantLabels, priority_class
from services.scheduler.request import Request, RequestStatus, Sequence
from services.scheduler.reservation import Reservation
from services.scheduler.results import ResultProcessor, error_output
from services.scheduler.sequences import SequenceRegistry
from services.scheduler.speculation import Speculation
from services.scheduler.stats import LoraStats, Stats
from services.scheduler.stopping import StopRule
from shared.protocol import (
    DISK,
    AddRequest,
    NewSequence,
    RequestOutput,
    ScheduledSequence,
    SequenceDelta,
    Step,
    StepResult,
)
from shared.sampling import InvalidParameter

__all__ = ["Budgets", "ConfigError", "PreemptionPolicy", "Scheduler"]

log = logging.getLogger(__name__)


@dataclass(slots=True)
class _InFlight:
    """What the scheduler remembers of a step until its result is in."""

    scheduled: list[Sequence]
    sampled: list[Sequence]  # those the step samples
    num_decoding: int  # sequences that decode in it (not a prompt's chunk)
    speculated: bool
    has_prompt_tokens: bool
    drafts: dict[int, int]  # seq_id -> proposals asked of the worker, counted as computed until settled
    reads: list[bytes]  # keys of the blocks it reads from disk


@dataclass(slots=True)
class Counters:
    """What the scheduler has done since it started, for its metrics (`Stats`)."""

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


@dataclass(slots=True)
class _Plan:
    """The step being planned: what it runs and the tokens it has left, of all and of prompts (its block
    transfers are queued in the KV cache manager)."""

    tokens_left: int
    prompt_cap: int  # the policy's cap on the step's prompt tokens
    prompt_tokens: int = 0  # taken
    scheduled: list[tuple[Sequence, int]] = field(default_factory=list)  # (sequence, positions to compute)


@dataclass(slots=True)
class _StartPlan:
    """How a waiting request starts: its first sequence from its prefix-cache hits, the others
    (a request recomputed after forking) sharing the full blocks they have in common with it."""

    leader: Sequence
    hits: PrefixMatch  # the leader's blocks found in the prefix cache
    num_tokens: int  # the leader's positions to compute now
    shared_blocks: int
    followers: list[tuple[Sequence, int]]


@dataclass(slots=True)
class PreemptionPolicy:
    """`auto` compares the measured cost of moving a request's blocks out and back in with
    the cost of recomputing its tokens."""

    mode: str = "recompute"  # swap | recompute | auto
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
            raise ConfigError(f"--kv-reservation {self.reservation.policy} is a baseline without sharing: "
                              "it cannot run with prefix caching")
        if not self.reservation.paged and speculation is not None:
            raise ConfigError(f"--kv-reservation {self.reservation.policy} is a baseline: it does not speculate")
        self.kv_cache = kv_cache
        self.budgets = budgets
        self.policy = policy or SchedulingPolicy()
        self.clock = clock
        self.admission = Admission(budgets, kv_cache, self.reservation, vocab_size or None, self.policy.name)
        self.preemption = preemption or PreemptionPolicy()
        self.speculation = speculation
        self.registry = SequenceRegistry(kv_cache, StopRule(frozenset(eos_token_ids), budgets.max_model_len))
        self.results = ResultProcessor(self.registry, kv_cache)
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []  # in arrival order
        self.swapped: list[Request] = []  # in arrival order
        self.counters = Counters()
        self.in_flight: dict[int, _InFlight] = {}
        self.results_in = 0  # steps whose results were applied
        self.needs_drain = False  # the last plan stopped short of a preemption
        # (seconds, tenant label, priority class) of requests started since the server last took them
        self.queue_times: list[tuple[float, str, str]] = []
        self.tenant_labels = TenantLabels()
        self._next_order = 0
        self._speculating = False  # whether the step being planned speculates

    @property
    def requests(self) -> dict[str, Request]:
        return self.registry.requests

    @property
    def sequences(self) -> dict[int, Sequence]:
        return self.registry.sequences

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
        if problem is not None:
            return error_output(message.request_id, len(message.prompt_token_ids), problem, "rejected")
        request = Request(message.request_id, list(message.prompt_token_ids), message.sampling,
                          message.arrival_time, self._next_order, message.cache_salt, message.priority,
                          message.tenant, self.clock(), message.lora)
        self._next_order += 1
        if self.kv_cache.adapters is not None:
            self.kv_cache.adapters.count_request(request.lora)
        self.registry.add(request)
        self.policy.arrived(request)
        self._requeue(request)
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
        return bool(self.waiting or self.running or self.swapped)

    def schedule(self) -> Step | None:
        """Decide the next step, or None when there is nothing to run."""
        budget = self.budgets.max_num_batched_tokens
        preempted = False
        ahead = bool(self.in_flight)
        self.needs_drain = False
        if ahead and self.policy.reorders and self._prompt_heavy():
            self.needs_drain = True
            return None
        self._speculating = self.speculation is not None and self.speculation.decide(self._num_decoding())
        self._rank_queues()
        plan = _Plan(budget, self.policy.prompt_budget(budget))
        held, head_rank = self._make_room_for_head(plan, ahead)

        queue = list(self.running)
        next_index, end = 0, len(queue)  # victims are taken from the end
        while next_index < end:
            request = queue[next_index]
            next_index += 1
            if held and self.policy.rank(request) > head_rank and _in_prompt(request):
                continue  # the head it ranks below starts first, in a step no longer for this chunk
            wants = self._within_free_blocks(self._wants(request, self._room(request, plan) - held))
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
                self._preempt(victim)
                preempted = True
                if victim is request:
                    break
            if request.status is RequestStatus.RUNNING:
                self._take(wants, plan)

        if not (preempted and self.running) and not self.needs_drain:  # the head resumes once nothing runs
            self._resume(plan, starts_prompts=not ahead or bool(held) or self._deferred()
                         or self._prompts_fill(plan.tokens_left), only_head=bool(held))

        if not (plan.scheduled or self.kv_cache.has_transfers):
            return None
        return self._build_step(plan)

    def _prompt_heavy(self) -> bool:
        """Whether the next step would be mostly prompts. Under a policy that reorders such a step is not
        planned ahead: one already queued behind the step computing would delay a request arriving now
        that outranks it by a long step more, while planning it after costs the worker only the planning."""
        budget = self.budgets.max_num_batched_tokens
        tokens = sum(max(0, seq.num_prompt_tokens - seq.kv.num_computed)
                     for request in self.running for seq in request.seqs)
        seats = self.budgets.max_num_seqs - self._num_running_seats()
        for request in self.waiting:  # those that could start: as many as there are seats
            if 2 * tokens >= budget or request.num_seats > seats:
                break
            seats -= request.num_seats
            tokens += sum(seq.num_tokens for seq in request.seqs)
        return 2 * tokens >= budget

    def _rank_queues(self) -> None:
        self.policy.begin_step(self.clock())
        if self.policy.reorders:
            self.running.sort(key=self.policy.rank)
            self.swapped.sort(key=self.policy.rank)
            self._rank_waiting()

    def _rank_waiting(self) -> None:
        ranked = sorted(self.waiting, key=self.policy.rank)
        self.waiting.clear()
        self.waiting.extend(ranked)

    def _make_room_for_head(self, plan: _Plan, ahead: bool) -> tuple[int, Rank]:
        """Under a policy that reorders, for the first request to resume while it outranks the lowest-ranked
        running one: while it does not fit and the policy says so, preempt that one (not in a step planned
        ahead: the steps in flight drain first). A waiting one that fits starts in this step, even one
        planned ahead: the tokens of its prompt are held back from the running requests, and no prompt it
        outranks runs in this step, so that the step is short. Returns those tokens and its rank, or
        (0, ()) when nothing is held."""
        if not self.policy.reorders:
            return 0, ()
        rank = self.policy.rank
        while self.running and (head := self._next_to_resume()) is not None:
            head_rank = rank(head)
            if not head_rank < rank(self.running[-1]):
                break
            if self._could_resume(head):
                if head.status is RequestStatus.WAITING:
                    return min(head.seqs[0].num_tokens, self.budgets.max_num_batched_tokens), head_rank
                break
            if not self.policy.preempts(head, self.running):
                break
            if ahead:
                self.needs_drain = True
                break
            self._preempt(self.running[-1])
        return 0, ()

    def _could_resume(self, request: Request) -> bool:
        """Whether a waiting or swapped request has the seats and blocks to start now (before the running
        requests take this step's slots)."""
        if self._num_running_seats() + request.num_seats > self.budgets.max_num_seqs:
            return False
        if request.status is RequestStatus.SWAPPED:
            return self.kv_cache.can_swap_in(request)
        return self._plan_start(request, self.budgets.max_num_batched_tokens) is not None

    def _wants(self, request: Request, budget: int) -> list[tuple[Sequence, int]]:
        """(sequence, positions) to compute for a request this step, within the token budget: a
        prompt's chunk, or a decode's last token and, in a step that speculates, its proposals."""
        wants: list[tuple[Sequence, int]] = []
        for seq in request.seqs:
            seq.num_drafts = 0
            if seq.num_pending and not self._runs_ahead(seq):
                continue
            n = seq.num_tokens + seq.num_coming - seq.kv.num_computed
            if n > budget:
                n = budget if self.budgets.chunked_prefill else 0
            if n == 1 and self._speculating and self.speculation is not None:
                self.speculation.propose(seq, budget)
                n += seq.num_drafts
            if n > 0:
                wants.append((seq, n))
                budget -= n
        return wants

    def _within_free_blocks(self, wants: list[tuple[Sequence, int]]) -> list[tuple[Sequence, int]]:
        """The request's wants, without its proposals where their blocks are not free: speculation
        never makes anyone wait or be preempted."""
        if not wants or self.kv_cache.can_append(wants):
            return wants
        fitted = []
        for seq, n in wants:
            fitted.append((seq, n - seq.num_drafts))
            seq.num_drafts = 0
        return fitted

    def _num_decoding(self) -> int:
        """Running sequences past their prompt: those a step that speculates gives proposals."""
        return sum(1 for request in self.running for seq in request.seqs
                   if seq.kv.num_computed >= seq.num_prompt_tokens)

    def _runs_ahead(self, seq: Sequence) -> bool:
        """Whether a sequence's next position may be scheduled before its pending sample is known:
        not if what the steps in flight may give it could be its last by length."""
        sampling = seq.request.sampling
        if sampling.use_beam_search or seq.request.forks_at_next_sample:
            return False
        return (len(seq.output_token_ids) + seq.num_coming < sampling.max_tokens
                and seq.num_tokens + seq.num_coming < self.budgets.max_model_len)

    def _room(self, request: Request, plan: _Plan) -> int:
        """The tokens a request may take in the step: for a prompt, within the policy's cap on prompt
        tokens too, except for the step's first prompt where prompts cannot be split into chunks."""
        if not _in_prompt(request) or (plan.prompt_tokens == 0 and not self.budgets.chunked_prefill):
            return plan.tokens_left
        return max(0, min(plan.tokens_left, plan.prompt_cap - plan.prompt_tokens))

    def _take(self, wants: list[tuple[Sequence, int]], plan: _Plan) -> None:
        for seq, n in wants:
            if seq.kv.num_computed < seq.num_prompt_tokens:
                plan.prompt_tokens += n
            self.kv_cache.append_slots(seq, n)
            plan.scheduled.append((seq, n))
            plan.tokens_left -= n

    def _num_running_seats(self) -> int:
        return sum(r.num_seats for r in self.running)

    def _next_to_resume(self) -> Request | None:
        """The first in rank among the swapped and the waiting requests."""
        swapped = self.swapped[0] if self.swapped else None
        waiting = self.waiting[0] if self.waiting else None
        if swapped is None or (waiting is not None and self.policy.rank(waiting) < self.policy.rank(swapped)):
            return waiting
        return swapped

    def _prompts_fill(self, budget: int) -> bool:
        """Whether the waiting requests' prompts fill `budget` tokens.

        A step planned while another computes starts waiting requests only where they fill its budget,
        or where the first of them was left out while a step now done computed: otherwise it leaves them
        to the next step, which takes the requests that arrive meanwhile too. A burst of prompts (clients
        that all send at once, reaching the scheduler one by one) then runs in full steps rather than in
        one with the first few and more with the rest, each such step seconds long on a CPU; and no
        request waits more than one step so."""
        tokens = 0
        for request in self.waiting:
            tokens += sum(seq.num_tokens for seq in request.seqs)
            if tokens >= budget:
                return True
        if self.waiting and self.waiting[0].left_out_at is None:
            self.waiting[0].left_out_at = self.results_in
        return False

    def _deferred(self) -> bool:
        """Whether the first waiting request was left out by a step planned ahead and a result came in since:
        left out until then, not only until the next plan, which the next arrival alone may prompt."""
        left_out_at = self.waiting[0].left_out_at if self.waiting else None
        return left_out_at is not None and self.results_in > left_out_at

    def _resume(self, plan: _Plan, starts_prompts: bool = True, only_head: bool = False) -> None:
        """Bring back swapped requests and start waiting ones (where `starts_prompts`), strictly in rank
        order; with `only_head`, no prompt after the first: the step that starts an outranking request
        stays short."""
        while (request := self._next_to_resume()) is not None:
            if self._num_running_seats() + request.num_seats > self.budgets.max_num_seqs:
                break
            if request.status is RequestStatus.SWAPPED:
                if self.kv_cache.can_swap_in(request):
                    self.swapped.pop(0)
                    self.kv_cache.swap_in(request)
                    self._mark_running(request)
                    wants = self._within_free_blocks(self._wants(request, self._room(request, plan)))
                    if wants and self.kv_cache.can_append(wants):
                        self._take(wants, plan)
                    continue
                if self.running:
                    break  # they will finish and free blocks
                self._recompute_instead(request)  # it cannot come back even into an idle pool
                continue
            if not starts_prompts or plan.tokens_left <= 0 or not self._start(request, plan) or only_head:
                break

    def _start(self, request: Request, plan: _Plan) -> bool:
        start = self._plan_start(request, self._room(request, plan))
        if start is None:
            return False
        if start.hits.waiting:
            return False  # blocks of its prompt are being read from disk, by the step in flight that reads them
        if start.hits.reads:  # blocks on disk: read once, then start on them (those still there)
            if not request.waited_for_disk and self.kv_cache.read_from_disk(start.hits):
                request.waited_for_disk = True
                return False
            start = self._plan_start(request, self._room(request, plan), disk=False)
            if start is None:
                return False
        self.waiting.popleft()
        self._mark_running(request)
        leader = start.leader
        self._begin(leader, start.hits, from_cache=True)
        if request.lora is not None:  # after its hits are held, so that loading the adapter evicts none of them
            assert self.kv_cache.adapters is not None  # admission refuses adapters otherwise
            self.kv_cache.adapters.acquire(request.request_id, request.lora)
        self.kv_cache.reserve(leader, self._reserved_blocks(request))
        self._take([(leader, start.num_tokens)] if start.num_tokens else [], plan)
        for seq, n in start.followers:
            self._begin(seq, PrefixMatch.on_device(leader.kv.block_table[:start.shared_blocks]), from_cache=False)
            self._take([(seq, n)] if n else [], plan)
        # The prompt's cost counts when it is admitted, so that the next admission of this step sees it.
        self.policy.served(request, leader.num_tokens - leader.kv.num_computed, 0)
        if self.policy.ranks_by_service:
            self._rank_waiting()
        return True

    def _recompute_instead(self, request: Request) -> None:
        log.info("%s cannot swap back in; recomputing it instead", request.request_id)
        self.swapped.remove(request)
        for seq in request.seqs:
            self.registry.preempt_by_recompute(seq)
        request.status = RequestStatus.WAITING
        self._requeue(request)

    def _requeue(self, request: Request) -> None:
        """Into the waiting queue at its rank's position (a new request's is mostly the end)."""
        rank = self.policy.rank
        key = rank(request)
        self.waiting.append(request)
        i = len(self.waiting) - 1
        while i > 0 and rank(self.waiting[i - 1]) > key:
            self.waiting[i], self.waiting[i - 1] = self.waiting[i - 1], self.waiting[i]
            i -= 1

    def _plan_start(self, request: Request, budget: int, disk: bool = True) -> _StartPlan | None:
        """How a waiting request starts, or None if it does not fit now.

        The first sequence starts from its prefix-cache hits. The others (only a request that
        was preempted by recompute after forking has them) share the full blocks of the prefix
        they have in common with the first, as far as the first computes it in this very step:
        the worker writes a step's keys and values before any attention reads them.
        """
        size = self.kv_cache.block_size
        leader, *others = request.seqs
        # Prompt log-probabilities come from computing the prompt: no cached blocks until they are out.
        wants_prompt = request.prompt_logprobs is not None and not request.prompt_logprobs_sent
        hits = PrefixMatch() if wants_prompt else self.kv_cache.match_prefix(leader, disk)
        num_hit = hits.num_blocks
        n = self._fit(leader.num_tokens - num_hit * size, budget)
        budget -= n
        needed = -(-(num_hit * size + n) // size) - num_hit + hits.num_loads  # a block loaded from host takes one
        shared_blocks = min(_common_prefix(request.seqs) - 1, num_hit * size + n) // size if others else 0
        followers: list[tuple[Sequence, int]] = []
        for seq in others:
            n_seq = self._fit(seq.num_tokens - shared_blocks * size, budget)
            budget -= n_seq
            needed += -(-(shared_blocks * size + n_seq) // size) - shared_blocks
            followers.append((seq, n_seq))
        if n == 0 and not any(n_seq for _, n_seq in followers):
            return None
        adapters = self.kv_cache.adapters
        if adapters is not None:
            if not adapters.can_start(request.lora):
                return None  # every adapter slot is held by running requests: wait for one to end
            needed += adapters.blocks_to_start(request.lora)
        reserved = self._reserved_blocks(request)
        if reserved and not self.kv_cache.can_reserve(reserved):
            return None
        needed = max(needed, reserved)
        revived = self.kv_cache.revives(hits)
        left = self.kv_cache.num_free_blocks - revived - needed
        # The watermark keeps room for running sequences to grow into; a reservation never grows.
        if left < (self.kv_cache.watermark_blocks if self.reservation.paged else 0):
            return None
        return _StartPlan(leader, hits, n, shared_blocks, followers)

    def _fit(self, num_tokens: int, budget: int) -> int:
        """Tokens of a prompt to run now: all, a chunk, or none if it must wait for a later step."""
        if num_tokens <= budget:
            return num_tokens
        return budget if self.budgets.chunked_prefill else 0

    def _begin(self, seq: Sequence, computed: PrefixMatch, from_cache: bool) -> None:
        self.kv_cache.start(seq, computed)
        if not from_cache:
            return
        loads = computed.num_loads
        self.counters.hits_device_tokens += (computed.num_blocks - loads) * self.kv_cache.block_size
        self.counters.hits_host_tokens += loads * self.kv_cache.block_size
        request = seq.request
        if request.first_scheduled is None:
            request.first_scheduled = self.clock()
            self.queue_times.append((request.first_scheduled - request.received, self.tenant_labels(request.tenant),
                                     priority_class(request.priority)))
        if not request.looked_up and self.kv_cache.caching:
            request.looked_up = True
            self.counters.prompt_tokens_queried += request.num_prompt_tokens
        cached = min(seq.kv.num_computed, request.num_prompt_tokens)
        # Counted once per request: a recomputed request that hits its own blocks again is no new hit.
        self.counters.prompt_tokens_cached += max(0, cached - request.num_cached_prompt_tokens)
        request.num_cached_prompt_tokens = max(request.num_cached_prompt_tokens, cached)

    def _mark_running(self, request: Request) -> None:
        request.status = RequestStatus.RUNNING
        self.running.append(request)
        self.running.sort(key=self.policy.rank)

    def _preempt(self, request: Request) -> None:
        # Alone and still short of blocks (its samples' copies of a shared block): swapping out
        # and back in would give the same state, while a recompute starts its samples unshared.
        alone = self.running == [request]
        self.running.remove(request)
        manager = self.kv_cache
        num_blocks = manager.num_blocks_held(request)
        num_tokens = sum(seq.kv.num_computed for seq in request.seqs)
        for seq in request.seqs:
            seq.num_drafts = 0
        if not alone and self.preemption.prefers_swap(num_blocks, num_tokens) and manager.can_swap_out(request):
            log.info("preempting %s by swapping %d blocks out", request.request_id, num_blocks)
            self.counters.preemptions_swap += 1
            request.status = RequestStatus.SWAPPED
            self.swapped.append(request)
            self.swapped.sort(key=self.policy.rank)
            manager.swap_out(request)
            return
        log.info("preempting %s by recompute", request.request_id)
        self.counters.preemptions_recompute += 1
        self._release_adapter(request)
        for seq in request.seqs:
            self.registry.preempt_by_recompute(seq)
        request.status = RequestStatus.WAITING
        self._requeue(request)

    def _build_step(self, plan: _Plan) -> Step:
        new_sequences: list[NewSequence] = []
        entries: list[ScheduledSequence] = []
        sampled: list[Sequence] = []
        drafts: dict[int, int] = {}
        prompt_tokens_computed = num_decoding = 0
        for seq, num_tokens in plan.scheduled:
            computed, num_prompt = seq.kv.num_computed, seq.num_prompt_tokens
            coming = seq.num_tokens + seq.num_coming  # if every proposal in flight is kept
            new, entry = self.registry.step_entry(seq, num_tokens)
            if new is not None:
                new_sequences.append(new)
            entries.append(entry)
            self.kv_cache.mark_computed(seq, num_tokens)  # proposals included, until the result settles them
            if entry.num_draft_tokens:
                drafts[seq.seq_id] = entry.num_draft_tokens
            samples = computed + num_tokens - entry.num_draft_tokens == coming
            if samples:
                seq.num_pending += 1
                sampled.append(seq)
            prompt_part = max(0, min(computed + num_tokens, num_prompt) - computed)
            prompt_tokens_computed += prompt_part
            num_decoding += computed >= num_prompt
            self._count_served(seq.request, prompt_part, int(samples))
        counters = self.counters
        counters.prompt_tokens_computed += prompt_tokens_computed
        counters.tokens_scheduled += sum(n for _, n in plan.scheduled)
        forks, dropped, preempted = self.registry.take_worker_notices()
        transfers = self.kv_cache.take_transfers()
        step = Step(counters.steps, forks, dropped, preempted, new_sequences, entries, transfers,
                    self.kv_cache.take_lora_loads())
        reads = [t.key for t in transfers if t.src_tier == DISK]
        self.in_flight[step.step_id] = _InFlight([seq for seq, _ in plan.scheduled], sampled, num_decoding,
                                                 self._speculating, prompt_tokens_computed > 0, drafts, reads)
        counters.steps += 1
        if self.speculation is not None:
            self.speculation.built(self._speculating)
        return step

    # --- sequences and requests ending ---------------------------------------------------

    def _count_served(self, request: Request, prompt_tokens: int, output_tokens: int) -> None:
        self.policy.served(request, 0, output_tokens)  # its prompt was counted when it started
        label = (self.tenant_labels(request.tenant), priority_class(request.priority))
        served = self.counters.served.get(label)
        if served is None:
            served = self.counters.served[label] = [0, 0]
        served[0] += prompt_tokens
        served[1] += output_tokens

    def finish_request(self, request: Request) -> None:
        self.registry.release(request)
        self._dequeue(request)

    def _release_adapter(self, request: Request) -> None:
        if self.kv_cache.adapters is not None:
            self.kv_cache.adapters.release(request.request_id, request.lora)

    def _dequeue(self, request: Request) -> None:
        self._release_adapter(request)
        queue = {RequestStatus.RUNNING: self.running, RequestStatus.WAITING: self.waiting,
                 RequestStatus.SWAPPED: self.swapped}.get(request.status)
        if queue is not None:
            queue.remove(request)
        if request.status is not RequestStatus.FINISHED:
            self.policy.left(request)
        request.status = RequestStatus.FINISHED

    def fail_all(self, error: str) -> list[RequestOutput]:
        """End every request: the worker could not run a step."""
        outputs: list[RequestOutput] = []
        self.in_flight.clear()
        self.kv_cache.abandon_reads()
        for request in list(self.requests.values()):
            self.finish_request(request)
            outputs.append(error_output(request.request_id, request.num_prompt_tokens, error, "error"))
        return outputs

    def update(self, result: StepResult, worker_wait_ms: float = 0.0) -> list[RequestOutput]:
        """Apply a step's result; steps' results come in the order the steps were planned.
        `worker_wait_ms`: how long the worker waited for this step while the scheduler had work."""
        step = self.in_flight.pop(result.step_id, None)
        if step is None:
            return []
        self.results_in += 1
        if step.reads:
            self.kv_cache.finish_reads(step.reads, set(result.failed_reads))
        for seq in step.sampled:
            seq.num_pending = max(0, seq.num_pending - 1)  # 0 already if preempted meanwhile
        applied = self.results.apply(result, step.scheduled, step.drafts)
        for request in applied.ended:
            self._dequeue(request)
        if self.speculation is not None:
            self.speculation.verified(applied.verified)
            if not step.has_prompt_tokens:  # a prompt's cost would hide what speculating costs
                self.speculation.observe(step.num_decoding, step.speculated, applied.num_tokens,
                                         result.forward_ms + result.sample_ms + worker_wait_ms)
        return applied.outputs

    def _lora_stats(self) -> LoraStats | None:
        adapters = self.kv_cache.adapters
        if adapters is None:
            return None
        return LoraStats(len(adapters.on_device), adapters.num_pages, adapters.loads, adapters.evictions,
                         dict(adapters.requests))

    def load(self) -> tuple[int, int, float]:
        """Requests running (or swapped out), requests waiting, and the share of device blocks in use."""
        gpu = self.kv_cache.gpu
        return len(self.running) + len(self.swapped), len(self.waiting), gpu.num_referenced / max(gpu.num_blocks, 1)

    def stats(self) -> Stats:
        gpu, cpu, host, moved = self.kv_cache.gpu, self.kv_cache.cpu, self.kv_cache.host, self.kv_cache.moved
        disk = self.kv_cache.disk
        holding, reserved = self._slot_use()
        counters = self.counters
        return Stats(
            num_gpu_blocks=gpu.num_blocks, num_free_gpu_blocks=gpu.num_free, num_cached_gpu_blocks=gpu.num_evictable,
            num_cpu_blocks=cpu.num_blocks, num_free_cpu_blocks=cpu.num_available,
            num_running=sum(len(r.seqs) for r in self.running), num_waiting=len(self.waiting),
            num_swapped=len(self.swapped), num_preemptions_swap=counters.preemptions_swap,
            num_preemptions_recompute=counters.preemptions_recompute, num_steps=counters.steps,
            num_prompt_tokens_computed=counters.prompt_tokens_computed,
            num_prompt_tokens_cached=counters.prompt_tokens_cached,
            blocks_swapped_out=moved.swapped_out, blocks_swapped_in=moved.swapped_in, blocks_copied=moved.copied,
            blocks_offloaded=moved.offloaded, blocks_loaded=moved.loaded, blocks_written_to_disk=moved.written,
            blocks_read_from_disk=moved.read, disk_reads_refused=moved.refused,
            num_disk_blocks=len(disk) if disk is not None else 0,
            disk_capacity_blocks=disk.capacity if disk is not None else 0,
            num_host_cache_blocks=host.num_blocks, num_cached_host_blocks=host.num_evictable,
            prefix_hits_device_tokens=counters.hits_device_tokens, prefix_hits_host_tokens=counters.hits_host_tokens,
            tokens_scheduled=counters.tokens_scheduled,
            kv_slots_holding_tokens=holding, kv_slots_reserved=reserved,
            kv_slots_fragmented=self._fragmented_blocks() * self.kv_cache.block_size,
            block_size=self.kv_cache.block_size,
            prefix_cache_queries=counters.prompt_tokens_queried,
            speculation=self.speculation.snapshot() if self.speculation is not None else None,
            lora=self._lora_stats(),
            served={label: (prompt, output) for label, (prompt, output) in counters.served.items()},
        )

    def _fragmented_blocks(self) -> int:
        """While a request waits to start under a reservation baseline, the free blocks in runs too
        short for its reservation; none under paging, where any free block will do."""
        if self.reservation.paged or not self.waiting:
            return 0
        head = self.waiting[0]
        return self.kv_cache.fragmented_blocks(self._reserved_blocks(head))

    def _slot_use(self) -> tuple[int, int]:
        """Slots of the device's referenced blocks that hold token states (over all referenced slots:
        the paper's KV utilization), and those still empty that the request would fill by its
        max_tokens; a block shared by several sequences counted once."""
        held: dict[int, int] = {}
        wanted: dict[int, int] = {}
        size, context = self.kv_cache.block_size, self.budgets.max_model_len
        for request in self.running:
            final = min(request.num_prompt_tokens + request.sampling.max_tokens, context)
            for seq in request.seqs:
                for i, block in enumerate(seq.kv.block_table):
                    held[block] = max(held.get(block, 0), min(size, max(0, seq.kv.num_computed - i * size)))
                    wanted[block] = max(wanted.get(block, 0), min(size, max(0, final - i * size)))
        holding = sum(held.values())
        return holding, sum(max(0, wanted[b] - held[b]) for b in held)


def _in_prompt(request: Request) -> bool:
    return any(seq.kv.num_computed < seq.num_prompt_tokens for seq in request.seqs)


def _common_prefix(seqs: list[Sequence]) -> int:
    """Tokens at the start that all the sequences have in common."""
    first = seqs[0].token_ids()
    length = len(first)
    for seq in seqs[1:]:
        other = seq.token_ids()
        length = min(length, len(other))
        for i in range(seq.request.num_prompt_tokens, length):
            if other[i] != first[i]:
                length = i
                break
    return length
