"""Store the new tokens' keys and values into their cache slots.

Slot `s` is row `s % block_size` of block `s // block_size`; a slot of -1 is skipped.
- `write_kv_reference`: plain torch indexing.
- `write_kv_triton`: one program per token copies its `[num_kv_heads, head_dim]` rows.
"""

from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError:
    triton = None


def write_kv_reference(
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    value: torch.Tensor,
    key_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,  # [num_tokens] int64
) -> None:
    keep = slot_mapping >= 0
    slots = slot_mapping[keep]
    block_size = key_cache.shape[1]
    blocks, offsets = slots // block_size, slots % block_size
    key_cache[blocks, offsets] = key[keep].to(key_cache.dtype)
    value_cache[blocks, offsets] = value[keep].to(value_cache.dtype)


def write_kv_indexed(key, value, key_cache, value_cache, slot_mapping) -> None:
    """The same as the reference in one `index_copy_` per cache, when no slot is skipped."""
    if bool((slot_mapping < 0).any()):
        write_kv_reference(key, value, key_cache, value_cache, slot_mapping)
        return
    rows = key_cache.shape[0] * key_cache.shape[1]
    key_cache.view(rows, *key_cache.shape[2:]).index_copy_(0, slot_mapping, key.to(key_cache.dtype))
    value_cache.view(rows, *value_cache.shape[2:]).index_copy_(0, slot_mapping, value.to(value_cache.dtype))


def write_kv_triton(key, value, key_cache, value_cache, slot_mapping) -> None:
    num_tokens, num_kv_heads, head_dim = key.shape
    if key.shape != value.shape or key_cache.shape != value_cache.shape:
        raise ValueError(f"key/value shapes differ: {tuple(key.shape)} {tuple(value.shape)}")
    if key_cache.shape[2:] != key.shape[1:]:
        raise ValueError(f"cache rows {tuple(key_cache.shape[2:])} != token rows {tuple(key.shape[1:])}")
    if slot_mapping.shape != (num_tokens,) or slot_mapping.dtype != torch.int64:
        raise ValueError("slot_mapping must be int64 with one slot per token")
    if key.stride(-1) != 1 or value.stride(-1) != 1 or key_cache.stride(-1) != 1:
        raise ValueError("keys, values and caches must be contiguous in head_dim")
    if num_tokens == 0:
        return
    _write_kv_kernel[(num_tokens,)](
        key,
        value,
        key_cache,
        value_cache,
        slot_mapping,
        key.stride(0),
        key.stride(1),
        value.stride(0),
        value.stride(1),
        key_cache.stride(0),
        key_cache.stride(1),
        key_cache.stride(2),
        value_cache.stride(0),
        value_cache.stride(1),
        value_cache.stride(2),
        BLOCK_SIZE=key_cache.shape[1],
        HEADS=num_kv_heads,
        HEADS_PAD=triton.next_power_of_2(num_kv_heads),
        HEAD_DIM=head_dim,
        HEAD_PAD=triton.next_power_of_2(head_dim),
    )


if triton is not None:

    @triton.jit
    def _write_kv_kernel(
        k_ptr,
        v_ptr,
        kc_ptr,
        vc_ptr,
        slot_ptr,
        stride_kt,
        stride_kh,
        stride_vt,
        stride_vh,
        stride_kcb,
        stride_kcs,
        stride_kch,
        stride_vcb,
        stride_vcs,
        stride_vch,
        BLOCK_SIZE: tl.constexpr,
        HEADS: tl.constexpr,
        HEADS_PAD: tl.constexpr,
        HEAD_DIM: tl.constexpr,
        HEAD_PAD: tl.constexpr,
    ):
        token = tl.program_id(0).to(tl.int64)
        slot = tl.load(slot_ptr + token)
        heads = tl.arange(0, HEADS_PAD)[:, None]
        dims = tl.arange(0, HEAD_PAD)[None, :]
        live = (tl.zeros([HEADS_PAD, HEAD_PAD], dtype=tl.int64) + slot) >= 0  # a tensor, not a scalar
        mask = (heads < HEADS) & (dims < HEAD_DIM) & live
        block = slot // BLOCK_SIZE
        offset = slot % BLOCK_SIZE
        k = tl.load(k_ptr + token * stride_kt + heads * stride_kh + dims, mask=mask)
        v = tl.load(v_ptr + token * stride_vt + heads * stride_vh + dims, mask=mask)
        tl.store(
            kc_ptr + block * stride_kcb + offset * stride_kcs + heads * stride_kch + dims,
            k.to(kc_ptr.dtype.element_ty),
            mask=mask,
        )
        tl.store(
            vc_ptr + block * stride_vcb + offset * stride_vcs + heads * stride_vch + dims,
            v.to(vc_ptr.dtype.element_ty),
            mask=mask,
        )
