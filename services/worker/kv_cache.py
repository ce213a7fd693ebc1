"""The worker's KV cache: per layer one tensor `[2, num_blocks, block_size, kv_heads, head_dim]`
on the device, and the CPU swap space with the same layout (pinned host memory on CUDA).

The block operations here only execute what the scheduler decided: copies for copy-on-write,
whole-block moves between the device and the swap space, and with `--kv-cache-dir` block files
written from the device and read into the host cache, off the step (`services/worker/disk_tier.py`).
"""

from __future__ import annotations

import logging
import time
from concurrent.futures import FIRST_COMPLETED
from concurrent.futures import wait as wait_for

import torch

from kernels import dispatch
from kernels.kv_quant import cache_layout
from services.worker.disk_tier import DiskTier
from services.worker.kv_connectors import (
    ConnectorReport,
    DiskConnector,
    HostConnector,
    RemoteConnector,
    WorkerConnector,
)
from services.worker.kv_transport import layout_of
from services.worker.step_inputs import StepInputs
from shared.protocol import DEVICE, DISK, HOST, BlockTransfer, Step

log = logging.getLogger("pagedserve.worker.kv_cache")
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
        self.layout = layout_of(self.cache)
        # The one way KV enters or leaves (services/worker/kv_connectors.py): host memory always, block files with
        # --kv-cache-dir (`disk`), other engines with --kv-transfer-config (`remote`).
        self.connectors: list[WorkerConnector] = [HostConnector(self)]
        self._disk: DiskConnector | None = None
        self.remote: RemoteConnector | None = None
        self._refused: list[bytes] = []  # reads asked for with no folder to read from

    @property
    def disk(self) -> DiskTier | None:
        return self._disk.tier if self._disk is not None else None

    @disk.setter
    def disk(self, tier: DiskTier | None) -> None:
        self.connectors = [c for c in self.connectors if c is not self._disk]
        self._disk = DiskConnector(self, tier) if tier is not None else None
        if self._disk is not None:
            self.connectors.append(self._disk)

    def connect_remote(self, connector: RemoteConnector) -> None:
        self.remote = connector
        self.connectors.append(connector)

    def transfer(self, transfers: list[BlockTransfer]) -> None:
        """Carry out a step's block transfers in their order, each run of one kind at once, by the connector that
        moves that kind (copies within the device here); what a connector runs off the step it only starts."""
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
        if kind == (DEVICE, DEVICE):
            self.copy_blocks([(t.src_block, t.dst_block) for t in run])
            return
        connector = next((c for c in self.connectors if kind in c.moves), None)
        if connector is not None:
            connector.run(run)
        elif kind == (DEVICE, DISK):  # no folder: a block cached with no file to write is only not kept
            return
        elif kind == (DISK, HOST):  # and a read from it fails: the scheduler computes the block
            self._refused.extend(t.key for t in run)
        else:
            raise ValueError(f"no connector moves KV from tier {kind[0]} to tier {kind[1]}")

    def exchange(self, step: Step) -> None:
        """Each connector's part of the step beyond block transfers (a decode engine's fetches, say)."""
        for connector in self.connectors:
            connector.start(step)

    def await_reads(self, host_blocks: list[int]) -> None:
        if self._disk is not None:
            self._disk.await_blocks(host_blocks)

    def gather(self, blocks: list[int]) -> torch.Tensor:
        """Every layer's keys and values of these device blocks, in host memory."""
        return self.cache[:, :, torch.tensor(blocks, dtype=torch.int64, device=self.device)].to("cpu")

    def collect(self, wait: bool = False) -> ConnectorReport:
        """Transfers finished since the last call. With `wait` (a step with nothing to compute), first wait a
        little for one in flight to finish."""
        pending = [future for connector in self.connectors for future in connector.pending()]
        if wait and pending:
            wait_for(pending, timeout=READ_WAIT_SECONDS, return_when=FIRST_COMPLETED)
        report = ConnectorReport(failed_reads=self._refused)
        self._refused = []
        for connector in self.connectors:
            connector.collect(report)
        return report

    def forget_transfers(self) -> None:
        """The scheduler abandoned the transfers in flight (a step failed): they land, unreported, before their
        blocks can be given to anything else."""
        for connector in self.connectors:
            connector.forget()
        self._refused = []

    def close(self) -> None:
        for connector in self.connectors:
            connector.close()

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
