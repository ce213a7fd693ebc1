"""Beam search decisions, made by the scheduler from each beam's top-2k log-probabilities.

The rules are those of HF transformers' `generate(num_beams=k)`, so both return the same
beams: of the top 2k continuations over all beams (ranked by cumulative log-probability), the
best k that do not end the sequence keep running; those that end it (EOS, or the length limit)
and rank among the first k become finished hypotheses, scored by cumulative log-probability
divided by length ** length_penalty; the best k hypotheses are kept. The search stops when no
running beam can beat the worst kept hypothesis (or, with early_stopping=True, as soon as k
hypotheses exist).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field


def length_normalized(cumulative_logprob: float, length: int, length_penalty: float) -> float:
    """cumulative_logprob / length ** length_penalty, finite for every allowed penalty."""
    try:
        return cumulative_logprob / float(length**length_penalty)
    except (OverflowError, ZeroDivisionError):
        if cumulative_logprob == 0:
            return 0.0
        exponent = math.log(abs(cumulative_logprob)) - length_penalty * math.log(length)
        return math.copysign(math.exp(min(exponent, 700.0)), cumulative_logprob)


@dataclass(slots=True)
class Candidate:
    beam: int  # index of the parent beam in the list given to `step`
    token_id: int
    logprob: float
    cumulative_logprob: float


@dataclass(slots=True)
class Hypothesis:
    token_ids: list[int]
    logprobs: list[float]
    score: float


@dataclass(slots=True)
class BeamInput:
    output_token_ids: list[int]
    output_logprobs: list[float]
    cumulative_logprob: float
    top_ids: list[int]
    top_logprobs: list[float]


@dataclass(slots=True)
class BeamSearch:
    width: int
    length_penalty: float
    early_stopping: bool | str
    max_new_tokens: int
    finished: list[Hypothesis] = field(default_factory=list)
    improvable: bool = True
    done: bool = False

    def step(self, beams: list[BeamInput], ends_sequence: Callable[[int, int], bool]) -> list[Candidate]:
        """Pick the next running beams; `ends_sequence(token_id, new_length)` applies stop rules."""
        candidates = [
            Candidate(i, token, logprob, beam.cumulative_logprob + logprob)
            for i, beam in enumerate(beams)
            for token, logprob in zip(beam.top_ids, beam.top_logprobs)
        ]
        candidates.sort(key=lambda c: c.cumulative_logprob, reverse=True)
        candidates = candidates[: 2 * self.width]
        new_length = len(beams[0].output_token_ids) + 1
        ends = [ends_sequence(c.token_id, new_length) for c in candidates]

        running = [c for c, end in zip(candidates, ends) if not end][: self.width]
        full = len(self.finished) == self.width
        if self.improvable and not (full and self.early_stopping is True):
            for c, end in zip(candidates[: self.width], ends[: self.width]):
                if end:
                    parent = beams[c.beam]
                    self.finished.append(
                        Hypothesis(
                            parent.output_token_ids + [c.token_id],
                            parent.output_logprobs + [c.logprob],
                            length_normalized(c.cumulative_logprob, new_length, self.length_penalty),
                        )
                    )
            self.finished.sort(key=lambda h: h.score, reverse=True)
            del self.finished[self.width :]

        self.improvable = self.improvable and self._can_improve(running, new_length)
        full = len(self.finished) == self.width
        self.done = not self.improvable or (full and self.early_stopping is True) or all(ends) or not running
        return [] if self.done else running

    def _can_improve(self, running: list[Candidate], length: int) -> bool:
        if len(self.finished) < self.width or not running:
            return True
        if self.early_stopping == "never" and self.length_penalty > 0:
            length = self.max_new_tokens
        best_possible = length_normalized(running[0].cumulative_logprob, length, self.length_penalty)
        return best_possible > min(h.score for h in self.finished)

    def best(self, n: int) -> list[Hypothesis]:
        return self.finished[:n]
