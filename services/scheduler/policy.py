"""Scheduling policies: the order in which requests are admitted, resumed and preempted.

A policy ranks requests, lower first. The scheduler keeps its queues in rank order: it plans the
running requests from the front, takes victims of a memory shortage from the back, and admits or
resumes from the front of the waiting and swapped requests. A request that outranks a running
one but does not fit may preempt the lowest-ranked running requests below it, where the policy
says so (`preempts`): under priority always, as vLLM's priority scheduling does.

- fcfs: arrival order.
- priority: the request's `priority`, lower first (vLLM's meaning), then arrival.
- fair: virtual token counters (Sheng et al., "Fairness in Serving Large Language Models", OSDI '24).
  Each tenant's counter grows by the prompt and output tokens it is served, divided by its weight;
  the tenant with the lowest counter goes first. A tenant that comes back after a while with no
  request in the system is lifted to the lowest counter of the tenants present, if its own is
  lower: an idle tenant banks no credit, and leaving sheds no debt. Once nobody is present the
  counters start again from zero. A tenant preempts another's request to admit its own only while
  it has nothing running: so a tenant that sends one request at a time need not wait for a seat
  behind a flood, and two backlogged tenants, whose counters cross every few steps, never preempt
  each other back and forth (each time recomputing).

No request starves: one that arrived more than `max_queue_delay` seconds ago ranks ahead of every
later arrival whatever its priority or tenant, and such requests rank among themselves by
arrival. Once every request present is that old the order is FCFS, whose liveness argument
(services/scheduler/scheduler.py) then applies.
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING, ClassVar

if TYPE_CHECKING:
    from services.scheduler.request import Request

Rank = tuple[float, ...]

# OpenAI's per-token prices make output dearer than prompt; the paper weighs them 1 and 2 likewise.
PROMPT_TOKEN_COST = 1.0
OUTPUT_TOKEN_COST = 2.0
MAX_TENANT_LABELS = 64  # api keys' tenants, and as many `user` tenants, labelled by name; the rest are "other"
USER_LABEL_CHARS = 48
MAX_IDLE_TENANTS = 4096  # counters kept of tenants with no request present; the lowest go first
# Under fair: a tenant whose last request left this recently is still active (a client sending one request
# after another has none present for a moment between them), and while more than one tenant is active a step
# carries prompt tokens up to this share of its budget.
ACTIVE_SECONDS = 2.0
CONTENDED_PROMPT_SHARE = 0.5
_KEY_TENANT = re.compile(r"tenant-[0-9a-f]{16}")


class SchedulingPolicy:
    """FCFS; the base of the others, which rank by something before arrival and age into FCFS."""

    name: ClassVar[str] = "fcfs"
    reorders: ClassVar[bool] = False  # whether ranks change between steps, so the queues need sorting
    ranks_by_service: ClassVar[bool] = False  # whether `served` changes ranks, so admissions re-sort the queue
    ranks_by_priority: ClassVar[bool] = False  # whether a request's `priority` field counts

    def __init__(self, max_queue_delay: float = float("inf")):
        self.max_queue_delay = max_queue_delay
        self.now = 0.0

    def begin_step(self, now: float) -> None:
        """Ranks hold still while one step is planned: they are taken at `now`."""
        self.now = now

    def rank(self, request: Request) -> Rank:
        if not self.reorders or self.now - request.received > self.max_queue_delay:
            return (0, request.order)
        return (1, *self._rank(request), request.order)

    def _rank(self, request: Request) -> Rank:
        return ()

    def prompt_budget(self, budget: int) -> int:
        """Prompt tokens a step of `budget` tokens may carry."""
        return budget

    def preempts(self, head: Request, running: list[Request]) -> bool:
        """Whether `head`, first to be admitted or resumed, which outranks the last of `running` (in
        rank order) and does not fit, preempts that one."""
        return False

    def arrived(self, request: Request) -> None:
        """A request entered the system."""

    def left(self, request: Request) -> None:
        """A request that `arrived` left the system, for any reason."""

    def served(self, request: Request, prompt_tokens: int, output_tokens: int) -> None:
        """A step computes `prompt_tokens` of its prompt and samples `output_tokens` for it."""


class PriorityPolicy(SchedulingPolicy):
    name = "priority"
    reorders = True
    ranks_by_priority = True

    def preempts(self, head: Request, running: list[Request]) -> bool:
        return True

    def _rank(self, request: Request) -> Rank:
        return (request.priority,)


class FairPolicy(SchedulingPolicy):
    name = "fair"
    reorders = True
    ranks_by_service = True

    def __init__(self, max_queue_delay: float = float("inf"), weights: dict[str, float] | None = None):
        super().__init__(max_queue_delay)
        self.weights = weights or {}
        self.counters: dict[str, float] = {}  # of tenants present
        self.present: dict[str, int] = {}  # tenant -> its requests in the system
        self.idle: dict[str, float] = {}  # the counters of tenants that left, while anyone is present
        self.last_left: dict[str, float] = {}  # tenant -> when its last request left, while that is recent

    def begin_step(self, now: float) -> None:
        super().begin_step(now)
        self.last_left = {tenant: when for tenant, when in self.last_left.items() if now - when <= ACTIVE_SECONDS}

    def prompt_budget(self, budget: int) -> int:
        """Half the budget while more than one tenant is active (has a request present, or had one within
        ACTIVE_SECONDS): a request that arrives while a step computes waits for that step, so while others
        may be arriving, one tenant's flood of prompts does not make every step a long one."""
        active = len(self.present) + len(self.last_left)
        return budget if active <= 1 else max(1, int(budget * CONTENDED_PROMPT_SHARE))

    def weight(self, tenant: str) -> float:
        return self.weights.get(tenant.removeprefix("user:"), 1.0)

    def _rank(self, request: Request) -> Rank:
        tenant = request.tenant
        # Equal counters: the tenant with fewer requests present first, so a returning tenant, which
        # starts level with the least served, goes ahead of that tenant's backlog.
        return (self.counters[tenant], self.present[tenant])

    def preempts(self, head: Request, running: list[Request]) -> bool:
        return all(request.tenant != head.tenant for request in running)

    def arrived(self, request: Request) -> None:
        tenant = request.tenant
        self.last_left.pop(tenant, None)  # present again: counted once
        if tenant not in self.present:
            self.counters[tenant] = max(self.idle.pop(tenant, 0.0), min(self.counters.values(), default=0.0))
            self.present[tenant] = 0
        self.present[tenant] += 1

    def left(self, request: Request) -> None:
        tenant = request.tenant
        self.present[tenant] -= 1
        if self.present[tenant]:
            return
        del self.present[tenant]
        self.idle[tenant] = self.counters.pop(tenant)
        self.last_left[tenant] = self.now
        if not self.present:
            self.idle.clear()
        elif len(self.idle) > MAX_IDLE_TENANTS:
            # A counter at or below the lowest present would be lifted to it anyway.
            floor = min(self.counters.values())
            self.idle = {t: c for t, c in self.idle.items() if c > floor}
            while len(self.idle) > MAX_IDLE_TENANTS:
                del self.idle[min(self.idle, key=self.idle.__getitem__)]

    def served(self, request: Request, prompt_tokens: int, output_tokens: int) -> None:
        cost = PROMPT_TOKEN_COST * prompt_tokens + OUTPUT_TOKEN_COST * output_tokens
        self.counters[request.tenant] += cost / self.weight(request.tenant)


