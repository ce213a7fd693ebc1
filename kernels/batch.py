"""Where each token of a flattened step sits in the paged KV cache: the kernels' input."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch


@dataclass(slots=True)
class PagedBatch:
    """Sequence `s` owns query rows `query_start_loc[s]:query_start_loc[s + 1]`; they are its
    last tokens, and `context_lens[s]` tokens (those included) are visible to it."""

    slot_mapping: torch.Tensor  # [num_tokens] int64: block id * block_size + offset, -1 to skip
    block_tables: torch.Tensor  # [num_seqs, max_blocks] int32, padded with 0
    query_start_loc: torch.Tensor  # [num_seqs + 1] int32, on the device
    context_lens: torch.Tensor  # [num_seqs] int32, on the device
    query_start_list: list[int]  # the same two on the host, for the reference and for sizing
    context_lens_list: list[int]
    derived: dict = field(default_factory=dict)  # tensors the kernels compute once per step, not per layer
    adapters: Any = None  # the step's LoRA adapters and their rows (services/worker/lora.py), or None

    @property
    def num_seqs(self) -> int:
        return len(self.context_lens_list)

    @property
    def max_query_len(self) -> int:
        starts = self.query_start_list
        return max(b - a for a, b in zip(starts, starts[1:]))

    @property
    def max_context_len(self) -> int:
        return max(self.context_lens_list)

    @staticmethod
    def build(
        slots: list[int], tables: list[list[int]], query_start: list[int], context_lens: list[int], device: torch.device
    ) -> PagedBatch:
        width = max(len(t) for t in tables)
        padded = [t + [0] * (width - len(t)) for t in tables]
        return PagedBatch(
            slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
            block_tables=torch.tensor(padded, dtype=torch.int32, device=device),
            query_start_loc=torch.tensor(query_start, dtype=torch.int32, device=device),
            context_lens=torch.tensor(context_lens, dtype=torch.int32, device=device),
            query_start_list=list(query_start),
            context_lens_list=list(context_lens),
        )
