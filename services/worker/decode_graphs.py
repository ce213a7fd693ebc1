"""Decode steps replayed from CUDA graphs: the host launches one graph per step, not some ten
kernels per layer.

A graph replays the kernels it captured on the device addresses it captured them with, so a
decode step (one token per sequence) runs on static buffers sized for the largest capture: its n
sequences fill their first n rows, and the rows up to the next captured size are padding, which
writes no KV (slot -1) and attends to one key of whatever block its table row names. Each size is
captured once, at start-up, largest first, all in one memory pool; the attention kernel's key
splits are chosen for the longest context a graph takes, and its programs past a sequence's
length end at once. Steps with a prompt chunk or proposals, more sequences than the largest
size, or a context past `max_context` run eagerly, as every step does under `--enforce-eager`.

On a CPU a step of each size (and thread count) is recorded the first time one runs, and later
steps of that size replay its kernel calls without the Python between them (kernels/replay.py):
the model's `embed` runs each step, its output copied into static buffers, and the layers (`run_layers`)
are replayed. Their attention reads a layout pinned in static tensors (`pin_decode_layout`) and scratch
sized for `max_context`. A model without that split, or whose layers compute anything in torch (the
torch kernels, tensor parallelism's reduction), runs each step eagerly on the same buffers. CUDA
capture itself is tested on a GPU (tests/test_gpu.py).
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import torch

from kernels import native
from kernels.batch import PagedBatch
from kernels.cpu_attention import decode_chunks, pin_decode_layout
from kernels.replay import Replay, record
from services.worker.block_tables import StepTensors
from services.worker.kv_cache import KVCache

if TYPE_CHECKING:
    from services.worker.models.base import PagedCausalLM

log = logging.getLogger("pagedserve.worker")

CAPTURE_SIZES = [1, 2, 4, *range(8, 256, 8), *range(256, 513, 16)]  # as vLLM captures


class DecodeGraphs:
    def __init__(
        self, model: PagedCausalLM, cache: KVCache, device: torch.device, max_batch: int = 512, max_context: int = 8192
    ) -> None:
        self.model, self.cache, self.device = model, cache, device
        self.sizes = [size for size in CAPTURE_SIZES if size <= max_batch] or [1]
        self.width = -(-max_context // cache.block_size)  # block table columns
        self.max_context = self.width * cache.block_size
        largest = self.sizes[-1]
        self.ids = torch.zeros(largest, dtype=torch.int64, device=device)
        self.positions = torch.zeros(largest, dtype=torch.int64, device=device)
        self.slots = torch.full((largest,), -1, dtype=torch.int64, device=device)
        self.lens = torch.ones(largest, dtype=torch.int32, device=device)
        self.tables = torch.zeros(largest, self.width, dtype=torch.int32, device=device)
        self.starts = torch.arange(largest + 1, dtype=torch.int32, device=device)  # one query token each
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.hidden: dict[int, torch.Tensor] = {}  # each graph's output
        self.replays = 0
        # On a CPU: by (size, threads), each recording's replay and output, or None where it was refused.
        self.recorded: dict[tuple[int, int], tuple[Replay, torch.Tensor] | None] = {}
        self.bounds: dict[tuple[int, int], torch.Tensor] = {}
        self.embedded: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None  # hidden, cos, sin

    def covers(self, num_tokens: int, context_lens: list[int]) -> bool:
        """Whether a step of `num_tokens` over sequences seeing `context_lens` runs from a graph."""
        return num_tokens == len(context_lens) <= self.sizes[-1] and max(context_lens) <= self.max_context

    def size_for(self, num_seqs: int) -> int:
        return int(next(size for size in self.sizes if size >= num_seqs))

    @torch.inference_mode()
    def capture(self) -> None:
        """Capture every size (CUDA only), largest first, sharing one memory pool."""
        pool = None
        warm_up = torch.cuda.Stream(self.device)
        for size in reversed(self.sizes):
            warm_up.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(warm_up):  # Triton compiles and the allocator settles outside the capture
                self._forward(size, [self.max_context] * size)
            torch.cuda.current_stream(self.device).wait_stream(warm_up)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self.hidden[size] = self._forward(size, [self.max_context] * size)
            pool = graph.pool()
            self.graphs[size] = graph
        torch.cuda.synchronize(self.device)

    def run(self, inputs: StepTensors) -> torch.Tensor:
        """The hidden states of a decode step whose inputs (`BlockTables.step`) a graph covers."""
        batch = inputs.batch
        n, width = batch.block_tables.shape  # width: the step's longest context, in blocks
        size = self.size_for(n)
        self.ids[:n] = inputs.input_ids
        self.positions[:n] = inputs.positions
        self.slots[:n] = batch.slot_mapping
        self.lens[:n] = batch.context_lens
        self.tables[:n, :width] = batch.block_tables  # columns past a context are never read
        if size > n:  # padding: written nowhere, one key seen
            self.ids[n:size] = 0
            self.positions[n:size] = 0
            self.slots[n:size] = -1
            self.lens[n:size] = 1
        self.replays += 1
        if size in self.graphs:
            self.graphs[size].replay()
            return self.hidden[size][:n]
        context_lens = batch.context_lens_list + [1] * (size - n)
        if self.device.type == "cpu" and hasattr(self.model, "run_layers"):
            return self._replayed(size, context_lens)[:n]
        return self._forward(size, context_lens)[:n]

    def _replayed(self, size: int, context_lens: list[int]) -> torch.Tensor:
        """A CPU step's layers replayed from the first step of its size and thread count, recorded now if
        none was."""
        hidden, (cos, sin) = self.model.embed(self.ids[:size], self.positions[:size])
        if self.embedded is None:
            self.embedded = tuple(torch.empty((self.sizes[-1], t.shape[1]), dtype=t.dtype) for t in (hidden, cos, sin))
        embedded, static_cos, static_sin = (buffer[:size] for buffer in self.embedded)
        embedded.copy_(hidden), static_cos.copy_(cos), static_sin.copy_(sin)
        threads = native.threads()
        key = (size, threads)
        if key not in self.bounds:
            self.bounds[key] = torch.zeros(decode_chunks(size, threads) + 1, dtype=torch.int64)
        batch = self._batch(size, context_lens)
        pin_decode_layout(batch, threads, self.bounds[key], self.max_context)
        if key in self.recorded:
            recorded = self.recorded[key]
            if recorded is None:
                return self.model.run_layers(embedded, (static_cos, static_sin), self.cache.layers, batch)
            recorded[0]()
            return recorded[1]
        output, replay, refusal = record(
            self.model.run_layers, embedded, (static_cos, static_sin), self.cache.layers, batch
        )
        if replay is None:
            log.info("decode steps of %d sequences run eagerly: %s", size, refusal)
        self.recorded[key] = None if replay is None else (replay, output)
        return output

    def _forward(self, size: int, context_lens: list[int]) -> torch.Tensor:
        return self.model(self.ids[:size], self.positions[:size], self.cache.layers, self._batch(size, context_lens))

    def _batch(self, size: int, context_lens: list[int]) -> PagedBatch:
        return PagedBatch(
            self.slots[:size],
            self.tables[:size],
            self.starts[: size + 1],
            self.lens[:size],
            list(range(size + 1)),
            context_lens,
        )
