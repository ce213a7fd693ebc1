"""Store the new tokens' keys and values into their cache slots (torch reference).

Slot `s` is row `s % block_size` of block `s // block_size`; a slot of -1 is skipped.
"""

from __future__ import annotations

import torch


def write_kv_reference(
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    value: torch.Tensor,
    key_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,  # [num_tokens] int64
) -> None:
    keep = slot_mapping >= 0
    slots = slot_mapping[keep]
    key_cache.view(-1, *key_cache.shape[2:])[slots] = key[keep].to(key_cache.dtype)
    value_cache.view(-1, *value_cache.shape[2:])[slots] = value[keep].to(value_cache.dtype)
