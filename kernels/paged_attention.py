"""Paged attention over a flattened batch of prompt chunks and decode tokens (torch reference).

Sequence `s` owns query rows `query_start_loc[s]:query_start_loc[s + 1]`; they are its last
tokens, so with `context_lens[s]` tokens visible in total, query row `i` sits at position
`context_lens[s] - num_queries + i` and attends causally to keys `0..position`. Keys and values
are read from the paged cache, `[num_blocks, block_size, num_kv_heads, head_dim]`, through the
sequence's row of `block_tables`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def paged_attention_reference(
    query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    key_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [num_seqs, max_blocks] int
    query_start_loc: list[int],  # num_seqs + 1 offsets into query
    context_lens: list[int],  # tokens visible to each sequence, the new ones included
    scale: float,
) -> torch.Tensor:
    num_heads, head_dim = query.shape[1], query.shape[2]
    block_size, num_kv_heads = key_cache.shape[1], key_cache.shape[2]
    group = num_heads // num_kv_heads
    out = torch.empty_like(query)
    for s, context_len in enumerate(context_lens):
        begin, end = query_start_loc[s], query_start_loc[s + 1]
        num_queries = end - begin
        blocks = block_tables[s, : -(-context_len // block_size)]
        keys = key_cache[blocks].reshape(-1, num_kv_heads, head_dim)[:context_len]
        values = value_cache[blocks].reshape(-1, num_kv_heads, head_dim)[:context_len]
        q = query[begin:end].transpose(0, 1)  # [heads, queries, dim]
        k = keys.transpose(0, 1).repeat_interleave(group, dim=0)
        v = values.transpose(0, 1).repeat_interleave(group, dim=0)
        first_position = context_len - num_queries
        query_pos = torch.arange(first_position, context_len, device=query.device)
        key_pos = torch.arange(context_len, device=query.device)
        mask = key_pos[None, :] <= query_pos[:, None]
        out[begin:end] = F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, scale=scale
        ).transpose(0, 1)
    return out
