"""The scheduler's three queues of requests, each in the policy's rank order (lower first): waiting to start,
running, and swapped out. A request's status says which queue holds it, and this object is what moves it from
one to another, so the two never disagree.

The scheduler plans the running requests from the front, takes the victims of a memory shortage from the back
(`lowest_running`), and starts or resumes from the front of the waiting and swapped ones (`next_to_resume`).
Under a policy whose ranks change between steps (`reorders`), `rerank` sorts them again before a step is planned.
"""

from __future__ import annotations

import bisect
from collections import deque
from collections.abc import Iterator

from services.scheduler.policy import SchedulingPolicy
from services.scheduler.request import Request, RequestStatus, Sequence


class RequestQueues:
    def __init__(self, policy: SchedulingPolicy):
        self.policy = policy
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.swapped: list[Request] = []
        self.held: list[Request] = []  # off the queues while others are tested for failing steps

    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self.swapped)

    def rerank(self) -> None:
        """Every queue in rank order again (ranks taken as the policy's step began)."""
        if self.policy.reorders:
            self.running.sort(key=self.policy.rank)
            self.swapped.sort(key=self.policy.rank)
            self.rerank_waiting()

    def rerank_waiting(self) -> None:
        ranked = sorted(self.waiting, key=self.policy.rank)
        self.waiting.clear()
        self.waiting.extend(ranked)

    def wait(self, request: Request) -> None:
        """Into the waiting queue at its rank's position, after those of equal rank (a new request's is mostly
        the end)."""
        request.status = RequestStatus.WAITING
        position = bisect.bisect_right(self.waiting, self.policy.rank(request), key=self.policy.rank)
        self.waiting.insert(position, request)

    def run(self, request: Request) -> None:
        """A waiting or swapped request (already taken off its queue) starts running."""
        request.status = RequestStatus.RUNNING
        self.running.append(request)
        self.running.sort(key=self.policy.rank)

    def swap_out(self, request: Request) -> None:
        """A running request (already taken off the running queue) waits swapped out."""
        request.status = RequestStatus.SWAPPED
        self.swapped.append(request)
        self.swapped.sort(key=self.policy.rank)

    def next_to_resume(self) -> Request | None:
        """The first in rank among the swapped and the waiting requests."""
        swapped = self.swapped[0] if self.swapped else None
        waiting = self.waiting[0] if self.waiting else None
        if swapped is None or (waiting is not None and self.policy.rank(waiting) < self.policy.rank(swapped)):
            return waiting
        return swapped

    def hold(self, request: Request) -> None:
        """A waiting request kept back until `release`."""
        self.waiting.remove(request)
        request.status = RequestStatus.HELD
        self.held.append(request)

    def release(self, request: Request) -> None:
        self.held.remove(request)
        self.wait(request)

    def take(self, request: Request) -> None:
        """Off whichever queue holds it (its status says which); a finished request is on none."""
        queue = {
            RequestStatus.RUNNING: self.running,
            RequestStatus.WAITING: self.waiting,
            RequestStatus.SWAPPED: self.swapped,
            RequestStatus.HELD: self.held,
        }.get(request.status)
        if queue is not None:
            queue.remove(request)

    def lowest_running(self) -> Request:
        return self.running[-1]

    def num_running_seats(self) -> int:
        return sum(r.num_seats for r in self.running)

    def running_sequences(self) -> Iterator[Sequence]:
        return (seq for request in self.running for seq in request.seqs)
