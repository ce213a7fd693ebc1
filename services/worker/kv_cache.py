"""The worker's KV cache: per layer one tensor `[2, num_blocks, block_size, kv_heads, head_dim]`
on the device, and the CPU swap space with the same layout (pinned host memory on CUDA).

The block operations here only execute what the scheduler decided: copies for copy-on-write,
and whole-block moves between the device and the swap space.
"""

from __future__ import annotations

import time

import torch

GIB = 1 << 30


def bytes_per_block(num_layers: int, block_size: int, num_kv_heads: int, head_dim: int, dtype) -> int:
    element = torch.empty((), dtype=dtype).element_size()
    return 2 * num_layers * block_size * num_kv_heads * head_dim * element


def num_blocks_that_fit(
    device: torch.device,
    block_bytes: int,
    gpu_memory_utilization: float,
    kv_cache_memory_gib: float,
) -> int:
    """On CUDA: what is left of `utilization` x total memory after the weights; on CPU: a set size."""
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        budget = total * gpu_memory_utilization - (total - free)
    else:
        budget = kv_cache_memory_gib * GIB
    return max(0, int(budget // block_bytes))


class KVCache:
    def __init__(self, num_layers, num_blocks, block_size, num_kv_heads, head_dim, dtype, device,
                 num_cpu_blocks: int = 0):
        self.num_blocks = num_blocks
        self.num_cpu_blocks = num_cpu_blocks
        self.block_size = block_size
        self.device = torch.device(device)
        shape = (2, num_blocks, block_size, num_kv_heads, head_dim)
        self.layers = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        cpu_shape = (2, num_cpu_blocks, block_size, num_kv_heads, head_dim)
        pin = self.device.type == "cuda"
        self.swap_space = [torch.empty(cpu_shape, dtype=dtype, pin_memory=pin) for _ in range(num_layers)]

    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        """Copy-on-write: block dst becomes a copy of block src, in every layer."""
        if not pairs:
            return
        src, dst = self._indices(pairs, self.device)
        for layer in self.layers:
            layer[:, dst] = layer[:, src]

    def swap_out(self, pairs: list[tuple[int, int]]) -> None:
        """(device block, CPU block) pairs."""
        if not pairs:
            return
        src, dst = self._indices(pairs, self.device)
        cpu_dst = dst.cpu()
        for layer, swap in zip(self.layers, self.swap_space):
            swap[:, cpu_dst] = layer[:, src].to("cpu", non_blocking=False)

    def swap_in(self, pairs: list[tuple[int, int]]) -> None:
        """(CPU block, device block) pairs."""
        if not pairs:
            return
        src, dst = self._indices(pairs, self.device)
        cpu_src = src.cpu()
        for layer, swap in zip(self.layers, self.swap_space):
            layer[:, dst] = swap[:, cpu_src].to(self.device)

    @staticmethod
    def _indices(pairs, device) -> tuple[torch.Tensor, torch.Tensor]:
        both = torch.tensor(pairs, dtype=torch.int64, device=device)
        return both[:, 0], both[:, 1]

    def measure_swap_bandwidth(self, num_blocks: int = 8) -> float:
        """Bytes per second moved by a round trip of a few blocks to the swap space and back."""
        num_blocks = min(num_blocks, self.num_blocks, self.num_cpu_blocks)
        if num_blocks == 0:
            return 0.0
        pairs = [(i, i) for i in range(num_blocks)]
        self.swap_out(pairs)  # warm up
        self._sync()
        started = time.perf_counter()
        self.swap_out(pairs)
        self.swap_in(pairs)
        self._sync()
        seconds = time.perf_counter() - started
        moved = 2 * num_blocks * sum(layer[:, 0].numel() * layer.element_size() for layer in self.layers)
        return moved / max(seconds, 1e-9)

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
