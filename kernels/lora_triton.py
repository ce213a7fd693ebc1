"""LoRA's shrink and expand for a step's rows, in Triton (the GPU's; `cpu_lora.c` is the CPU's).

One call per projection group and layer serves every row of every adapter in it (BGMV): a row's
program reads its adapter's matrices where they are, in the adapter's pages of the KV cache, through
a page table (S-LoRA's unified paging), so no adapter is gathered into a copy first.

Where an adapter's values are: a *logical* offset into its two regions (all its pages' first halves,
then all their second halves, as `shared.lora.page_layout` places them). Logical offset `L` of an
adapter with `P` pages sits in page slot `L // half` (`half`: values in one layer's half of a block),
which the page table maps to a row of the cache seen as `[layers, 2 * blocks, half]`, at `L % half`.

`table[adapter]` holds, for one projection group: `r`, `k` (how many of the group's projections it
changes), then `(A's offset, B's offset, first column, width)` for each of those `k`, in the group's order
(zeros after them).
"""

from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError:
    triton = None

FIELDS = 14
BLOCK_IN = 64  # columns of x (and of A) a shrink program reads at a time
BLOCK_RANK = 16  # rows of A a shrink program computes, rows of B an expand program reads at a time
BLOCK_OUT = 64  # output columns an expand program writes


def lora_add_triton(
    x: torch.Tensor,
    out: torch.Tensor,
    units: torch.Tensor,
    table: torch.Tensor,
    page_table: torch.Tensor,
    weights: torch.Tensor,
    layer_start: int,
    half: int,
    max_rank: int,
    max_width: int,
) -> None:
    """`out[row] += B @ (A @ x[row])` for each `(row, adapter)` of `units` (`[n, 2]` int64) and each projection
    the adapter changes, its matrices read through `page_table[adapter]` from `weights` (the cache's values,
    flat) from `layer_start`. `max_rank`/`max_width`: the largest r and widest projection in `table`."""
    if x.stride(1) != 1 or out.stride(1) != 1:
        raise ValueError("lora_add_triton needs x and out contiguous in their last dimension")
    count = units.shape[0]
    if count == 0 or max_rank == 0:
        return
    shrunk = torch.empty((count, 3, max_rank), dtype=torch.float32, device=x.device)
    _shrink[(count, 3, triton.cdiv(max_rank, BLOCK_RANK))](
        x,
        shrunk,
        units,
        table,
        page_table,
        weights,
        x.stride(0),
        x.shape[1],
        layer_start,
        half,
        page_table.stride(0),
        max_rank,
        FIELDS=FIELDS,
        BLOCK_IN=BLOCK_IN,
        BLOCK_RANK=BLOCK_RANK,
    )
    _expand[(count, 3, triton.cdiv(max_width, BLOCK_OUT))](
        shrunk,
        out,
        units,
        table,
        page_table,
        weights,
        out.stride(0),
        layer_start,
        half,
        page_table.stride(0),
        max_rank,
        FIELDS=FIELDS,
        BLOCK_RANK=BLOCK_RANK,
        BLOCK_OUT=BLOCK_OUT,
    )


if triton is not None:

    @triton.jit
    def _paged(weights_ptr, page_table_ptr, adapter, logical, inside, layer_start, half, pages_stride):
        """The values at `logical` offsets of the adapter's regions, through its page table."""
        slot = tl.load(page_table_ptr + adapter * pages_stride + logical // half, mask=inside, other=0)
        return tl.load(weights_ptr + layer_start + slot * half + logical % half, mask=inside, other=0.0)

    @triton.jit
    def _unit(units_ptr, table_ptr, unit, which, FIELDS: tl.constexpr):
        """A program's row, its adapter, the adapter's fields, and the rank of its which-th projection
        (0 past the projections it changes)."""
        row = tl.load(units_ptr + 2 * unit)
        adapter = tl.load(units_ptr + 2 * unit + 1)
        fields = table_ptr + adapter * FIELDS
        rank = tl.where(which < tl.load(fields + 1), tl.load(fields), 0)
        return row, adapter, fields, rank

    @triton.jit
    def _shrink(
        x_ptr,
        shrunk_ptr,
        units_ptr,
        table_ptr,
        page_table_ptr,
        weights_ptr,
        stride_x,
        width_in,
        layer_start,
        half,
        pages_stride,
        max_rank,
        FIELDS: tl.constexpr,
        BLOCK_IN: tl.constexpr,
        BLOCK_RANK: tl.constexpr,
    ):
        unit = tl.program_id(0).to(tl.int64)
        which = tl.program_id(1)  # the adapter's which-th projection of the group
        row, adapter, fields, rank = _unit(units_ptr, table_ptr, unit, which, FIELDS)
        a_start = tl.load(fields + 2 + 4 * which)
        ranks = tl.program_id(2) * BLOCK_RANK + tl.arange(0, BLOCK_RANK)
        ranks_inside = ranks < rank
        total = tl.zeros((BLOCK_RANK,), dtype=tl.float32)
        for start in range(0, width_in, BLOCK_IN):
            columns = start + tl.arange(0, BLOCK_IN)
            columns_inside = columns < width_in
            values = tl.load(x_ptr + row * stride_x + columns, mask=columns_inside, other=0.0).to(tl.float32)
            logical = a_start + ranks[:, None] * width_in + columns[None, :]
            inside = ranks_inside[:, None] & columns_inside[None, :]
            a = _paged(weights_ptr, page_table_ptr, adapter, logical, inside, layer_start, half, pages_stride)
            total += tl.sum(a.to(tl.float32) * values[None, :], axis=1)
        tl.store(shrunk_ptr + (unit * 3 + which) * max_rank + ranks, total, mask=ranks_inside)

    @triton.jit
    def _expand(
        shrunk_ptr,
        out_ptr,
        units_ptr,
        table_ptr,
        page_table_ptr,
        weights_ptr,
        stride_out,
        layer_start,
        half,
        pages_stride,
        max_rank,
        FIELDS: tl.constexpr,
        BLOCK_RANK: tl.constexpr,
        BLOCK_OUT: tl.constexpr,
    ):
        unit = tl.program_id(0).to(tl.int64)
        which = tl.program_id(1)
        row, adapter, fields, rank = _unit(units_ptr, table_ptr, unit, which, FIELDS)
        b_start = tl.load(fields + 3 + 4 * which)
        first = tl.load(fields + 4 + 4 * which)
        width = tl.load(fields + 5 + 4 * which)  # 0 past the adapter's k projections
        columns = tl.program_id(2) * BLOCK_OUT + tl.arange(0, BLOCK_OUT)
        columns_inside = columns < width
        total = tl.zeros((BLOCK_OUT,), dtype=tl.float32)
        for start in range(0, rank, BLOCK_RANK):
            ranks = start + tl.arange(0, BLOCK_RANK)
            ranks_inside = ranks < rank
            s = tl.load(shrunk_ptr + (unit * 3 + which) * max_rank + ranks, mask=ranks_inside, other=0.0)
            logical = b_start + ranks[:, None] * width + columns[None, :]
            inside = ranks_inside[:, None] & columns_inside[None, :]
            b = _paged(weights_ptr, page_table_ptr, adapter, logical, inside, layer_start, half, pages_stride)
            total += tl.sum(b.to(tl.float32) * s[:, None], axis=0)
        at = out_ptr + row * stride_out + first + columns
        before = tl.load(at, mask=columns_inside, other=0.0)
        tl.store(at, (before.to(tl.float32) + total).to(before.dtype), mask=columns_inside)
