"""LoRA adapters paged in the KV cache's memory (S-LoRA's unified paging).

The scheduler gives an adapter some device blocks of the KV pool (its pages) and sends a
`LoraLoad`; the worker reads the PEFT files (keeping the last `--max-cpu-loras` in host memory)
and writes them into those blocks. In each layer's part of its pages an adapter's A matrices
(`[r, in]`) and then its B matrices, transposed and scaled by the adapter's scaling (`[r, out]`),
follow one another as `shared.lora.page_layout` places them. A step reads them in place where the
pages are consecutive blocks (as the scheduler gives them when it can), else from a copy it
gathers once, and every projection group (q/k/v, o, gate/up, down) adds `B @ (A @ x)` to the rows
of each adapter's sequences (`LoraBatch`).
"""

from __future__ import annotations

import functools
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from safetensors.torch import load as safetensors_load

from kernels import lora_triton, native
from services.worker.kv_cache import KVCache
from shared.lora import (
    PROJECTION_GROUPS,
    AdapterSpec,
    BaseShape,
    LoraError,
    Part,
    check_adapter_files,
    lora_tensor,
    page_layout,
    read_adapter,
)
from shared.protocol import LoraLoad

if TYPE_CHECKING:
    from transformers import PretrainedConfig

    from services.worker.models.base import PagedCausalLM


class AdapterLayout:
    """Where each targeted projection's A and B sit in a layer's part of the adapter's pages."""

    def __init__(self, spec: AdapterSpec, dims: dict[str, tuple[int, int]], half_elements: int):
        self.rank = spec.rank
        self.half = half_elements
        self.pages, self.parts = page_layout(spec.rank, spec.targets, dims, half_elements)

    def present(self, projections: tuple[str, ...]) -> list[str]:
        """Those of `projections` the adapter changes."""
        return [p for p in projections if (p, "A") in self.parts]

    def stacked_a(self, present: list[str]) -> Part | None:
        """The A matrices of `present` as one `[k * r, in]` part, where they follow one another in one region."""
        parts = [self.parts[p, "A"] for p in present]
        first, last = parts[0], parts[-1]
        if first.region != last.region or last.offset - first.offset != (len(parts) - 1) * first.rows * first.cols:
            return None
        return Part(first.region, first.offset, len(parts) * first.rows, first.cols)


class Adapter:
    """One adapter's weights for a step: where its pages are, and views of each layer's A and B into them
    (read in place when the pages are consecutive blocks, else from a copy gathered the first time asked)."""

    def __init__(self, layout: AdapterLayout, pages: list[int], cache_bytes: torch.Tensor, dtype: torch.dtype):
        self.layout = layout
        self.pages = pages
        self._cache_bytes = cache_bytes  # [layers, 2, blocks, bytes of one layer's half of a block]
        self._dtype = dtype

    @functools.cached_property
    def regions(self) -> torch.Tensor:
        """[num_layers, 2, pages * values per half block]"""
        first = self.pages[0]
        if self.pages == list(range(first, first + len(self.pages))):  # in place
            held = self._cache_bytes[:, :, first : first + len(self.pages)]
        else:
            held = self._cache_bytes[:, :, torch.tensor(self.pages, dtype=torch.int64, device=self._cache_bytes.device)]
        return held.view(self._dtype).flatten(2)

    def shrink(self, layer: int, projections: tuple[str, ...]) -> tuple[torch.Tensor, list[str]] | None:
        """The stacked A of those of `projections` it targets (`[k * r, in]`: a view where they are
        consecutive in one region), and which they are; None if it targets none of them."""
        present = self.layout.present(projections)
        if not present:
            return None
        stacked = self.layout.stacked_a(present)
        if stacked is not None:
            return self._view(layer, stacked), present
        return torch.cat([self._view(layer, self.layout.parts[p, "A"]) for p in present]), present

    def expand(self, layer: int, projection: str) -> torch.Tensor:
        return self._view(layer, self.layout.parts[projection, "B"])

    def _view(self, layer: int, part: Part) -> torch.Tensor:
        return self.regions[layer, part.region, part.offset : part.offset + part.rows * part.cols].view(
            part.rows, part.cols)


