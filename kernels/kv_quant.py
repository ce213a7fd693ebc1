"""An int8 KV cache (`--kv-cache-dtype int8`): each cached row, one token's keys (or values) of
one KV head, is stored as `head_dim` int8 values and, in the 4 bytes after them, the float32
scale they were quantized with (the row's largest magnitude over 127). Scales live in the row, so
a block is still one slice of one tensor, and copy-on-write, swapping and prefix sharing move
blocks as they are.

On a CPU the C attention kernel reads the int8 rows and their scales directly
(`paged_attention_i8`). Elsewhere (Triton on CUDA, the torch and reference paths) attention gets
the blocks the step's sequences use, dequantized into a compact float cache (each used block
once, per layer and step), and runs the float kernel on it. What an int8 cache holds in the same bytes: head_dim 64 in float32 takes 256
bytes a row, in int8 68 (3.8x the tokens); against float16, 128 against 68 (1.9x).
"""

from __future__ import annotations

import torch

from kernels.batch import PagedBatch

KV_CACHE_DTYPES = ("auto", "int8")
SCALE_BYTES = 4  # a float32 scale after each row's values
QMAX = 127


def cache_layout(head_dim: int, dtype: torch.dtype, kv_cache_dtype: str) -> tuple[torch.dtype, int]:
    """The cache tensor's element type and the width of a row, for the model's dtype."""
    if kv_cache_dtype == "int8":
        return torch.int8, head_dim + SCALE_BYTES
    if kv_cache_dtype != "auto":
        raise ValueError(f"--kv-cache-dtype must be one of {', '.join(KV_CACHE_DTYPES)}")
    return dtype, head_dim


def is_quantized(cache: torch.Tensor) -> bool:
    return cache.dtype == torch.int8


def quantize(rows: torch.Tensor) -> torch.Tensor:
    """[..., head_dim] floats -> [..., head_dim + 4] int8: the values, then their scale's bytes."""
    values = rows.float()
    scale = (values.abs().amax(dim=-1, keepdim=True) / QMAX).clamp_min(torch.finfo(torch.float32).tiny)
    quantized = torch.round(values / scale).clamp_(-QMAX, QMAX).to(torch.int8)
    return torch.cat((quantized, scale.view(torch.int8)), dim=-1)


def dequantize(rows: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """[..., head_dim + 4] int8 -> [..., head_dim] of `dtype`."""
    scale = rows[..., -SCALE_BYTES:].contiguous().view(torch.float32)
    return (rows[..., :-SCALE_BYTES].float() * scale).to(dtype)


def compact(key_cache: torch.Tensor, value_cache: torch.Tensor, batch: PagedBatch, dtype: torch.dtype):
    """The blocks the batch's sequences read, dequantized into float caches of their own, and the
    batch with its block tables renumbered into them."""
    renumbered = batch.derived.get("int8_blocks")
    if renumbered is None:  # once per step, not per layer
        block_size = key_cache.shape[1]
        tables = batch.block_tables.long()
        needed = (batch.context_lens.long() + block_size - 1) // block_size
        read = torch.arange(tables.shape[1], device=tables.device)[None, :] < needed[:, None]
        used = torch.unique(tables[read])
        tables = torch.where(read, torch.searchsorted(used, tables), torch.zeros_like(tables))
        compacted = PagedBatch(batch.slot_mapping, tables.to(torch.int32), batch.query_start_loc, batch.context_lens,
                               batch.query_start_list, batch.context_lens_list)
        renumbered = batch.derived["int8_blocks"] = (used, compacted)
    used, compacted = renumbered
    return dequantize(key_cache[used], dtype), dequantize(value_cache[used], dtype), compacted
