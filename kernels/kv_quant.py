"""A quantized KV cache (`--kv-cache-dtype int8|fp8`): each cached row, one token's keys (or
values) of one KV head, is stored as `head_dim` one-byte values and, in the 4 bytes after them, the
float32 scale they were quantized with: int8 rounds each value over the row's largest magnitude
/ 127; fp8 (OCP E4M3, vLLM's `fp8`) stores each value over the row's largest magnitude / 448 as
an E4M3 float, held in a uint8 tensor (int8 keeps 7 bits of every value, E4M3 3 bits of mantissa
over a wider range). Scales live in the row, so a block is still one slice of one tensor, and
copy-on-write, swapping and prefix sharing move blocks as they are.

On a CPU the C attention kernel reads the rows and their scales directly (`paged_attention_i8`,
`paged_attention_f8`), and so does the Triton kernel, dequantizing each KV tile as it loads it.
The torch and reference paths get the blocks the step's sequences use, dequantized into a compact
float cache (each used block once, per layer and step), and run on that. What a quantized cache holds in the
same bytes: head_dim 64 in float32 takes 256 bytes a row, quantized 68 (3.8x the tokens); against
float16, 128 against 68 (1.9x).
"""

from __future__ import annotations

import torch

from kernels.batch import PagedBatch

KV_CACHE_DTYPES = ("auto", "int8", "fp8")
STORAGE = {"int8": torch.int8, "fp8": torch.uint8}  # fp8: E4M3 bytes; a cache's dtype says which it holds
SCALE_BYTES = 4  # a float32 scale after each row's values
QMAX = 127  # int8
FP8_MAX = 448.0  # E4M3's largest finite value


def cache_layout(head_dim: int, dtype: torch.dtype, kv_cache_dtype: str) -> tuple[torch.dtype, int]:
    """The cache tensor's element type and the width of a row, for the model's dtype."""
    if kv_cache_dtype in STORAGE:
        return STORAGE[kv_cache_dtype], head_dim + SCALE_BYTES
    if kv_cache_dtype != "auto":
        raise ValueError(f"--kv-cache-dtype must be one of {', '.join(KV_CACHE_DTYPES)}")
    return dtype, head_dim


def is_quantized(cache: torch.Tensor) -> bool:
    return cache.dtype in (torch.int8, torch.uint8)


def quantize(rows: torch.Tensor, storage: torch.dtype = torch.int8) -> torch.Tensor:
    """[..., head_dim] floats -> [..., head_dim + 4] of `storage` (int8, or uint8 for E4M3): the
    values, then their scale's bytes."""
    values = rows.float()
    top = values.abs().amax(dim=-1, keepdim=True)
    if storage == torch.uint8:
        scale = (top / FP8_MAX).clamp_min(torch.finfo(torch.float32).tiny)
        quantized = (values / scale).clamp_(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn).view(torch.uint8)
    else:
        scale = (top / QMAX).clamp_min(torch.finfo(torch.float32).tiny)
        quantized = torch.round(values / scale).clamp_(-QMAX, QMAX).to(torch.int8)
    return torch.cat((quantized, scale.view(storage)), dim=-1)


def dequantize(rows: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """[..., head_dim + 4] int8 or uint8 (E4M3) -> [..., head_dim] of `dtype`."""
    scale = rows[..., -SCALE_BYTES:].contiguous().view(torch.float32)
    values = rows[..., :-SCALE_BYTES]
    if rows.dtype == torch.uint8:
        values = values.contiguous().view(torch.float8_e4m3fn)
    return (values.float() * scale).to(dtype)


def compact(key_cache: torch.Tensor, value_cache: torch.Tensor, batch: PagedBatch, dtype: torch.dtype):
    """The blocks the batch's sequences read, dequantized into float caches of their own, and the
    batch with its block tables renumbered into them."""
    renumbered = batch.derived.get("dequantized_blocks")
    if renumbered is None:  # once per step, not per layer
        block_size = key_cache.shape[1]
        tables = batch.block_tables.long()
        needed = (batch.context_lens.long() + block_size - 1) // block_size
        read = torch.arange(tables.shape[1], device=tables.device)[None, :] < needed[:, None]
        used = torch.unique(tables[read])
        tables = torch.where(read, torch.searchsorted(used, tables), torch.zeros_like(tables))
        compacted = PagedBatch(
            batch.slot_mapping,
            tables.to(torch.int32),
            batch.query_start_loc,
            batch.context_lens,
            batch.query_start_list,
            batch.context_lens_list,
        )
        renumbered = batch.derived["dequantized_blocks"] = (used, compacted)
    used, compacted = renumbered
    return dequantize(key_cache[used], dtype), dequantize(value_cache[used], dtype), compacted
