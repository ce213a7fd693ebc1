"""The worker's KV cache: per layer one tensor `[2, num_blocks, block_size, kv_heads, head_dim]`
on the device, and the CPU swap space with the same layout (pinned host memory on CUDA).

The block operations here only execute what the scheduler decided: copies for copy-on-write,
whole-block moves between the device and the swap space, and with `--kv-cache-dir` block files
written from the device and read into the host cache, off the step (`services/worker/disk_tier.py`).
"""

from __future__ import annotations

import time
from concurrent.futures import FIRST_COMPLETED, Future
from concurrent.futures import wait as wait_for

import torch

from kernels import dispatch
from kernels.kv_quant import cache_layout
from services.worker.disk_tier import DiskTier
from services.worker.step_inputs import StepInputs
from shared.protocol import DEVICE, DISK, HOST, BlockTransfer

GIB = 1 << 30
READ_WAIT_SECONDS = 0.02  # a step with nothing to compute waits this long at most for a read from disk


def bytes_per_block(
    num_layers: int, block_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype, kv_cache_dtype: str = "auto"
) -> int:
    storage, width = cache_layout(head_dim, dtype, kv_cache_dtype)
    return 2 * num_layers * block_size * num_kv_heads * width * int(torch.empty((), dtype=storage).element_size())


