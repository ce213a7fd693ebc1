"""Finding the request that makes steps fail, so that it fails alone.

When a step fails on the worker (which then forgets every sequence), the worker names the sequences whose own
inputs failed it where it can (an adapter whose files changed or lie, say), and those requests end. Where it
cannot, the step's requests are suspects: they run again in halves, one half at a time, the other held back,
and each failure halves the group that failed, until one request is left, which ends. A step that runs clears
the suspects in it, and a request cleared so is no suspect of the next failure. Every other request is computed
again, as after a recompute preemption: nobody else's stream ends. After `max_failures` failed steps in a row
the fault is the worker's, not a request's: every request ends (the scheduler's `fail_all`), saying so, and the
worker is told to exit for its supervisor to start it afresh (the scheduler's server).
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from services.scheduler.preemption import Preemption
    from services.scheduler.request import Request, Sequence
    from services.scheduler.request_queue import RequestQueues
    from services.scheduler.sequences import SequenceRegistry

log = logging.getLogger("services.scheduler.scheduler")

MAX_FAILURES = 12  # in a row: enough halvings for 256 requests, and a few failures of the worker's own


class Quarantine:
    def __init__(self, max_failures: int = MAX_FAILURES):
        self.max_failures = max_failures
        self.groups: list[set[str]] = []  # suspects by request id; only the first group may run
        self.cleared: set[str] = set()  # ran a step since the search began: no longer suspects
        self.failures = 0  # steps failed in a row

    def __bool__(self) -> bool:
        return bool(self.groups)

    @property
    def worker_at_fault(self) -> bool:
        return self.failures > self.max_failures

    def admits(self, request_id: str) -> bool:
        """Whether the request may run now: it is no suspect, or one of the group under test."""
        return not self.groups or request_id in self.groups[0] or all(request_id not in g for g in self.groups)

    def failed(self, in_step: set[str], blamed: set[str]) -> set[str] | None:
        """A step of `in_step` failed, the worker blaming `blamed` (perhaps none): the requests to end now, or None
        where too many steps failed in a row for a request to be the cause."""
        self.failures += 1
        if self.worker_at_fault:
            self.groups.clear()
            return None
        suspects = in_step - self.cleared or in_step
        if blamed or len(suspects) <= 1:
            culprits = blamed or suspects
            self.forget(culprits)
            return culprits
        self._remove(suspects)
        ordered = sorted(suspects)
        half = len(ordered) // 2
        self.groups[:0] = [set(ordered[:half]), set(ordered[half:])]
        return set()

    def ran(self, in_step: set[str]) -> None:
        """A step of `in_step` ran: they are cleared."""
        self.failures = 0
        self.cleared |= in_step
        self.forget(in_step)

    def forget(self, request_ids: set[str]) -> None:
        """No longer suspects (cleared, or ended)."""
        self._remove(request_ids)
        if not self.groups:  # the search is over
            self.cleared.clear()

    def _remove(self, request_ids: set[str]) -> None:
        for group in self.groups:
            group -= request_ids
        self.groups = [group for group in self.groups if group]


class StepFailures:
    """The scheduler's side of a failed step: whom to end, whom to hold back, and the rest recomputed."""

    def __init__(self, registry: SequenceRegistry, queues: RequestQueues, preemption: Preemption):
        self.registry, self.queues, self.preemption = registry, queues, preemption
        self.quarantine = Quarantine()

    def failed(self, scheduled: list[Sequence], culprits: list[int]) -> list[Request] | None:
        """The requests to end for a failed step of `scheduled` whose worker blamed `culprits` (sequence ids), or
        None where the worker is at fault."""
        in_step = {seq.request.request_id for seq in scheduled}
        sequences = self.registry.sequences
        blamed = {sequences[s].request.request_id for s in culprits if s in sequences}
        ending = self.quarantine.failed(in_step, blamed)
        if ending is None:
            return None
        for request_id in sorted(ending):
            log.warning("ending %s: a step failed on it", request_id)
        return [self.registry.requests[request_id] for request_id in sorted(ending)]

    def recompute_the_rest(self) -> None:
        """Every request the worker held is computed again; suspects not under test wait their turn."""
        for request in list(self.queues.running):
            self.queues.running.remove(request)
            self.preemption.recompute(request)
        for request in list(self.queues.swapped):
            self.preemption.recompute_instead(request)
        for request in list(self.queues.waiting):
            if not self.quarantine.admits(request.request_id):
                self.queues.hold(request)

    def ran(self, scheduled: list[Sequence]) -> None:
        if self.quarantine.failures or self.quarantine:
            self.quarantine.ran({seq.request.request_id for seq in scheduled})
            self._release_cleared()

    @property
    def worker_at_fault(self) -> bool:
        """Too many steps failed in a row for a request to be the cause: the worker restarts."""
        return self.quarantine.worker_at_fault

    def ended(self, request: Request) -> None:
        if self.quarantine:
            self.quarantine.forget({request.request_id})
            self._release_cleared()

    def _release_cleared(self) -> None:
        for request in list(self.queues.held):
            if self.quarantine.admits(request.request_id):
                self.queues.release(request)
