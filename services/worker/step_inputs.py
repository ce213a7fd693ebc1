"""A step's small tensors (token ids, positions, rows, offsets, temperatures, ...) from persistent
buffers rather than made afresh from Python lists.

`StepInputs.load` writes its fields side by side into one host buffer kept for the worker's life
(pinned on CUDA) and copies them to the device in one non-blocking copy: a step makes no tensor
from a list, and so never waits for the device to take one (`torch.tensor(values, device=...)`
copies from pageable memory and waits). The tensors it returns are views of one device buffer,
valid until the next `load` on the same object, which first waits for the previous copy to end:
long ended by then, as every step ends by reading its sampled ids. On a CPU the host buffer is the
device's and nothing is copied, so the tests of this path on a CPU are tests of the CUDA path.
Each user (the step, the block tables' writes, the draft model, the sampler, copy-on-write) owns
one. On a CPU it also spares a step its allocations (docs/kernel-measurements.md, "Step inputs").
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


class StepInputs:
    def __init__(self, device: torch.device, dtype: torch.dtype = torch.int64, capacity: int = 1024):
        self.device, self.dtype = device, dtype
        self.copied: torch.cuda.Event | None = None
        self._allocate(capacity)

    def _allocate(self, capacity: int) -> None:
        pinned = self.device.type == "cuda"
        self.host = torch.empty(capacity, dtype=self.dtype, pin_memory=pinned)
        self.host_values = self.host.numpy()  # numpy fills a slice from a list at C speed
        self.on_device = torch.empty(capacity, dtype=self.dtype, device=self.device) if pinned else self.host

    def load(self, *fields: Sequence[int] | Sequence[float] | torch.Tensor) -> list[torch.Tensor]:
        """Each field (a list of numbers, or a CPU tensor) as a 1-D tensor of this dtype on the device."""
        sizes = [len(field) for field in fields]
        total = sum(sizes)
        if self.copied is not None:
            self.copied.synchronize()
        if total > self.host.numel():
            self._allocate(max(total, 2 * self.host.numel()))
        at = 0
        for field, size in zip(fields, sizes):
            self.host_values[at : at + size] = field.numpy() if isinstance(field, torch.Tensor) else field
            at += size
        if self.on_device is not self.host:
            self.on_device[:total].copy_(self.host[:total], non_blocking=True)
            self.copied = torch.cuda.Event()
            self.copied.record()
        views, at = [], 0
        for size in sizes:
            views.append(self.on_device[at : at + size])
            at += size
        return views
