"""What the steps planned but not yet answered will bring a sequence, and what the workers' copy of it holds:
the counts that planning ahead and speculation depend on, with one writer (a sequence's `flight`) and a verb for
each event that changes them.

- pending: samples the steps in flight will bring; the positions after them may be scheduled already.
- drafts: proposals the worker is to make for it in the step being planned.
- speculative: positions of the steps in flight that are proposals. They count as computed, as if every one
  will be kept, until each step's result settles them.
- known_to_worker: the tokens the workers' copy holds (0: they hold none).
- computing: positions the steps in flight compute for it. Until their results are in, those positions count
  as computed for planning but their blocks are not cached: a step that fails leaves them unwritten.
"""

from __future__ import annotations


class Flight:
    __slots__ = ("pending", "drafts", "speculative", "known_to_worker", "computing")

    def __init__(self) -> None:
        self.pending = 0
        self.drafts = 0
        self.speculative = 0
        self.known_to_worker = 0
        self.computing = 0

    @property
    def coming(self) -> int:
        """Tokens the steps in flight may still give it: its pending samples, and its proposals as if every one
        will be kept."""
        return self.pending + self.speculative

    # --- the step being planned ---

    def propose(self, count: int) -> None:
        self.drafts = max(0, count)

    def drop_drafts(self) -> None:
        self.drafts = 0

    def sent(self, num_tokens: int) -> int:
        """The step's entry for it went out with its drafts and the workers now hold `num_tokens` tokens of it;
        returns the drafts, which are in flight from here on."""
        drafts, self.drafts = self.drafts, 0
        self.known_to_worker = num_tokens
        self.speculative += drafts
        return drafts

    def will_sample(self) -> None:
        self.pending += 1

    def computes(self, positions: int) -> None:
        self.computing += positions

    # --- a step's result ---

    def sampled(self) -> None:
        self.pending = max(0, self.pending - 1)  # 0 already if preempted meanwhile

    def computed(self, positions: int) -> None:
        self.computing = max(0, self.computing - positions)  # 0 already if preempted meanwhile

    def settled(self, num_proposed: int) -> None:
        self.speculative -= num_proposed

    def kept_by_worker(self, count: int) -> None:
        """The worker appended `count` tokens it sampled to its copy itself."""
        if self.known_to_worker:
            self.known_to_worker += count

    # --- the sequence's life ---

    def forked_from(self, parent: Flight) -> None:
        self.known_to_worker = parent.known_to_worker
        self.computing = parent.computing  # its blocks past them wait for them as the parent's do

    def forget_worker_copy(self) -> None:
        """After a recompute preemption: nothing is in flight, and the workers hold no copy."""
        self.pending = self.speculative = self.known_to_worker = self.computing = 0
