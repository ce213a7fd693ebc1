"""The kernels that add a step's LoRA deltas for adapters with few rows (decoding sequences), reading each
adapter's weights where its pages are: `cpu_lora.c` on a CPU (through a table of each adapter's addresses) and
`kernels.lora_triton` on CUDA (through page tables)."""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from kernels import lora_triton, native
from shared.lora import PROJECTION_GROUPS, Part

if TYPE_CHECKING:
    from services.worker.lora import Adapter


class CompiledKernel:
    """`cpu_lora.c` over the adapters of a step's few rows, one call per group and layer."""

    def __init__(self, few: list[tuple[Adapter, list[int]]], widths: dict[str, tuple[int, int]]):
        function = lora_kernel()
        assert function is not None, "built only where the kernel loads"
        self.function = function
        self.units = torch.tensor(
            [(row, index) for index, (_, rows) in enumerate(few) for row in rows], dtype=torch.int64
        )
        # Its tables hold addresses into each adapter's regions: a gathered copy (pages not consecutive) must live
        # as long as the tables do.
        self.adapters = [adapter for adapter, _ in few]
        self.tables = _kernel_tables(self.adapters, widths)
        self.weight_bf16 = int(few[0][0].regions.dtype == torch.bfloat16)

    def add(self, layer: int, projections: tuple[str, ...], x: torch.Tensor, out: torch.Tensor) -> None:
        if x.dtype is not torch.float32 or out.dtype is not torch.float32 or out.stride(1) != 1:
            raise ValueError("the LoRA kernel adds float32 rows into a float32 output")
        x = x if x.stride(1) == 1 else x.contiguous()
        table = self.tables[layer, GROUPS.index(projections)]
        units = len(self.units)
        args = (
            x.data_ptr(),
            x.stride(0),
            out.data_ptr(),
            out.stride(0),
            x.shape[1],
            self.units.data_ptr(),
            units,
            table.data_ptr(),
            self.weight_bf16,
        )
        native.share_units(self.function, args, units, units >= 4, 1)


@dataclass(slots=True, frozen=True)
class PagedWeights:
    """The KV cache's memory as adapter values: `values` flat, `[layers, 2, blocks, half]` behind it."""

    values: torch.Tensor
    blocks: int
    half: int


class TritonKernel:
    """`kernels.lora_triton` over the adapters of a step's few rows: their tables and page tables, made once
    per step on the device, serve every group of every layer."""

    def __init__(
        self,
        few: list[tuple[Adapter, list[int]]],
        widths: dict[str, tuple[int, int]],
        paged: PagedWeights,
        device: torch.device,
    ):
        self.paged = paged
        adapters = [adapter for adapter, _ in few]
        self.units = torch.tensor(
            [(row, index) for index, (_, rows) in enumerate(few) for row in rows], dtype=torch.int64, device=device
        )
        widest = max(len(adapter.pages) for adapter in adapters)
        page_table = torch.zeros((len(adapters), 2 * widest), dtype=torch.int64)
        for index, adapter in enumerate(adapters):
            pages = torch.tensor(adapter.pages, dtype=torch.int64)
            page_table[index, : 2 * len(pages)] = torch.cat([pages, pages + paged.blocks])  # region 0, then 1
        self.page_table = page_table.to(device)
        self.tables, self.max_rank, self.max_width = [], [], []
        for group in GROUPS:
            table = torch.tensor([_triton_row(adapter, group, widths) for adapter in adapters], dtype=torch.int64)
            self.tables.append(table.to(device))
            self.max_rank.append(int(table[:, 0].max()))
            self.max_width.append(int(table[:, 5::4].max()))

    def add(self, layer: int, projections: tuple[str, ...], x: torch.Tensor, out: torch.Tensor) -> None:
        g = GROUPS.index(projections)
        paged = self.paged
        lora_triton.lora_add_triton(
            x if x.stride(1) == 1 else x.contiguous(),
            out,
            self.units,
            self.tables[g],
            self.page_table,
            paged.values,
            layer * 2 * paged.blocks * paged.half,
            paged.half,
            self.max_rank[g],
            self.max_width[g],
        )


