"""Linear layers on a CPU, in float32: compiled kernels where torch's BLAS (MKL) is slow on this AMD
CPU, torch's own elsewhere (another dtype or device, no AVX2, no compiler). docs/kernels.md has
the measurements.

- `cpu_gemm.c` serves up to `GEMM_MAX_ROWS` rows (every decode step and verification, and
  prompts up to a step's default token budget) against weights packed into panels when the model
  loads (`pack_weights`), its chunks of panels claimed by the threads that share the call
  (`native.share`).
- `cpu_linear.c` serves up to `MAX_ROWS` rows of an unpacked weight (the TP shards' projections
  that take their weight directly).

`Linear` is `nn.Linear` with that dispatch: the models build their projections from it, so a
checkpoint loads into it as into `nn.Linear`. Its `weight` stays as loaded; the panels are a
second copy of it, made only where the kernel runs.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import nn

from kernels import native

MAX_ROWS = 6  # the unpacked kernel: past this the BLAS is about as fast per row
GEMM_MAX_ROWS = 2048  # the packed kernel: faster than MKL up to here, the most rows measured
PANEL = 16  # output columns per packed panel (cpu_gemm.c)
SPLIT_MACS = 1 << 21  # below this many multiply-adds a call is not worth sharing between threads
SPLIT_ROWS = 4  # nor below this many rows, where reading the weight bounds it, unless the weight is larger
SPLIT_WEIGHT = 1 << 20  # than this many parameters: then a second core reads it faster (docs/kernels.md)
CHUNKS_PER_THREAD = 8  # a shared call's panels come in this many chunks per thread, claimed in turn


@functools.cache
def native_kernel():
    p, i = native.POINTER, native.INT64
    return native.function("cpu_linear", "linear_f32", [p, i, p, p, p, i, i, i, i], i)


@functools.cache
def gemm_kernel():
    p, i = native.POINTER, native.INT64
    return native.function("cpu_gemm", "gemm_f32", [p, i, p, p, p, i, i, i, i, i, p, i], i)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """`F.linear(x, weight, bias)`."""
    rows = x.shape[0]
    if (rows <= MAX_ROWS and x.dim() == 2
            and x.dtype is torch.float32 and weight.dtype is torch.float32 and not x.is_cuda and x.stride(1) == 1
            and weight.is_contiguous() and not torch.is_grad_enabled() and (kernel := native_kernel()) is not None
            and (bias is None or bias.is_contiguous())):
        out = torch.empty((rows, weight.shape[0]), dtype=torch.float32)
        if kernel(x.data_ptr(), x.stride(0), weight.data_ptr(), 0 if bias is None else bias.data_ptr(),
                  out.data_ptr(), out.stride(0), rows, weight.shape[0], x.shape[1]) == 0:
            return out
    return F.linear(x, weight, bias)


def pack(weight: torch.Tensor) -> torch.Tensor:
    """`weight` [N, K] as panels [ceil(N / 16), K, 16]: panel p, row k holds W[16p .. 16p+15][k]."""
    n, k = weight.shape
    panels = -(-n // PANEL)
    padded = torch.zeros(panels * PANEL, k, dtype=weight.dtype)
    padded[:n] = weight
    return padded.view(panels, PANEL, k).transpose(1, 2).contiguous()


def gemm(x: torch.Tensor, panels: torch.Tensor, out_features: int, bias: torch.Tensor | None) -> torch.Tensor | None:
    """`x W^T + b` from W's panels; None where the kernel does not apply."""
    rows, width = x.shape
    kernel = gemm_kernel()
    if kernel is None or rows > GEMM_MAX_ROWS or x.stride(1) != 1 or torch.is_grad_enabled():
        return None
    out = torch.empty((rows, out_features), dtype=torch.float32)
    macs = rows * out_features * width
    split = (rows >= SPLIT_ROWS and macs >= SPLIT_MACS) or out_features * width >= SPLIT_WEIGHT
    args = (x.data_ptr(), x.stride(0), panels.data_ptr(), 0 if bias is None else bias.data_ptr(),
            out.data_ptr(), out_features, rows, out_features, width)
    done = native.share_units(kernel, args, panels.shape[0], split, CHUNKS_PER_THREAD)
    return out if done == 0 else None


class Linear(nn.Linear):
    panels: torch.Tensor | None = None

    def pack(self) -> None:
        """Pack the weight for `cpu_gemm.c`, where it will run: float32 on a CPU, kernel at hand."""
        weight = self.weight
        if (weight.dtype is torch.float32 and weight.device.type == "cpu" and gemm_kernel() is not None
                and (self.bias is None or self.bias.is_contiguous())):
            self.panels = pack(weight.detach())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.panels is not None and x.dim() == 2 and x.dtype is torch.float32:
            out = gemm(x, self.panels, self.out_features, self.bias)
            if out is not None:
                return out
        return linear(x, self.weight, self.bias)


def pack_weights(model: nn.Module) -> None:
    """Every `Linear` of `model` packed for the CPU kernel, where it applies."""
    for module in model.modules():
        if isinstance(module, Linear):
            module.pack()
