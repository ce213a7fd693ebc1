"""The worker's paged KV cache: per layer one tensor `[2, num_blocks, block_size, kv_heads, head_dim]`."""

from __future__ import annotations

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
    def __init__(self, num_layers, num_blocks, block_size, num_kv_heads, head_dim, dtype, device):
        self.num_blocks = num_blocks
        self.block_size = block_size
        shape = (2, num_blocks, block_size, num_kv_heads, head_dim)
        self.layers = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
