"""A sequence as the scheduler sees it: token ids, progress, and its block table."""

from __future__ import annotations

import enum

from shared.sampling import SamplingParams


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class Sequence:
    def __init__(
        self,
        seq_id: int,
        request_id: str,
        prompt_token_ids: list[int],
        sampling: SamplingParams,
        arrival_time: float,
    ):
        self.seq_id = seq_id
        self.request_id = request_id
        self.prompt_token_ids = prompt_token_ids
        self.output_token_ids: list[int] = []
        self.sampling = sampling
        self.arrival_time = arrival_time
        self.status = Status.WAITING
        self.num_computed_tokens = 0
        self.block_table: list[int] = []
        self.num_tokens_known_to_worker = 0  # 0: the worker holds no copy of this sequence
        self.finish_reason: str | None = None

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_uncomputed_tokens(self) -> int:
        return self.num_tokens - self.num_computed_tokens

    @property
    def is_prefill(self) -> bool:
        return self.num_uncomputed_tokens > 1

    def token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    def reset_for_recompute(self) -> None:
        self.status = Status.WAITING
        self.num_computed_tokens = 0
        self.num_tokens_known_to_worker = 0
