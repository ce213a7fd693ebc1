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
from typing import TYPE_CHECKING

import torch
from safetensors.torch import load as safetensors_load

from services.worker.kv_cache import KVCache
from services.worker.lora_kernels import (
    FEW_ROWS,
    GROUPS,
    CompiledKernel,
    PagedWeights,
    TritonKernel,
    kernel_for,
    kernel_reads,
)
from shared.lora import (
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
            part.rows, part.cols
        )


class LoraBatch:
    """A step's adapters and the rows of each; `add` is called by every projection group of every layer.

    Adapters with a few rows in the step (decoding sequences) go through a kernel, all of them in one call
    per group and layer, reading their weights in their pages: the compiled one on a CPU, Triton's on CUDA
    (`kernel`: "c", "triton" or None). Adapters with many rows (prompts) go through torch's matrix
    products, where the weights' reuse across rows pays."""

    def __init__(
        self,
        segments: list[tuple[Adapter, list[int]]],
        widths: dict[str, tuple[int, int]],
        device: torch.device,
        kernel: str | None = None,
        paged: PagedWeights | None = None,
    ):
        self.columns = widths  # projection -> (first column, width) in its group's output
        few = [
            (adapter, rows)
            for adapter, rows in segments
            if kernel is not None and len(rows) <= FEW_ROWS and kernel_reads(adapter, kernel)
        ]
        self.segments = [
            (adapter, _rows(rows, device))
            for adapter, rows in segments
            if not any(adapter is other for other, _ in few)
        ]
        self.kernel: CompiledKernel | TritonKernel | None = None  # for the adapters in `few`
        if few and kernel == "c":
            self.kernel = CompiledKernel(few, widths)
        elif few:
            assert paged is not None
            self.kernel = TritonKernel(few, widths, paged, device)

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


class LoraAdapters:
    """The adapters this rank has loaded into pages of its KV cache."""

    def __init__(
        self,
        cache: KVCache,
        config: PretrainedConfig,
        dtype: torch.dtype,
        max_rank: int,
        max_cpu_loras: int,
        shards: dict[str, tuple[str, int, int]] | None = None,
    ) -> None:
        self.base = BaseShape.from_config(config.to_dict() if hasattr(config, "to_dict") else vars(config))
        # With tensor parallelism, this rank's part of each projection: ("B", first output, outputs) where the
        # base layer's outputs are split (B's rows with them), ("A", first input, inputs) where its inputs are.
        self.shards = shards or {}
        self.dims: dict[str, tuple[int, int]] = {}  # this rank's (in, out) of each projection
        for projection, (size_in, size_out) in self.base.dims.items():
            kind, _, size = self.shards.get(projection, ("", 0, 0))
            self.dims[projection] = (
                (size, size_out) if kind == "A" else (size_in, size) if kind == "B" else (size_in, size_out)
            )
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
        self.kernel = kernel_for(cache.device)  # for a step's adapters with few rows: "c", "triton" or None
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
                self.dtype
            )
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
    return {
        "q_proj": ("B", *q),
        "k_proj": ("B", *kv),
        "v_proj": ("B", *kv),
        "o_proj": ("A", *q),
        "gate_proj": ("B", *inner),
        "up_proj": ("B", *inner),
        "down_proj": ("A", *inner),
    }


def _rows(rows: list[int], device: torch.device) -> torch.Tensor | slice:
    if rows == list(range(rows[0], rows[0] + len(rows))):
        return slice(rows[0], rows[0] + len(rows))
    return torch.tensor(rows, dtype=torch.int64, device=device)