def _triton_row(adapter: Adapter, group: tuple[str, ...], widths: dict[str, tuple[int, int]]) -> list[int]:
    """The adapter's fields for one projection group as `kernels.lora_triton` takes them, offsets counted in
    its two regions taken one after the other."""
    layout = adapter.layout
    present = layout.present(group)
    row = [layout.rank if present else 0, len(present)]
    for projection in present:
        a, b = layout.parts[projection, "A"], layout.parts[projection, "B"]
        row += [
            a.region * len(adapter.pages) * layout.half + a.offset,
            b.region * len(adapter.pages) * layout.half + b.offset,
            *widths[projection],
        ]
    return row + [0] * (lora_triton.FIELDS - len(row))


GROUPS = PROJECTION_GROUPS
FEW_ROWS = 16  # an adapter's rows in a step up to which the kernel serves them; more go to torch's products
_FIELDS = 13  # per adapter in a kernel table: A's address, its rows, r, k, then (address, column, width) x 3
_ADDRESSES = torch.tensor([1, 0, 0, 0, 1, 0, 0, 1, 0, 0, 1, 0, 0], dtype=torch.int64)


@functools.cache
def lora_kernel() -> Callable[..., int] | None:
    p, i = native.POINTER, native.INT64
    kernel: Callable[..., int] | None = native.function(
        "cpu_lora", "lora_rows", [p, i, p, i, i, p, i, p, i, i, p, i], i
    )
    return kernel


def kernel_for(device: torch.device) -> str | None:
    if device.type == "cpu":
        return "c" if lora_kernel() is not None else None
    return "triton" if device.type == "cuda" and lora_triton.triton is not None else None


def kernel_reads(adapter: Adapter, kernel: str) -> bool:
    """Whether the kernel can read this adapter: Triton's reads any; the compiled one float32 or bfloat16
    weights with each group's A matrices in one block."""
    if kernel == "triton":
        return True
    if adapter.regions.dtype not in (torch.float32, torch.bfloat16) or adapter.regions.stride(2) != 1:
        return False
    layout = adapter.layout
    return all(layout.stacked_a(present) is not None for group in GROUPS if (present := layout.present(group)))


def _address(adapter: Adapter, part: Part) -> int:
    """Where the part starts in the first layer of the adapter's regions."""
    regions = adapter.regions
    return int(regions.data_ptr() + (part.region * regions.stride(1) + part.offset) * regions.element_size())


def _kernel_tables(adapters: list[Adapter], widths: dict[str, tuple[int, int]]) -> torch.Tensor:
    """`[layers, groups, adapters, _FIELDS]` int64: where each adapter's matrices are in each layer."""
    first_rows = torch.stack([_first_layer_rows(adapter, widths) for adapter in adapters], dim=1)
    layer_bytes = torch.tensor([a.regions.stride(0) * a.regions.element_size() for a in adapters], dtype=torch.int64)
    steps = torch.arange(adapters[0].regions.shape[0], dtype=torch.int64)[:, None, None, None]
    return first_rows[None] + steps * (layer_bytes[None, None, :, None] * _ADDRESSES)


# The same pages in place give the same addresses step after step.
_ROWS_MEMO: dict[tuple[object, ...], torch.Tensor] = {}


def _first_layer_rows(adapter: Adapter, widths: dict[str, tuple[int, int]]) -> torch.Tensor:
    """`[groups, _FIELDS]`: the adapter's kernel table in the first layer."""
    regions = adapter.regions
    # The layout object itself in the key: the memo keeps it alive, so its id is never another's.
    key = (regions.data_ptr(), regions.stride(0), regions.stride(1), regions.element_size(), adapter.layout)
    held = _ROWS_MEMO.get(key)
    if held is not None:
        return held
    rows = torch.zeros((len(GROUPS), _FIELDS), dtype=torch.int64)
    layout = adapter.layout
    for g, group in enumerate(GROUPS):
        present = layout.present(group)
        if not present:
            continue
        row = [_address(adapter, layout.parts[present[0], "A"]), len(present) * layout.rank, layout.rank, len(present)]
        for projection in present:
            row += [_address(adapter, layout.parts[projection, "B"]), *widths[projection]]
        rows[g, : len(row)] = torch.tensor(row, dtype=torch.int64)
    if len(_ROWS_MEMO) >= 256:
        _ROWS_MEMO.clear()
    _ROWS_MEMO[key] = rows
    return rows
