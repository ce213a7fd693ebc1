"""Speculative decoding, the scheduler's part: whether the next step speculates, how many tokens
each decoding sequence may have proposed, and what verification accepted.

The worker makes the proposals (prompt lookup or a draft model), from tokens it holds as soon as
it has sampled them; so a step that verifies proposals is planned while the step before it still
runs, as any other. Verifying k proposals costs the worker k more positions per sequence, and
whether that pays depends on the machine, the model, the batch and the text, so it is measured,
not assumed: `AdaptiveSwitch` keeps, per batch size (in powers of two), the tokens per sequence
per millisecond of worker time that recent steps gave with speculation and without, takes the
better, and now and then tries the other again.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field, replace

from services.scheduler.request import Sequence
from shared.config import SpeculativeConfig

ALWAYS_UP_TO = 2  # decoding sequences up to which every step speculates (see Speculation.decide)


@dataclass(slots=True)
class SpeculationStats:
    """Counted as vLLM counts them: a draft is one sequence's proposals in one step."""

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_position: list[int] = field(default_factory=list)
    steps_speculating: int = 0
    steps_plain: int = 0


class _Choice:
    """What one choice (speculate or not) gave in a bucket's recent steps: tokens, and sequences
    times worker milliseconds, whose ratio is the choice's rate (a ratio of sums, so that the many
    one-token steps of a sequence without a proposal weigh what they cost, not more)."""

    __slots__ = ("steps",)

    def __init__(self, window: int):
        self.steps: deque[tuple[int, float]] = deque(maxlen=window)

    @property
    def rate(self) -> float:
        return sum(tokens for tokens, _ in self.steps) / sum(cost for _, cost in self.steps)


class _Bucket:
    __slots__ = ("choices", "since_probe", "probe_every", "probe_left")

    def __init__(self, window: int, probe_every: int):
        self.choices = {True: _Choice(window), False: _Choice(window)}
        self.since_probe = 0
        self.probe_every = probe_every
        self.probe_left = 0  # steps left of a probe of the other choice


class AdaptiveSwitch:
    """Speculate or not, per batch size, by what each choice delivered lately. The other choice is
    tried again now and then, the more rarely the worse it did: a probe of PROBE_STEPS steps every
    PROBE_STEPS x gap / PROBE_COST steps costs about PROBE_COST of the throughput."""

    # A choice's rate is taken over enough steps to span the stretches of a text, repetitive and
    # not, that make speculating pay or not from one step to the next.
    WARMUP = 16  # steps of each choice in a bucket before the two are compared
    WINDOW = 128  # recent steps a choice's rate is taken over
    PROBE_STEPS = 16  # steps of the other choice in one probe
    PROBE_EVERY_MIN, PROBE_EVERY_MAX = 16, 1024  # steps between probes
    PROBE_COST = 0.01  # probes spaced so that what they lose is about this share of the better choice's rate

    def __init__(self) -> None:
        self.buckets: dict[int, _Bucket] = {}

    def choose(self, num_decoding: int) -> bool:
        bucket = self._bucket(num_decoding)
        for choice in (True, False):
            if len(bucket.choices[choice].steps) < self.WARMUP:
                return choice
        best = self._best(bucket)
        if bucket.probe_left:
            return not best
        bucket.since_probe += 1
        if bucket.since_probe >= bucket.probe_every:
            bucket.since_probe, bucket.probe_left = 0, self.PROBE_STEPS
            return not best
        return best

    def observe(self, num_decoding: int, speculated: bool, num_tokens: int, worker_ms: float) -> None:
        """A step of `num_decoding` decoding sequences gave `num_tokens` tokens in `worker_ms` of the
        worker's time (its wait for the step included)."""
        if num_decoding <= 0 or worker_ms <= 0:
            return
        bucket = self._bucket(num_decoding)
        compared = all(bucket.choices[c].steps for c in (True, False))
        was_best = self._best(bucket) if compared else speculated
        bucket.choices[speculated].steps.append((num_tokens, num_decoding * worker_ms))
        probing = bucket.probe_left and speculated != was_best
        if probing:
            bucket.probe_left -= 1
        probe_over = probing and not bucket.probe_left
        if probe_over or (compared and not bucket.probe_left and self._best(bucket) != was_best):
            # A probe ended, or the verdict turned: the further apart the choices, the rarer the next probe.
            choices = bucket.choices
            best, other = sorted((choices[True].rate, choices[False].rate), reverse=True)
            gap = 1.0 - other / best if best > 0 else 0.0
            every = self.PROBE_STEPS * gap / self.PROBE_COST
            bucket.probe_every = int(min(max(every, self.PROBE_EVERY_MIN), self.PROBE_EVERY_MAX))
            bucket.since_probe = 0

    def _bucket(self, num_decoding: int) -> _Bucket:
        key = num_decoding.bit_length()
        bucket = self.buckets.get(key)
        if bucket is None:
            bucket = self.buckets[key] = _Bucket(self.WINDOW, self.PROBE_EVERY_MIN)
        return bucket

    @staticmethod
    def _best(bucket: _Bucket) -> bool:
        return bucket.choices[True].rate >= bucket.choices[False].rate


