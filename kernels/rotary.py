"""Rotary position embedding ("rotate half", as HF's Llama applies it), and on a CPU its fusion
with storing the step's keys and values into the paged cache (`rotary_write.c`)."""

from __future__ import annotations

import functools

import torch

from kernels import native
from kernels.kv_quant import SCALE_BYTES


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [tokens, heads, head_dim]; cos, sin: [tokens, head_dim]."""
    return x * cos[:, None, :] + rotate_half(x) * sin[:, None, :]


SPLIT_VALUES = 1 << 16  # rotated and stored values below which a call is not worth sharing between threads
CHUNKS_PER_THREAD = 4
QUANTIZED_SYMBOLS = {torch.int8: "rotate_and_write_i8", torch.uint8: "rotate_and_write_f8"}  # kernels/kv_quant.py
SYMBOLS = {
    torch.float32: "rotate_and_write_f32",
    torch.bfloat16: "rotate_and_write_bf16",
    torch.float16: "rotate_and_write_f16",
    **QUANTIZED_SYMBOLS,
}


@functools.cache
def native_kernel(symbol: str = "rotate_and_write_f32"):
    """The kernel into a float32 cache, or with "rotate_and_write_bf16" (or "_f16", "_i8", "_f8") into a
    bfloat16 (or float16, int8, E4M3) one."""
    p, i = native.POINTER, native.INT64
    return native.function("rotary_write", symbol, [p, i, p, i, p, i, p, p, p, i, i, i, i, p, p, i, p, i], i)


def rotate_and_write_native(query, key, value, cos, sin, key_cache, value_cache, slot_mapping) -> bool:
    """Rotate `query` (float32) in place and store the rotated keys and the values in their slots (in the
    cache's dtype, quantized into an int8 or E4M3 one); False, with nothing done, where the compiled
    kernel does not apply (then rotate and store in torch)."""
    if key_cache.dtype != value_cache.dtype or key_cache.dtype not in SYMBOLS or key_cache.device.type != "cpu":
        return False
    width = query.shape[2] + (SCALE_BYTES if key_cache.dtype in QUANTIZED_SYMBOLS else 0)
    kernel = native_kernel(SYMBOLS[key_cache.dtype])
    if (
        kernel is None
        or key_cache.shape[3] != width
        or any(t.dtype != torch.float32 or t.device.type != "cpu" for t in (query, key, value, cos, sin))
        or slot_mapping.dtype != torch.int64
        or not key_cache.is_contiguous()
        or not value_cache.is_contiguous()
        or not cos.is_contiguous()
        or not sin.is_contiguous()
        or not slot_mapping.is_contiguous()
    ):
        return False
    if any(t.stride(2) != 1 or t.stride(1) != t.shape[2] for t in (query, key, value)):
        return False  # each token's heads must be one row
    num_tokens, num_heads, head_dim = query.shape
    args = (
        query.data_ptr(),
        query.stride(0),
        key.data_ptr(),
        key.stride(0),
        value.data_ptr(),
        value.stride(0),
        cos.data_ptr(),
        sin.data_ptr(),
        slot_mapping.data_ptr(),
        num_tokens,
        num_heads,
        key.shape[1],
        head_dim,
        key_cache.data_ptr(),
        value_cache.data_ptr(),
    )
    values = num_tokens * (num_heads + 2 * key.shape[1]) * head_dim
    return native.share_units(kernel, args, num_tokens, values >= SPLIT_VALUES, CHUNKS_PER_THREAD) == 0