class LoraBatch:
    """A step's adapters and the rows of each; `add` is called by every projection group of every layer.

    Adapters with a few rows in the step (decoding sequences) go through a kernel, all of them in one call
    per group and layer, reading their weights in their pages: the compiled one on a CPU, Triton's on CUDA
    (`kernel`: "c", "triton" or None). Adapters with many rows (prompts) go through torch's matrix
    products, where the weights' reuse across rows pays."""

    def __init__(self, segments: list[tuple[Adapter, list[int]]], widths: dict[str, tuple[int, int]],
                 device: torch.device, kernel: str | None = None, paged: PagedWeights | None = None):
        self.columns = widths  # projection -> (first column, width) in its group's output
        few = [(adapter, rows) for adapter, rows in segments
               if kernel is not None and len(rows) <= FEW_ROWS and _kernel_reads(adapter, kernel)]
        self.segments = [(adapter, _rows(rows, device)) for adapter, rows in segments
                         if not any(adapter is other for other, _ in few)]
        self.kernel: _CompiledKernel | _TritonKernel | None = None  # for the adapters in `few`
        if few and kernel == "c":
            self.kernel = _CompiledKernel(few, widths)
        elif few:
            assert paged is not None
            self.kernel = _TritonKernel(few, widths, paged, device)

    def add(self, layer: int, projections: tuple[str, ...], x: torch.Tensor, out: torch.Tensor) -> None:
        """`out` (the group's fused output for `x`) += each adapter's B @ A @ x on its rows."""
        if self.kernel is not None:
            self.kernel.add(layer, projections, x, out)
        for adapter, rows in self.segments:
            shrunk = adapter.shrink(layer, projections)
            if shrunk is None:
                continue
            a, present = shrunk
            s = x[rows] @ a.t().to(x.dtype)  # [n, k * r]
            r = adapter.layout.rank
            for k, projection in enumerate(present):
                delta = s[:, k * r : (k + 1) * r] @ adapter.expand(layer, projection).to(x.dtype)
                first, width = self.columns[projection]
                target = out[:, first : first + width]
                if isinstance(rows, slice):
                    target[rows] += delta
                else:
                    target.index_add_(0, rows, delta)


class _CompiledKernel:
    """`cpu_lora.c` over the adapters of a step's few rows, one call per group and layer."""

    def __init__(self, few: list[tuple[Adapter, list[int]]], widths: dict[str, tuple[int, int]]):
        function = lora_kernel()
        assert function is not None, "built only where the kernel loads"
        self.function = function
        self.units = torch.tensor([(row, index) for index, (_, rows) in enumerate(few) for row in rows],
                                  dtype=torch.int64)
        self.tables = _kernel_tables([adapter for adapter, _ in few], widths)
        self.weight_bf16 = int(few[0][0].regions.dtype == torch.bfloat16)

    def add(self, layer: int, projections: tuple[str, ...], x: torch.Tensor, out: torch.Tensor) -> None:
        if x.dtype is not torch.float32 or out.dtype is not torch.float32 or out.stride(1) != 1:
            raise ValueError("the LoRA kernel adds float32 rows into a float32 output")
        x = x if x.stride(1) == 1 else x.contiguous()
        table = self.tables[layer, GROUPS.index(projections)]
        units = len(self.units)
        args = (x.data_ptr(), x.stride(0), out.data_ptr(), out.stride(0), x.shape[1], self.units.data_ptr(), units,
                table.data_ptr(), self.weight_bf16)
        native.share_units(self.function, args, units, units >= 4, 1)


@dataclass(slots=True, frozen=True)
class PagedWeights:
    """The KV cache's memory as adapter values: `values` flat, `[layers, 2, blocks, half]` behind it."""

    values: torch.Tensor
    blocks: int
    half: int


class _TritonKernel:
    """`kernels.lora_triton` over the adapters of a step's few rows: their tables and page tables, made once
    per step on the device, serve every group of every layer."""

    def __init__(self, few: list[tuple[Adapter, list[int]]], widths: dict[str, tuple[int, int]],
                 paged: PagedWeights, device: torch.device):
        self.paged = paged
        adapters = [adapter for adapter, _ in few]
        self.units = torch.tensor([(row, index) for index, (_, rows) in enumerate(few) for row in rows],
                                  dtype=torch.int64, device=device)
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
        lora_triton.lora_add_triton(x if x.stride(1) == 1 else x.contiguous(), out, self.units, self.tables[g],
                                    self.page_table, paged.values, layer * 2 * paged.blocks * paged.half,
                                    paged.half, self.max_rank[g], self.max_width[g])


