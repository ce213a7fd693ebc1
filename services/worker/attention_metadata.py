"""Where each token of a flattened step sits in the paged KV cache."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(slots=True)
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [num_tokens] int64: block id * block_size + offset
    block_tables: torch.Tensor  # [num_seqs, max_blocks] int32, padded with 0
    query_start_loc: list[int]  # num_seqs + 1 offsets of each sequence's tokens
    context_lens: list[int]  # tokens visible to each sequence after this step