def num_blocks_that_fit(
    device: torch.device, block_bytes: int, gpu_memory_utilization: float, kv_cache_memory_gib: float
) -> int:
    """On CUDA: what is left of `utilization` x total memory after the weights; on CPU: a set size."""
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        budget = total * gpu_memory_utilization - (total - free)
    else:
        budget = kv_cache_memory_gib * GIB
    return max(0, int(budget // block_bytes))


class KVCache:
    """One tensor `[layers, 2, blocks, block_size, kv_heads, head_dim]` on the device (each
    layer's view is what attention reads), and the swap space of the same layout on the host."""

    def __init__(
        self,
        num_layers: int,
        num_blocks: int,
        block_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device,
        num_cpu_blocks: int = 0,
        kv_cache_dtype: str = "auto",
    ) -> None:
        self.num_blocks = num_blocks
        self.num_cpu_blocks = num_cpu_blocks
        self.block_size = block_size
        self.device = torch.device(device)
        dtype, head_dim = cache_layout(head_dim, dtype, kv_cache_dtype)  # int8: each row carries its scale
        self.cache = torch.zeros(
            (num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim), dtype=dtype, device=self.device
        )
        self.layers = list(self.cache.unbind(0))
        on_cuda = self.device.type == "cuda"
        self.swap_space = torch.empty(
            (num_layers, 2, num_cpu_blocks, block_size, num_kv_heads, head_dim), dtype=dtype, pin_memory=on_cuda
        )
        self._side_stream = torch.cuda.Stream(self.device) if on_cuda else None
        self._pending_out: list[tuple[torch.cuda.Event, torch.Tensor, torch.Tensor]] = []
        self.staging = StepInputs(self.device)  # the step's copy-on-write pairs
        self.disk: DiskTier | None = None  # with --kv-cache-dir
        self.reads: dict[int, tuple[bytes, Future[bool]]] = {}  # host block -> its read from disk in flight

    def transfer(self, transfers: list[BlockTransfer]) -> None:
        """Carry out a step's block transfers in their order, each run of one kind at once; reads from disk are
        only started."""
        run: list[BlockTransfer] = []
        for transfer in transfers:
            if run and (transfer.src_tier, transfer.dst_tier) != (run[0].src_tier, run[0].dst_tier):
                self._run(run)
                run = []
            run.append(transfer)
        if run:
            self._run(run)

    def _run(self, run: list[BlockTransfer]) -> None:
        kind = (run[0].src_tier, run[0].dst_tier)
        if kind == (DISK, HOST):
            self.finish_swaps()  # a write-back to these host blocks may still be on its way
            for t in run:
                self.reads[t.dst_block] = (t.key, self._start_read(t))
            return
        pairs = [(t.src_block, t.dst_block) for t in run]
        if kind == (DEVICE, HOST) or kind == (HOST, DEVICE):
            self._await_reads([pair[kind.index(HOST)] for pair in pairs])
        if kind == (DEVICE, DISK):  # gathered at once, written in the background
            if self.disk is not None:
                src, _ = _columns(pairs)
                self.disk.write_many([t.key for t in run], self.cache[:, :, src.to(self.device)].to("cpu"))
            return
        {(DEVICE, HOST): self.swap_out, (HOST, DEVICE): self.swap_in, (DEVICE, DEVICE): self.copy_blocks}[kind](pairs)

    def _start_read(self, transfer: BlockTransfer) -> Future[bool]:
        if self.disk is None:
            refused: Future[bool] = Future()
            refused.set_result(False)
            return refused
        return self.disk.start_read(transfer.key, self.swap_space[:, :, transfer.dst_block])

    def _await_reads(self, host_blocks: list[int]) -> None:
        """Reads into these host blocks land before anything else touches them (the scheduler moves a block only
        once rank 0 reported its read, which another rank's may trail)."""
        for block in host_blocks:
            if block in self.reads:
                self.reads[block][1].result()

    def collect_reads(self, wait: bool = False) -> tuple[list[bytes], list[bytes]]:
        """Keys of the reads from disk done since the last call: (whole, refused). With `wait` (a step with
        nothing to compute), first wait a little for one to finish."""
        if wait and self.reads:
            wait_for(
                [future for _, future in self.reads.values()], timeout=READ_WAIT_SECONDS, return_when=FIRST_COMPLETED
            )
        whole: list[bytes] = []
        refused: list[bytes] = []
        for block, (key, future) in list(self.reads.items()):
            if future.done():
                del self.reads[block]
                (whole if not future.exception() and future.result() else refused).append(key)
        return whole, refused

    def forget_reads(self) -> None:
        """The scheduler abandoned the reads in flight (a step failed): they land, unreported, before their host
        blocks can be given to anything else."""
        for _, future in self.reads.values():
            future.exception()  # waits; a read that raised is only forgotten
        self.reads.clear()

    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        """Copy-on-write: block dst becomes a copy of block src, in every layer, in one launch."""
        if pairs and self.device.type == "cpu":
            copy_runs(self.cache, self.cache, pairs)
        elif pairs:
            [flat] = self.staging.load([block for pair in pairs for block in pair])
            dispatch.copy_blocks(self.cache, flat.view(-1, 2))

    def swap_out(self, pairs: list[tuple[int, int]]) -> None:
        """(device block, CPU block) pairs. On CUDA the copy to pinned memory runs on a side
        stream, overlapping this step's forward pass; `finish_swaps` lands it before the next step."""
        if not pairs:
            return
        if self._side_stream is None:
            copy_runs(self.swap_space, self.cache, pairs)
            return
        src, dst = _columns(pairs)
        gathered = self.cache[:, :, src.to(self.device)]  # ordered before this step's writes
        ready = torch.cuda.Event()
        ready.record()
        host = torch.empty(gathered.shape, dtype=gathered.dtype, pin_memory=True)
        with torch.cuda.stream(self._side_stream):
            self._side_stream.wait_event(ready)
            host.copy_(gathered, non_blocking=True)
            gathered.record_stream(self._side_stream)
            done = torch.cuda.Event()
            done.record()
        self._pending_out.append((done, host, dst))

    def swap_in(self, pairs: list[tuple[int, int]]) -> None:
        """(CPU block, device block) pairs; the blocks are in place before the forward reads them."""
        if not pairs:
            return
        self.finish_swaps()
        if self._side_stream is None:
            copy_runs(self.cache, self.swap_space, pairs)
            return
        src, dst = _columns(pairs)
        staged = torch.empty(
            self.swap_space[:, :, src[:1]].shape[:2] + (len(src),) + self.swap_space.shape[3:],
            dtype=self.swap_space.dtype,
            pin_memory=True,
        )
        torch.index_select(self.swap_space, 2, src, out=staged)
        with torch.cuda.stream(self._side_stream):
            on_device = staged.to(self.device, non_blocking=True)
            done = torch.cuda.Event()
            done.record()
        torch.cuda.current_stream(self.device).wait_event(done)
        on_device.record_stream(torch.cuda.current_stream(self.device))
        self.cache[:, :, dst.to(self.device)] = on_device

    def finish_swaps(self) -> None:
        """Wait for swap-outs in flight and file them into the swap space."""
        for done, host, dst in self._pending_out:
            done.synchronize()
            self.swap_space[:, :, dst] = host
        self._pending_out.clear()

    def measure_swap_bandwidth(self, num_blocks: int = 8) -> float:
        """Bytes per second moved by a round trip of a few blocks to the swap space and back."""
        num_blocks = min(num_blocks, self.num_blocks, self.num_cpu_blocks)
        if num_blocks == 0:
            return 0.0
        pairs = [(i, i) for i in range(num_blocks)]
        self.swap_out(pairs)  # warm up
        self.finish_swaps()
        started = time.perf_counter()
        self.swap_out(pairs)
        self.swap_in(pairs)
        self._sync()
        seconds = time.perf_counter() - started
        moved = 2 * num_blocks * self.cache[:, :, 0].numel() * self.cache.element_size()
        return float(moved / max(seconds, 1e-9))

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)


def copy_runs(dst: torch.Tensor, src: torch.Tensor, pairs: list[tuple[int, int]]) -> None:
    """Blocks `src[:, :, s]` into `dst[:, :, d]` for each (s, d) pair, on a CPU: one slice copy per run of pairs
    consecutive on both sides, a few times the rate of an indexed copy, which moves element by element."""
    i = 0
    while i < len(pairs):
        s, d = pairs[i]
        n = 1
        while i + n < len(pairs) and pairs[i + n] == (s + n, d + n):
            n += 1
        if n == 1:  # an index, not a slice: torch copies the 5-d view faster than the 6-d one
            dst[:, :, d].copy_(src[:, :, s])
        else:
            dst[:, :, d : d + n].copy_(src[:, :, s : s + n])
        i += n


def _columns(pairs: list[tuple[int, int]]) -> tuple[torch.Tensor, torch.Tensor]:
    both = torch.tensor(pairs, dtype=torch.int64)
    return both[:, 0], both[:, 1]
