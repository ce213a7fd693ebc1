"""The worker's copy of each sequence between steps (`SequenceMirror`), what a step reads of it, and the errors
of a step: one that fails on some sequences' own inputs names them (`SequenceFault`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from services.worker.grammar import GrammarState
from services.worker.ngram import NgramIndex
from services.worker.sampler import Sample, SampleRow
from shared.protocol import ScheduledSequence
from shared.sampling import SamplingParams


@dataclass(slots=True)
class SequenceMirror:
    """The worker's copy of a sequence, kept between steps so steps carry only differences."""

    token_ids: list[int]
    num_prompt_tokens: int
    sampling: SamplingParams
    index: int
    row: int  # its block table is this row of the runner's BlockTables
    num_blocks: int = 0  # entries of that row in use
    num_drafted_positions: int = -1  # positions the draft model has computed; -1: as many as the target
    grammar: GrammarState | None = None  # with SamplingParams.grammar: where its output stands in it
    lookup: NgramIndex | None = None  # the n-gram proposer's index of its tokens, built on first use
    lora: str = ""  # the adapter it runs under; "": the base model
    pooled: Any = None  # a pooling prompt's running state (services/worker/pooling.py), where it spans steps

    def copy(self, index: int, row: int) -> SequenceMirror:
        return SequenceMirror(
            list(self.token_ids),
            self.num_prompt_tokens,
            self.sampling,
            index,
            row,
            self.num_blocks,
            self.num_drafted_positions,
            self.grammar.copy() if self.grammar is not None else None,
            lora=self.lora,
        )


class StepError(RuntimeError):
    pass


class SequenceFault(StepError):
    """A step failed on some sequences' own inputs (their adapter, say): the scheduler fails them alone."""

    def __init__(self, message: str, seq_ids: list[int]):
        super().__init__(message)
        self.seq_ids = seq_ids


def rows_by_adapter(
    scheduled: list[ScheduledSequence], starts: list[int], mirrors: dict[int, SequenceMirror]
) -> list[tuple[str, list[int]]]:
    """The step's token rows of each adapter its sequences run under."""
    rows: dict[str, list[int]] = {}
    for i, entry in enumerate(scheduled):
        name = mirrors[entry.seq_id].lora
        if name:
            rows.setdefault(name, []).extend(range(starts[i], starts[i + 1]))
    return list(rows.items())


def rows_to_sample(mirror: SequenceMirror, proposals: list[int]) -> list[SampleRow]:
    """How to sample its last position and, before that, each of its proposals' positions: each
    row as if the proposals before it were already the sequence's tokens."""
    generated = len(mirror.token_ids) - mirror.num_prompt_tokens
    sampling = mirror.sampling
    forks = generated == 0 and not sampling.use_beam_search and sampling.num_samples > 1
    rows = []
    for j in range(len(proposals) + 1):
        tokens = mirror.token_ids if not (j and sampling.penalized) else mirror.token_ids + proposals[:j]
        rows.append(
            SampleRow(
                sampling,
                generated + j,
                mirror.index,
                sampling.num_samples if forks else 1,
                tokens,
                mirror.num_prompt_tokens,
            )
        )
    return rows


def accepted_run(samples: list[Sample], proposals: list[int]) -> list[Sample]:
    """The samples up to the first that differs from its proposal, or all of them: the accepted
    proposals and the token after them."""
    for j, proposal in enumerate(proposals):
        if samples[j].token_id != proposal:
            return samples[: j + 1]
    return samples
