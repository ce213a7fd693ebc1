"""Copy whole KV blocks, `(src, dst)` pairs, in every layer at once (copy-on-write).

The cache is one tensor `[num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim]`, so a
block of one layer's keys or values is a contiguous run of `block_size * kv_heads * head_dim`
elements, and one launch covers all pairs, layers and both planes.
- `copy_blocks_reference`: torch indexing.
- `copy_blocks_triton`: grid (pairs, layers x 2, tiles of a block).
"""

from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError:
    triton = None

TILE = 1024


def copy_blocks_reference(cache: torch.Tensor, pairs: torch.Tensor) -> None:
    """cache: [layers, 2, num_blocks, ...]; pairs: [num_pairs, 2] int64 (src, dst)."""
    cache[:, :, pairs[:, 1]] = cache[:, :, pairs[:, 0]]


def copy_blocks_triton(cache: torch.Tensor, pairs: torch.Tensor) -> None:
    if cache.dim() != 6:
        raise ValueError(f"expected a [layers, 2, blocks, block_size, kv_heads, head_dim] cache, got {cache.dim()}-d")
    if not cache[0, 0, 0].is_contiguous():
        raise ValueError("each block must be contiguous")
    if pairs.dim() != 2 or pairs.shape[1] != 2 or pairs.dtype != torch.int64:
        raise ValueError("pairs must be an int64 [n, 2] tensor of (src, dst)")
    if len(pairs) == 0:
        return
    block_elems = cache[0, 0, 0].numel()
    planes = cache.shape[0] * cache.shape[1]
    grid = (len(pairs), planes, triton.cdiv(block_elems, TILE))
    _copy_kernel[grid](
        cache,
        pairs,
        cache.stride(1),
        cache.stride(2),
        cache.shape[1],
        cache.stride(0),
        BLOCK_ELEMS=block_elems,
        TILE=TILE,
    )


if triton is not None:

    @triton.jit
    def _copy_kernel(
        cache_ptr,
        pairs_ptr,
        stride_plane,
        stride_block,
        planes_per_layer,
        stride_layer,
        BLOCK_ELEMS: tl.constexpr,
        TILE: tl.constexpr,
    ):
        pair = tl.program_id(0)
        plane = tl.program_id(1)
        tile = tl.program_id(2)
        src = tl.load(pairs_ptr + pair * 2).to(tl.int64)
        dst = tl.load(pairs_ptr + pair * 2 + 1).to(tl.int64)
        layer = (plane // planes_per_layer).to(tl.int64)
        kind = (plane % planes_per_layer).to(tl.int64)
        base = layer * stride_layer + kind * stride_plane
        offsets = tile * TILE + tl.arange(0, TILE)
        mask = offsets < BLOCK_ELEMS
        values = tl.load(cache_ptr + base + src * stride_block + offsets, mask=mask)
        tl.store(cache_ptr + base + dst * stride_block + offsets, values, mask=mask)
