"""Scratch tensors reused across layers and steps.

On a CPU a large tensor allocated afresh comes as new pages that the kernel zeroes on first touch:
a prefill step of 2,048 tokens allocated over a GiB of them, layer after layer, at a cost of a
tenth of its time (docs/kernel-measurements.md). A buffer whose use ends before the next one of its name is
taken (a layer's projection output, consumed within the layer) is taken from here instead.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator

import torch

REUSE_BYTES = 1 << 20  # below this an allocation is served from memory malloc already holds


class Workspace:
    """Tensors by name, each as large as the largest taken under that name so far."""

    def __init__(self):
        self._tensors: dict[str, torch.Tensor] = {}
        self._reuse_every_size = False

    def take(self, name: str, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """An uninitialized tensor of `shape`, valid until `name` is taken again."""
        size = math.prod(shape)
        tensor = self._tensors.get(name)
        if tensor is None or tensor.numel() < size or tensor.dtype != dtype or tensor.device != device:
            tensor = torch.empty(max(size, 1), dtype=dtype, device=device)
            self._tensors[name] = tensor
        return tensor[:size].view(shape)

    def take_if_large(
        self, name: str | None, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device
    ) -> torch.Tensor:
        """The buffer `name` (as `take`) where a name is given and the tensor is worth reusing
        (`reusable`); else a fresh uninitialized tensor."""
        if name is not None and (self._reuse_every_size or reusable(shape, dtype)):
            return self.take(name, shape, dtype, device)
        return torch.empty(shape, dtype=dtype, device=device)

    @contextlib.contextmanager
    def reusing_every_size(self) -> Iterator[None]:
        """Within, every named buffer is taken however small: a recording (kernels/replay.py) keeps what
        it was given, so it holds one buffer a name rather than a fresh one per layer."""
        self._reuse_every_size = True
        try:
            yield
        finally:
            self._reuse_every_size = False


def reusable(shape: tuple[int, ...], dtype: torch.dtype) -> bool:
    """Whether a tensor of this size is worth taking from a workspace rather than allocating."""
    return math.prod(shape) * dtype.itemsize >= REUSE_BYTES


step_scratch = Workspace()  # the forward pass's scratch (attention's too): one thread runs it
