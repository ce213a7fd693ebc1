"""The kernel boundary the model calls: Triton on CUDA; on a CPU, the compiled C kernel where it
builds, vectorized torch elsewhere.

`--kernels reference` forces the per-sequence references (on any device), the oracle the others are
tested against; `--kernels torch` keeps the CPU in torch (no C compiler needed); `--kernels triton`
forces Triton (on CPU that needs `TRITON_INTERPRET=1`, as the tests use). kernels/choice.py holds the
choice.
"""

from __future__ import annotations

import torch

from kernels import block_copy, choice, kv_quant, kv_write, rotary
from kernels import paged_attention as attention
from kernels.batch import PagedBatch
from kernels.cpu_attention import native_accepts, paged_attention_cpu, paged_attention_torch


def _mode() -> str:
    return choice.current().backend


def use_triton(tensor: torch.Tensor) -> bool:
    mode = _mode()
    if mode == "reference":
        return False
    if attention.triton is None:
        if mode == "triton":
            raise RuntimeError("--kernels triton, but triton is not installed")
        return False
    return mode == "triton" or tensor.is_cuda


def paged_attention(query, key_cache, value_cache, batch: PagedBatch, scale: float, window: int | None = None):
    if (
        kv_quant.is_quantized(key_cache)
        and not use_triton(query)
        and not (_mode() == "auto" and native_accepts(query, key_cache, value_cache))
    ):
        # Triton and the C kernel read quantized rows themselves; the others get the blocks in use, dequantized
        key_cache, value_cache, batch = kv_quant.compact(key_cache, value_cache, batch, query.dtype)
    if use_triton(query):
        return attention.paged_attention_triton(query, key_cache, value_cache, batch, scale, window)
    mode = _mode()
    if mode == "reference":
        return attention.paged_attention_reference(query, key_cache, value_cache, batch, scale, window)
    if mode == "torch":
        return paged_attention_torch(query, key_cache, value_cache, batch, scale, window)
    return paged_attention_cpu(query, key_cache, value_cache, batch, scale, window)


def rotate_and_write_kv(query, key, value, cos, sin, key_cache, value_cache, slot_mapping) -> bool:
    """The compiled CPU fusion of rotary embedding and `write_kv`; False where it does not apply."""
    if _mode() != "auto" or use_triton(query):
        return False
    return rotary.rotate_and_write_native(query, key, value, cos, sin, key_cache, value_cache, slot_mapping)


def write_kv(key, value, key_cache, value_cache, slot_mapping) -> None:
    if kv_quant.is_quantized(key_cache):
        key, value = kv_quant.quantize(key, key_cache.dtype), kv_quant.quantize(value, value_cache.dtype)
    if use_triton(key_cache):
        kv_write.write_kv_triton(key, value, key_cache, value_cache, slot_mapping)
    elif _mode() == "reference":
        kv_write.write_kv_reference(key, value, key_cache, value_cache, slot_mapping)
    else:
        kv_write.write_kv_indexed(key, value, key_cache, value_cache, slot_mapping)


def copy_blocks(cache: torch.Tensor, pairs: torch.Tensor) -> None:
    if use_triton(cache):
        block_copy.copy_blocks_triton(cache, pairs)
    else:
        block_copy.copy_blocks_reference(cache, pairs)
