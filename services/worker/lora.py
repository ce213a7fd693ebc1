"""LoRA adapters paged in the KV cache's memory (S-LoRA's unified paging).

The scheduler gives an adapter some device blocks of the KV pool (its pages) and sends a
`LoraLoad`; the worker reads the PEFT files (keeping the last `--max-cpu-loras` in host memory)
and writes them into those blocks. Within each layer's slice of its pages an adapter is laid out
projection by projection, in `shared.lora.PROJECTIONS` order: A (`[r, in]`), then B scaled by the
adapter's scaling (`[out, r]`). A step gathers the pages of the adapters its sequences run under
into one contiguous buffer each, and every projection adds `B @ (A @ x)` to the rows of each
adapter's sequences: one shrink and one expand per adapter and projection group (q/k/v, o,
gate/up, down).
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

import torch
from safetensors.torch import load_file

from services.worker.kv_cache import KVCache
from shared.lora import AdapterSpec, BaseShape, check_adapter, lora_tensor
from shared.protocol import LoraLoad


@dataclass(slots=True, frozen=True)
class _Part:
    offset: int  # in values of the model's dtype, within one layer's buffer
    rows: int
    cols: int


class AdapterLayout:
    """Where each targeted projection's A and B sit in one layer's buffer."""

    def __init__(self, spec: AdapterSpec, dims: dict[str, tuple[int, int]]):
        self.rank = spec.rank
        self.targets = spec.targets
        self.a: dict[str, _Part] = {}
        self.b: dict[str, _Part] = {}
        offset = 0
        for projection in spec.targets:  # the A matrices first, so that a group's are one [sum r, in] block
            size_in, _ = dims[projection]
            self.a[projection] = _Part(offset, spec.rank, size_in)
            offset += spec.rank * size_in
        for projection in spec.targets:
            _, size_out = dims[projection]
            self.b[projection] = _Part(offset, size_out, spec.rank)
            offset += spec.rank * size_out
        self.elements = offset


class Adapter:
    """One adapter's weights for a step: each layer's A and B views into a gathered copy of its pages."""

    def __init__(self, layout: AdapterLayout, layers: torch.Tensor):
        self.layout = layout
        self.layers = layers  # [num_layers, elements]

    def shrink(self, layer: int, projections: tuple[str, ...]) -> tuple[torch.Tensor, list[str]] | None:
        """The stacked A of those of `projections` it targets (`[k * r, in]`, one block in the buffer when
        they are consecutive targets), and which they are; None if it targets none of them."""
        present = [p for p in projections if p in self.layout.a]
        if not present:
            return None
        first, last = self.layout.a[present[0]], self.layout.a[present[-1]]
        end = last.offset + last.rows * last.cols
        consecutive = end - first.offset == len(present) * first.rows * first.cols
        if consecutive:
            return self.layers[layer, first.offset:end].view(-1, first.cols), present
        return torch.cat([self._part(layer, self.layout.a[p]) for p in present]), present

    def expand(self, layer: int, projection: str) -> torch.Tensor:
        return self._part(layer, self.layout.b[projection])

    def _part(self, layer: int, part: _Part) -> torch.Tensor:
        return self.layers[layer, part.offset : part.offset + part.rows * part.cols].view(part.rows, part.cols)


class LoraBatch:
    """A step's adapters and the rows of each; `add` is called by every projection group of every layer."""

    def __init__(self, segments: list[tuple[Adapter, torch.Tensor | slice]], widths: dict[str, tuple[int, int]]):
        self.segments = segments
        self.columns = widths  # projection -> (first column, width) in its group's fused output

    def add(self, layer: int, projections: tuple[str, ...], x: torch.Tensor, out: torch.Tensor) -> None:
        """`out` (the group's fused output for `x`) += each adapter's B @ A @ x on its rows."""
        for adapter, rows in self.segments:
            shrunk = adapter.shrink(layer, projections)
            if shrunk is None:
                continue
            a, present = shrunk
            s = x[rows] @ a.t().to(x.dtype)  # [n, k * r]
            r = adapter.layout.rank
            for k, projection in enumerate(present):
                delta = s[:, k * r : (k + 1) * r] @ adapter.expand(layer, projection).t().to(x.dtype)
                first, width = self.columns[projection] if len(projections) > 1 else (0, out.shape[1])
                target = out[:, first : first + width]
                if isinstance(rows, slice):
                    target[rows] += delta
                else:
                    target.index_add_(0, rows, delta)