class Speculation:
    def __init__(self, config: SpeculativeConfig, max_model_len: int):
        self.config = config
        self.max_model_len = max_model_len
        self.switch = AdaptiveSwitch() if config.adaptive else None
        self.stats = SpeculationStats(accepted_per_position=[0] * config.num_speculative_tokens)
        self._decision: bool | None = None  # for the next step built, once made

    def decide(self, num_decoding: int) -> bool:
        """Whether the next step speculates; the same answer until a step is built.

        Up to ALWAYS_UP_TO decoding sequences a step's cost is reading the weights, so verifying
        proposals costs little (and nothing where the worker's lookup finds none), while the gain
        where text repeats is large, more than the switch, which lags the stretches of a text that
        repeat, would take (docs/features/speculative-decoding.md). Above that, the switch decides."""
        if self._decision is None:
            limit = self.config.disable_by_batch_size
            if limit and num_decoding > limit:
                self._decision = False
            elif self.switch is None or num_decoding <= ALWAYS_UP_TO:
                self._decision = True
            else:
                self._decision = self.switch.choose(num_decoding)
        return self._decision

    def built(self, speculating: bool) -> None:
        self._decision = None
        if speculating:
            self.stats.steps_speculating += 1
        else:
            self.stats.steps_plain += 1

    def propose(self, seq: Sequence, token_budget: int) -> None:
        """Set how many tokens the worker may propose for the sequence in the step being planned,
        within what its request and the context allow, counting every token the steps in flight
        may still give it: each step may give it one token more than it verifies."""
        sampling = seq.request.sampling
        k = min(
            self.config.num_speculative_tokens,
            token_budget - 1,
            sampling.max_tokens - len(seq.output_token_ids) - seq.num_coming - 1,
            self.max_model_len - seq.num_tokens - seq.num_coming - 1,
        )
        speculates = sampling.can_speculate and not seq.request.forks_at_next_sample
        seq.flight.propose(k if speculates else 0)

    def verified(self, outcomes: list[tuple[int, int]]) -> None:
        """(proposals, accepted) of each sequence a step verified."""
        stats = self.stats
        for proposed, accepted in outcomes:
            stats.num_drafts += 1
            stats.num_draft_tokens += proposed
            stats.num_accepted_tokens += accepted
            for position in range(accepted):
                stats.accepted_per_position[position] += 1

    def snapshot(self) -> SpeculationStats:
        stats = self.stats
        return replace(stats, accepted_per_position=list(stats.accepted_per_position))

    def observe(self, num_decoding: int, speculated: bool, num_tokens: int, worker_ms: float) -> None:
        if self.switch is not None:
            self.switch.observe(num_decoding, speculated, num_tokens, worker_ms)