def _triton_row(adapter: Adapter, group: tuple[str, ...], widths: dict[str, tuple[int, int]]) -> list[int]:
    """The adapter's fields for one projection group as `kernels.lora_triton` takes them, offsets counted in
    its two regions taken one after the other."""
    layout = adapter.layout
    present = layout.present(group)
    row = [layout.rank if present else 0, len(present)]
    for projection in present:
        a, b = layout.parts[projection, "A"], layout.parts[projection, "B"]
        row += [a.region * len(adapter.pages) * layout.half + a.offset,
                b.region * len(adapter.pages) * layout.half + b.offset, *widths[projection]]
    return row + [0] * (lora_triton.FIELDS - len(row))


GROUPS = PROJECTION_GROUPS
FEW_ROWS = 16  # an adapter's rows in a step up to which the kernel serves them; more go to torch's products
_FIELDS = 13  # per adapter in a kernel table: A's address, its rows, r, k, then (address, column, width) x 3
_ADDRESSES = torch.tensor([1, 0, 0, 0, 1, 0, 0, 1, 0, 0, 1, 0, 0], dtype=torch.int64)


@functools.cache
def lora_kernel() -> Callable[..., int] | None:
    p, i = native.POINTER, native.INT64
    kernel: Callable[..., int] | None = native.function("cpu_lora", "lora_rows", [p, i, p, i, i, p, i, p, i, i, p, i],
                                                        i)
    return kernel


def _kernel_for(device: torch.device) -> str | None:
    if device.type == "cpu":
        return "c" if lora_kernel() is not None else None
    return "triton" if device.type == "cuda" and lora_triton.triton is not None else None


def _kernel_reads(adapter: Adapter, kernel: str) -> bool:
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
        row = [_address(adapter, layout.parts[present[0], "A"]), len(present) * layout.rank, layout.rank,
               len(present)]
        for projection in present:
            row += [_address(adapter, layout.parts[projection, "B"]), *widths[projection]]
        rows[g, : len(row)] = torch.tensor(row, dtype=torch.int64)
    if len(_ROWS_MEMO) >= 256:
        _ROWS_MEMO.clear()
    _ROWS_MEMO[key] = rows
    return rows


