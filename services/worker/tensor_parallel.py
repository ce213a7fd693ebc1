"""A worker rank's share of a tensor-parallel model, Megatron-style, as the paper's §4.6 splits it:
attention by heads and the MLP by its inner width, each rank holding whole heads; the output and
down projections end with an all-reduce among the ranks. Embeddings and the LM head are
replicated, so every rank computes the same logits and samples the same tokens with the same
seeds: no rank waits for another's sample, and each keeps its own copy of every sequence.

With more ranks than KV heads, ranks share a KV head: each stores the one its query heads use.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import torch
import torch.distributed as dist

from kernels.cpu_linear import linear


@dataclass(frozen=True, slots=True)
class TensorParallel:
    rank: int = 0
    world_size: int = 1

    def split(self, total: int, what: str) -> tuple[int, int]:
        """This rank's (start, size) of `total` equal parts."""
        if total % self.world_size:
            raise ValueError(f"{what} ({total}) is not divisible by the tensor-parallel size ({self.world_size})")
        size = total // self.world_size
        return self.rank * size, size

    def kv_heads(self, num_kv_heads: int) -> tuple[int, int]:
        """This rank's (first KV head, number of KV heads); ranks share one when they outnumber them."""
        if self.world_size <= num_kv_heads:
            return self.split(num_kv_heads, "the number of KV heads")
        if self.world_size % num_kv_heads:
            raise ValueError(
                f"the tensor-parallel size ({self.world_size}) is not a multiple of the number of "
                f"KV heads ({num_kv_heads})"
            )
        return self.rank * num_kv_heads // self.world_size, 1

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        if self.world_size > 1:
            dist.all_reduce(x)
        return x


SINGLE = TensorParallel()


class Projection(Protocol):
    """What a row-parallel projection needs of a linear layer (services/worker/models/linear.py)."""

    bias: torch.Tensor | None

    def __call__(self, x: torch.Tensor) -> torch.Tensor: ...

    def product(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor: ...


def row_parallel(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, tp: TensorParallel, transposed: bool = False
) -> torch.Tensor:
    """A projection whose input is split over the ranks: partial sums, all-reduced, then the bias
    (`transposed`: a weight stored [in, out], as GPT-2's)."""
    out = tp.all_reduce(x @ weight if transposed else linear(x, weight))
    return out + bias if bias is not None else out


def row_parallel_linear(
    projection: Projection, x: torch.Tensor, tp: TensorParallel, partial: Callable[[torch.Tensor], object] | None = None
) -> torch.Tensor:
    """`partial`: called with this rank's partial sums before they are all-reduced, to add to them in place
    (a LoRA adapter's share of the projection, from this rank's part of its input)."""
    if tp.world_size == 1:
        out = projection(x)  # one fused call, bit for bit what it was before tensor parallelism
        if partial is not None:
            partial(out)
        return out
    out = projection.product(x, None)
    if partial is not None:
        partial(out)
    out = tp.all_reduce(out)
    return out + projection.bias if projection.bias is not None else out


@dataclass(frozen=True, slots=True)
class Shard:
    """Which part of a checkpoint tensor a rank loads: `size` rows (dim 0) or columns (dim 1) from
    `start`; with `parts`, as many such runs `stride` apart, side by side (GPT-2's fused q, k, v)."""

    dim: int
    start: int
    size: int
    parts: int = 1
    stride: int = 0

    def take(self, tensor_slice: Any) -> torch.Tensor:
        """From a safetensors slice, reading only this part."""
        runs = []
        for part in range(self.parts):
            start = self.start + part * self.stride
            end = start + self.size
            runs.append(tensor_slice[start:end] if self.dim == 0 else tensor_slice[:, start:end])
        return runs[0] if self.parts == 1 else torch.cat(runs, dim=self.dim)
