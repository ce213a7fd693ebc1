"""The steps sent to the workers whose results are not in yet: each step built from a plan (`build`), remembered
until its result comes back (`settle`), in the order the steps were planned."""

from __future__ import annotations

from dataclasses import dataclass

from services.scheduler.kv_cache_manager import KVCacheManager
from services.scheduler.policy import SchedulingPolicy
from services.scheduler.request import Sequence
from services.scheduler.sequences import SequenceRegistry
from services.scheduler.statistics import SchedulerStatistics
from shared.protocol import NewSequence, ScheduledSequence, Step


@dataclass(slots=True)
class InFlight:
    """What the scheduler remembers of a step until its result is in."""

    scheduled: list[Sequence]
    positions: list[int]  # what it computes of each of `scheduled`
    sampled: list[Sequence]  # those the step samples
    num_decoding: int  # sequences that decode in it (not a prompt's chunk)
    speculated: bool
    has_prompt_tokens: bool
    drafts: dict[int, int]  # seq_id -> proposals asked of the worker, counted as computed until settled


class StepsInFlight:
    def __init__(
        self,
        kv_cache: KVCacheManager,
        registry: SequenceRegistry,
        policy: SchedulingPolicy,
        statistics: SchedulerStatistics,
    ):
        self.kv_cache, self.registry, self.policy, self.statistics = kv_cache, registry, policy, statistics
        self._steps: dict[int, InFlight] = {}
        self.results_in = 0  # steps whose results were applied

    def __bool__(self) -> bool:
        return bool(self._steps)

    def __len__(self) -> int:
        return len(self._steps)

    def build(self, scheduled: list[tuple[Sequence, int]], speculated: bool) -> Step:
        """The step that runs `scheduled` (sequence, positions to compute), with the transfers queued meanwhile."""
        new_sequences: list[NewSequence] = []
        entries: list[ScheduledSequence] = []
        sampled: list[Sequence] = []
        drafts: dict[int, int] = {}
        prompt_tokens_computed = num_decoding = 0
        for seq, num_tokens in scheduled:
            computed, num_prompt = seq.kv.num_computed, seq.num_prompt_tokens
            coming = seq.num_tokens + seq.num_coming  # if every proposal in flight is kept
            new, entry = self.registry.step_entry(seq, num_tokens)
            if new is not None:
                new_sequences.append(new)
            entries.append(entry)
            self.kv_cache.mark_computed(seq, num_tokens)  # proposals included, until the result settles them
            seq.flight.computes(num_tokens)
            if entry.num_draft_tokens:
                drafts[seq.seq_id] = entry.num_draft_tokens
            samples = computed + num_tokens - entry.num_draft_tokens == coming
            if samples:
                seq.flight.will_sample()
                sampled.append(seq)
            prompt_part = max(0, min(computed + num_tokens, num_prompt) - computed)
            prompt_tokens_computed += prompt_part
            num_decoding += computed >= num_prompt
            self.policy.served(seq.request, 0, int(samples))  # its prompt was counted when it started
            self.statistics.served(seq.request, prompt_part, int(samples))
        forks, dropped, preempted = self.registry.take_worker_notices()
        step = Step(
            self.statistics.counters.steps,
            forks,
            dropped,
            preempted,
            new_sequences,
            entries,
            self.kv_cache.take_transfers(),
            self.kv_cache.take_lora_loads(),
            *self.kv_cache.remote.take(),
        )
        self._steps[step.step_id] = InFlight(
            [seq for seq, _ in scheduled],
            [n for _, n in scheduled],
            sampled,
            num_decoding,
            speculated,
            prompt_tokens_computed > 0,
            drafts,
        )
        self.statistics.stepped(prompt_tokens_computed, sum(n for _, n in scheduled))
        return step

    def settle(self, step_id: int) -> InFlight | None:
        """The step whose result came in (None for one no longer remembered: a failure forgot it), its
        samples no longer pending."""
        step = self._steps.pop(step_id, None)
        if step is None:
            return None
        self.results_in += 1
        for seq in step.sampled:
            seq.flight.sampled()
        for seq, positions in zip(step.scheduled, step.positions):
            seq.flight.computed(positions)
        return step

    def take(self, step_id: int) -> InFlight | None:
        """The step that failed, unsettled: nothing it computed is kept."""
        return self._steps.pop(step_id, None)

    def forget(self) -> None:
        """Every step in flight failed: none of their results will come, nor news of their reads from disk."""
        self._steps.clear()
        self.kv_cache.abandon_reads()