class LoraAdapters:
    """The adapters this rank has loaded into pages of its KV cache."""

    def __init__(self, cache: KVCache, config: PretrainedConfig, dtype: torch.dtype, max_rank: int, max_cpu_loras: int,
                 shards: dict[str, tuple[str, int, int]] | None = None) -> None:
        self.base = BaseShape.from_config(config.to_dict() if hasattr(config, "to_dict") else vars(config))
        # With tensor parallelism, this rank's part of each projection: ("B", first output, outputs) where the
        # base layer's outputs are split (B's rows with them), ("A", first input, inputs) where its inputs are.
        self.shards = shards or {}
        self.dims: dict[str, tuple[int, int]] = {}  # this rank's (in, out) of each projection
        for projection, (size_in, size_out) in self.base.dims.items():
            kind, _, size = self.shards.get(projection, ("", 0, 0))
            self.dims[projection] = (size, size_out) if kind == "A" else (size_in, size) if kind == "B" else (
                size_in, size_out)
        self.num_layers = self.base.num_layers
        self.dtype = dtype
        self.max_rank = max_rank
        self.max_cpu_loras = max(1, max_cpu_loras)
        self.cache = cache
        item = torch.empty((), dtype=dtype).element_size()
        half = cache.cache[0, 0, 0]  # [block_size, kv_heads, head_dim]: one layer's keys in one block
        self.half_bytes = half.numel() * half.element_size()
        self.half_elements = self.half_bytes // item
        self.loaded: dict[str, tuple[AdapterLayout, list[int]]] = {}
        self.kernel = _kernel_for(cache.device)  # for a step's adapters with few rows: "c", "triton" or None
        self._host: OrderedDict[str, tuple[AdapterLayout, torch.Tensor]] = OrderedDict()
        self.widths: dict[str, tuple[int, int]] = {}  # projection -> (first column, width) in its group's output
        for group in GROUPS:
            first = 0
            for projection in group:
                width = self.dims[projection][1]
                self.widths[projection] = (first, width)
                first += width

    def load(self, load: LoraLoad) -> None:
        """Write the adapter into its pages (read from its files unless host memory has it)."""
        layout, regions = self._read(load)
        if len(load.pages) != layout.pages:
            raise ValueError(f"adapter {load.name!r} takes {layout.pages} pages, got {len(load.pages)}")
        pages = torch.tensor(load.pages, dtype=torch.int64, device=self.cache.device)
        as_bytes = regions.view(torch.uint8).view(self.num_layers, 2, layout.pages, self.half_bytes)
        self._pages_view()[:, :, pages] = as_bytes.to(self.cache.device)
        self.loaded[load.key or load.name] = (layout, load.pages)

    def _pages_view(self) -> torch.Tensor:
        """The KV cache as bytes: [layers, 2, blocks, bytes of one layer's half of a block]."""
        cache = self.cache.cache
        return cache.view(torch.uint8).view(cache.shape[0], 2, cache.shape[2], self.half_bytes)

    def _read(self, load: LoraLoad) -> tuple[AdapterLayout, torch.Tensor]:
        key = load.key or load.name
        held = self._host.get(key)
        if held is not None:
            self._host.move_to_end(key)
            return held
        # Read once and checked whole: the files must still be those the api checked (their digest is the key).
        real, config, weights = read_adapter(load.name, load.path)
        spec = check_adapter_files(load.name, real, config, weights, self.base, self.max_rank)
        if load.key and spec.digest != load.key:
            raise LoraError(f"adapter {load.name!r}: its files changed since it was loaded")
        layout = AdapterLayout(spec, self.dims, self.half_elements)
        tensors = safetensors_load(weights)
        regions = torch.zeros((self.num_layers, 2, layout.pages * self.half_elements), dtype=self.dtype)
        for key, tensor in tensors.items():
            layer, projection, which = lora_tensor(key)
            part = layout.parts[projection, which]
            kind, first, size = self.shards.get(projection, ("", 0, 0))
            if kind == which == "A":
                tensor = tensor[:, first : first + size]
            elif kind == which == "B":
                tensor = tensor[first : first + size]
            value = tensor.to(torch.float32)
            if which == "B":
                value = value.t() * spec.scaling  # transposed, [r, out]: an expand reads rows
            regions[layer, part.region, part.offset : part.offset + part.rows * part.cols] = value.reshape(-1).to(
                self.dtype)
        self._host[key] = (layout, regions)
        while len(self._host) > self.max_cpu_loras:
            self._host.popitem(last=False)
        return layout, regions

    def batch(self, segments: list[tuple[str, list[int]]]) -> LoraBatch | None:
        """The step's adapters, each with the rows of its sequences; None when no row runs under one."""
        if not segments:
            return None
        view = self._pages_view()
        adapters = [(Adapter(*self.loaded[name], view, self.dtype), rows) for name, rows in segments]
        paged = None
        if self.kernel == "triton":
            paged = PagedWeights(view.view(-1).view(self.dtype), view.shape[2], self.half_elements)
        return LoraBatch(adapters, self.widths, self.cache.device, self.kernel, paged)


def tensor_parallel_shards(model: PagedCausalLM) -> dict[str, tuple[str, int, int]]:
    """This rank's part of each projection an adapter may change, as the model's layers split them."""
    layer = model.model.layers[0]
    attention, mlp, head = layer.self_attn, layer.mlp, layer.self_attn.head_dim
    q = (attention.first_head * head, attention.num_heads * head)
    kv = (attention.first_kv_head * head, attention.num_kv_heads * head)
    inner = (mlp.first, mlp.width)
    return {"q_proj": ("B", *q), "k_proj": ("B", *kv), "v_proj": ("B", *kv), "o_proj": ("A", *q),
            "gate_proj": ("B", *inner), "up_proj": ("B", *inner), "down_proj": ("A", *inner)}


def _rows(rows: list[int], device: torch.device) -> torch.Tensor | slice:
    if rows == list(range(rows[0], rows[0] + len(rows))):
        return slice(rows[0], rows[0] + len(rows))
    return torch.tensor(rows, dtype=torch.int64, device=device)

