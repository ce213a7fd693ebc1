"""How many threads the forward pass gets on a CPU.

Torch's threads meet at a barrier after every operation, so one thread that shares its core with
another busy process holds all of them up, by a factor of twenty in one measurement. The api and
the scheduler are such processes in proportion to the tokens streamed: on a toy model at dozens of
streams they take a fifth to a quarter of a core, and two threads then serve less than one. A model
past toy size streams few tokens for its compute, the others stay nearly idle, and two threads
serve more.

So the worker watches how busy its cores are with anything but itself (from /proc/stat, once a
second) and takes every core while the others leave them nearly idle, and all but one otherwise.
Contention makes the others busier, and with one threshold the count flipped every second or two.
Hence two thresholds, and a hold after giving a core back. The benchmark archive
(docs/benchmarks-archive.md, "CPU: a 12-layer model at real shapes") has the measurements. `--cpu-threads N`
fixes the count instead.

The step's threads are two sets: torch's OpenMP threads for its own operations, counted as above,
and the compiled kernels' helpers (`kernels.native.share`, `kernels/helper_pool.c`), one per core
but the caller's, always: a helper claims a call's chunks only once its core lets it run, so a busy core slows no call
(kernels/claims.h); where torch keeps one thread they still serve more tokens than one thread. An
idle OpenMP thread spins for a while before it sleeps, on a core a kernel thread needs next, so the
worker process starts with OMP_WAIT_POLICY=PASSIVE unless the environment sets it (both measured in
docs/benchmarks-archive.md).

A step of few tokens (decodes) gives torch one thread whatever the cores: its own operations there
(rotary tables, sampling, small copies) are too small to gain from a second thread, and waking a
sleeping one costs more than they take (docs/kernel-measurements.md).
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable

import torch

from kernels import native

ENTER_SHARE = 0.25  # of one core: the others this idle, the worker takes every core
LEAVE_SHARE = 0.35  # this busy, it gives one back, and for HOLD seconds
HOLD = 30.0
INTERVAL = 1.0  # seconds between looks at the cores
SMALL_STEP_TOKENS = 256  # steps of fewer tokens give torch one thread


def cpu_seconds_busy(cores: set[int], path: str = "/proc/stat") -> float | None:
    """Seconds `cores` have spent busy since boot (all processes), None where /proc/stat is not readable."""
    tick = os.sysconf("SC_CLK_TCK")
    try:
        with open(path) as f:
            lines = f.read().splitlines()
    except OSError:
        return None
    busy = 0
    for line in lines:
        name, *fields = line.split()
        if name.startswith("cpu") and name[3:].isdigit() and int(name[3:]) in cores:
            user, nice, system, _idle, _iowait, irq, softirq = (int(v) for v in fields[:7])
            busy += user + nice + system + irq + softirq  # not steal: the hypervisor's, not this machine's
    return busy / tick


def own_cpu_seconds() -> float:
    times = os.times()
    return times.user + times.system


class ComputeThreads:
    """The thread count of each step, from how busy the other processes keep this worker's cores."""

    def __init__(
        self,
        requested: int = 0,
        num_ranks: int = 1,
        cores: set[int] | None = None,
        busy: Callable[[], float | None] | None = None,
        own: Callable[[], float] = own_cpu_seconds,
        clock: Callable[[], float] = time.monotonic,
    ):
        cores = cores if cores is not None else os.sched_getaffinity(0)
        self.fixed = requested if requested > 0 else None
        self.all_cores = max(1, len(cores) // num_ranks)
        self.spare_one = max(1, (len(cores) - 1) // num_ranks)
        # Sibling ranks keep the other cores busy by design: with several, one is always left.
        self.adapts = self.fixed is None and num_ranks == 1 and self.all_cores > self.spare_one
        self.busy = busy or (lambda: cpu_seconds_busy(cores))
        self.own, self.clock = own, clock
        self.last = self._sample()
        self.taking_all = False
        self.held_until = 0.0
        self.current = 0  # torch's count is set by the first `use`
        # A shared kernel call never waits for a helper that has not started (kernels/claims.h), so
        # the compiled kernels take every core whatever the others do.
        self.kernel_threads = self.fixed or self.all_cores

    def _sample(self) -> tuple[float, float | None, float]:
        return self.clock(), self.busy() if self.adapts else None, self.own()

    def for_step(self, tokens: int | None = None) -> int:
        """The count for the next step (of `tokens` tokens, where known); looks at the cores once an interval
        has passed."""
        if self.fixed is not None:
            return self.fixed
        count = self._for_cores()
        return 1 if tokens is not None and tokens < SMALL_STEP_TOKENS else count

    def _for_cores(self) -> int:
        if not self.adapts:
            return self.spare_one
        now = self.clock()
        if now - self.last[0] >= INTERVAL:
            sample = self._sample()
            if sample[1] is not None and self.last[1] is not None:
                others = (sample[1] - self.last[1]) - (sample[2] - self.last[2])
                self._decide(now, others_share=max(0.0, others) / (sample[0] - self.last[0]))
            self.last = sample
        return self.all_cores if self.taking_all else self.spare_one

    def _decide(self, now: float, others_share: float) -> None:
        """From how much of one core the other processes used over the last interval."""
        if self.taking_all and others_share >= LEAVE_SHARE:
            self.taking_all, self.held_until = False, now + HOLD
        elif not self.taking_all and others_share < ENTER_SHARE and now >= self.held_until:
            self.taking_all = True

    def leaves_a_core(self) -> bool:
        """Whether the last step's threads left one of this rank's cores to other work."""
        return 0 < self.current < self.all_cores

    def describe(self) -> str:
        if self.fixed is not None:
            return f"{self.fixed} (--cpu-threads)"
        if not self.adapts:
            return str(self.spare_one)
        return f"{self.all_cores} while other processes leave the cores idle, else {self.spare_one}"

    def use(self, threads: int) -> None:
        if threads != self.current:
            torch.set_num_threads(threads)
            self.current = threads
        native.set_threads(self.kernel_threads)