def make_policy(name: str, max_queue_delay: float, weights: dict[str, float] | None = None) -> SchedulingPolicy:
    if name == "fcfs":
        return SchedulingPolicy()
    if name == "priority":
        return PriorityPolicy(max_queue_delay)
    if name == "fair":
        return FairPolicy(max_queue_delay, weights)
    raise ValueError(f"unknown scheduling policy {name!r}")


def priority_class(priority: int) -> str:
    """A bounded label for metrics."""
    return "high" if priority < 0 else "low" if priority > 0 else "default"


class TenantLabels:
    """Metric labels for tenants, a bounded set: an api key's tenant by its id, a `user` tenant as "user:" and
    its name (cut to USER_LABEL_CHARS), each of the first MAX_TENANT_LABELS of either kind seen; later ones
    as "other" and "user:other"; no tenant as "none"."""

    def __init__(self) -> None:
        self.keys: set[str] = set()
        self.users: set[str] = set()

    def __call__(self, tenant: str) -> str:
        if not tenant:
            return "none"
        if tenant.startswith("user:"):
            return self._bounded(self.users, tenant[: len("user:") + USER_LABEL_CHARS], "user:other")
        if _KEY_TENANT.fullmatch(tenant):
            return self._bounded(self.keys, tenant, "other")
        return "other"

    @staticmethod
    def _bounded(seen: set[str], label: str, beyond: str) -> str:
        if label in seen:
            return label
        if len(seen) < MAX_TENANT_LABELS:
            seen.add(label)
            return label
        return beyond
