"""LoRA adapters paged in the KV cache's memory (S-LoRA's unified paging).

The scheduler gives an adapter some device blocks of the KV pool (its pages) and sends a
`LoraLoad`; the worker reads the PEFT files (keeping the last `--max-cpu-loras` in host memory)
and writes them into those blocks. In each layer's part of its pages an adapter's A matrices
(`[r, in]`) and then its B matrices (`[out, r]`, scaled by the adapter's scaling) follow one another
as `shared.lora.page_layout` places them. A step reads them in place where the pages are
consecutive blocks (as the scheduler gives them when it can), else from a copy it gathers once,
and every projection group (q/k/v, o, gate/up, down) adds `B @ (A @ x)` to the rows of each
adapter's sequences: one shrink and one expand per adapter.
"""

from __future__ import annotations

from collections import OrderedDict

import torch
from safetensors.torch import load_file

from services.worker.kv_cache import KVCache
from shared.lora import AdapterSpec, BaseShape, Part, check_adapter, lora_tensor, page_layout
from shared.protocol import LoraLoad


class AdapterLayout:
    """Where each targeted projection's A and B sit in a layer's part of the adapter's pages."""

    def __init__(self, spec: AdapterSpec, dims: dict[str, tuple[int, int]], half_elements: int):
        self.rank = spec.rank
        self.targets = spec.targets
        self.pages, self.parts = page_layout(spec.rank, spec.targets, dims, half_elements)


class Adapter:
    """One adapter's weights for a step: views of each layer's A and B into its pages, read in place when the
    pages are consecutive blocks, else into a copy gathered once for the step."""

    def __init__(self, layout: AdapterLayout, regions: torch.Tensor):
        self.layout = layout
        self.regions = regions  # [num_layers, 2, pages * values per half block]

    def shrink(self, layer: int, projections: tuple[str, ...]) -> tuple[torch.Tensor, list[str]] | None:
        """The stacked A of those of `projections` it targets (`[k * r, in]`: a view where they are
        consecutive in one region), and which they are; None if it targets none of them."""
        present = [p for p in projections if (p, "A") in self.layout.parts]
        if not present:
            return None
        parts = [self.layout.parts[p, "A"] for p in present]
        first, last = parts[0], parts[-1]
        if first.region == last.region and last.offset - first.offset == (len(parts) - 1) * first.rows * first.cols:
            end = last.offset + last.rows * last.cols
            return self.regions[layer, first.region, first.offset:end].view(-1, first.cols), present
        return torch.cat([self._view(layer, part) for part in parts]), present

    def expand(self, layer: int, projection: str) -> torch.Tensor:
        return self._view(layer, self.layout.parts[projection, "B"])

    def _view(self, layer: int, part: Part) -> torch.Tensor:
        return self.regions[layer, part.region, part.offset : part.offset + part.rows * part.cols].view(
            part.rows, part.cols)


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
        half = cache.cache[0, 0, 0]  # [block_size, kv_heads, head_dim]: one layer's keys in one block
        self.half_bytes = half.numel() * half.element_size()
        self.half_elements = self.half_bytes // item
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

    def load(self, load: LoraLoad) -> None:
        """Write the adapter into its pages (read from its files unless host memory has it)."""
        layout, regions = self._read(load.name, load.path)
        if len(load.pages) != layout.pages:
            raise ValueError(f"adapter {load.name!r} takes {layout.pages} pages, got {len(load.pages)}")
        pages = torch.tensor(load.pages, dtype=torch.int64, device=self.cache.device)
        as_bytes = regions.view(torch.uint8).view(self.num_layers, 2, layout.pages, self.half_bytes)
        self._pages_view()[:, :, pages] = as_bytes.to(self.cache.device)
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
        layout = AdapterLayout(spec, self.dims, self.half_elements)
        tensors = load_file(f"{spec.path}/adapter_model.safetensors")
        regions = torch.zeros((self.num_layers, 2, layout.pages * self.half_elements), dtype=self.dtype)
        for key, tensor in tensors.items():
            layer, projection, which = lora_tensor(key)
            part = layout.parts[projection, which]
            value = tensor.to(torch.float32) * (spec.scaling if which == "B" else 1.0)
            regions[layer, part.region, part.offset : part.offset + part.rows * part.cols] = value.reshape(-1).to(
                self.dtype)
        self._host[name] = (layout, regions)
        while len(self._host) > self.max_cpu_loras:
            self._host.popitem(last=False)
        return layout, regions

    def batch(self, segments: list[tuple[str, list[int]]]) -> LoraBatch | None:
        """The step's adapters, each with the rows of its sequences; None when no row runs under one."""
        if not segments:
            return None
        gathered = []
        view = self._pages_view()
        for name, rows in segments:
            layout, pages = self.loaded[name]
            first = pages[0]
            if pages == list(range(first, first + len(pages))):  # read in place
                held = view[:, :, first : first + len(pages)]
            else:
                held = view[:, :, torch.tensor(pages, dtype=torch.int64, device=self.cache.device)]
            regions = held.view(self.dtype).flatten(2)
            gathered.append((Adapter(layout, regions), _rows(rows, self.cache.device)))
        return LoraBatch(gathered, self.widths)


def _rows(rows: list[int], device: torch.device) -> torch.Tensor | slice:
    if rows == list(range(rows[0], rows[0] + len(rows))):
        return slice(rows[0], rows[0] + len(rows))
    return torch.tensor(rows, dtype=torch.int64, device=device)