class LoraAdapters:
    """The adapters this rank has loaded into pages of its KV cache."""

    def __init__(self, cache: KVCache, config, dtype: torch.dtype, max_rank: int, max_cpu_loras: int):
        self.base = BaseShape.from_config(config.to_dict() if hasattr(config, "to_dict") else vars(config))
        self.dims = self.base.dims
        self.num_layers = self.base.num_layers
        self.dtype = dtype
        self.max_rank = max_rank
        self.max_cpu_loras = max(1, max_cpu_loras)
        self.cache = cache
        item = torch.empty((), dtype=dtype).element_size()
        layer_block = cache.cache[0, :, 0]  # [2, block_size, kv_heads, head_dim]: one layer's part of a block
        self.half_bytes = layer_block[0].numel() * layer_block.element_size()
        self.page_elements = 2 * self.half_bytes // item
        self.loaded: dict[str, tuple[AdapterLayout, list[int]]] = {}
        self._host: OrderedDict[str, tuple[AdapterLayout, torch.Tensor]] = OrderedDict()
        group_widths = {("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj")}
        self.widths: dict[str, tuple[int, int]] = {}
        for group in group_widths:
            first = 0
            for projection in group:
                width = self.dims[projection][1]
                self.widths[projection] = (first, width)
                first += width

    def pages_for(self, layout: AdapterLayout) -> int:
        return -(-layout.elements // self.page_elements)

    def load(self, load: LoraLoad) -> None:
        """Write the adapter into its pages (read from its files unless host memory has it)."""
        layout, buffer = self._read(load.name, load.path)
        if len(load.pages) < self.pages_for(layout):
            raise ValueError(f"adapter {load.name!r} needs {self.pages_for(layout)} pages, got {len(load.pages)}")
        pages = torch.tensor(load.pages, dtype=torch.int64, device=self.cache.device)
        padded = torch.zeros((self.num_layers, len(load.pages) * self.page_elements), dtype=self.dtype)
        padded[:, : layout.elements] = buffer
        as_bytes = padded.view(torch.uint8).view(self.num_layers, len(load.pages), 2, self.half_bytes)
        self._pages_view()[:, :, pages] = as_bytes.transpose(1, 2).to(self.cache.device)
        self.loaded[load.name] = (layout, load.pages)

    def _pages_view(self) -> torch.Tensor:
        """The KV cache as bytes: [layers, 2, blocks, bytes of one layer's half of a block]."""
        cache = self.cache.cache
        return cache.view(torch.uint8).view(cache.shape[0], 2, cache.shape[2], self.half_bytes)

    def _read(self, name: str, path: str) -> tuple[AdapterLayout, torch.Tensor]:
        held = self._host.get(name)
        if held is not None:
            self._host.move_to_end(name)
            return held
        spec = check_adapter(name, path, self.base, self.max_rank)
        layout = AdapterLayout(spec, self.dims)
        tensors = load_file(f"{spec.path}/adapter_model.safetensors")
        buffer = torch.zeros((self.num_layers, layout.elements), dtype=self.dtype)
        for key, tensor in tensors.items():
            layer, projection, which = lora_tensor(key)
            part = (layout.a if which == "A" else layout.b)[projection]
            value = tensor.to(torch.float32) * (spec.scaling if which == "B" else 1.0)
            buffer[layer, part.offset : part.offset + part.rows * part.cols] = value.reshape(-1).to(self.dtype)
        self._host[name] = (layout, buffer)
        while len(self._host) > self.max_cpu_loras:
            self._host.popitem(last=False)
        return layout, buffer

    def batch(self, segments: list[tuple[str, list[int]]]) -> LoraBatch | None:
        """The step's adapters, each with the rows of its sequences; None when no row runs under one."""
        if not segments:
            return None
        gathered = []
        view = self._pages_view()
        for name, rows in segments:
            layout, pages = self.loaded[name]
            index = torch.tensor(pages, dtype=torch.int64, device=self.cache.device)
            flat = view[:, :, index].transpose(1, 2).contiguous().view(self.num_layers, -1).view(self.dtype)
            adapter = Adapter(layout, flat[:, : layout.elements])
            gathered.append((adapter, _rows(rows, self.cache.device)))
        return LoraBatch(gathered, self.widths)


def _rows(rows: list[int], device: torch.device) -> torch.Tensor | slice:
    if rows == list(range(rows[0], rows[0] + len(rows))):
        return slice(rows[0], rows[0] + len(rows))
    return torch.tensor(rows, dtype=torch.int64, device=device)

