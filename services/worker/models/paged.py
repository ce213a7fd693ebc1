"""The one place a model touches the paged KV cache: rotate q and k, store keys and values, attend."""

from __future__ import annotations

import torch

from kernels import dispatch
from kernels.batch import PagedBatch
from kernels.rotary import apply_rope


def paged_attention(
    q: torch.Tensor,  # [tokens, heads, head_dim]
    k: torch.Tensor,  # [tokens, kv_heads, head_dim]
    v: torch.Tensor,
    kv_cache: torch.Tensor,  # [2, num_blocks, block_size, kv_heads, head_dim]
    batch: PagedBatch,
    scale: float,
    window: int | None = None,
    rope: tuple[torch.Tensor, torch.Tensor] | None = None,  # (cos, sin): rotate q and k first
) -> torch.Tensor:
    if rope is None:
        dispatch.write_kv(k, v, kv_cache[0], kv_cache[1], batch.slot_mapping)
    elif not dispatch.rotate_and_write_kv(q, k, v, *rope, kv_cache[0], kv_cache[1], batch.slot_mapping):
        q, k = apply_rope(q, *rope), apply_rope(k, *rope)
        dispatch.write_kv(k, v, kv_cache[0], kv_cache[1], batch.slot_mapping)
    return dispatch.paged_attention(q, kv_cache[0], kv_cache[1], batch, scale, window)
