"""The one place a model touches the paged KV cache: store this step's keys and values, then attend."""

from __future__ import annotations

import torch

from kernels import dispatch
from kernels.batch import PagedBatch


def paged_attention(
    q: torch.Tensor,  # [tokens, heads, head_dim]
    k: torch.Tensor,  # [tokens, kv_heads, head_dim]
    v: torch.Tensor,
    kv_cache: torch.Tensor,  # [2, num_blocks, block_size, kv_heads, head_dim]
    batch: PagedBatch,
    scale: float,
    window: int | None = None,
) -> torch.Tensor:
    dispatch.write_kv(k, v, kv_cache[0], kv_cache[1], batch.slot_mapping)
    return dispatch.paged_attention(q, kv_cache[0], kv_cache[1], batch, scale, window)
