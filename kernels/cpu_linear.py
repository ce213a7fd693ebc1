"""Linear layers for a few rows at a time on a CPU: the compiled kernel of `cpu_linear.c` up to
`MAX_ROWS` rows, where the BLAS is slowest per row; torch's own above that, and wherever the kernel
does not apply (another dtype or device, no AVX2, no compiler). docs/kernels.md has the measurements.

`Linear` is `nn.Linear` with that dispatch: the models build their projections from it, so a
checkpoint loads into it as into `nn.Linear`.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import nn

from kernels import native

MAX_ROWS = 6  # past this the BLAS is about as fast per row


@functools.cache
def native_kernel():
    p, i = native.POINTER, native.INT64
    return native.function("cpu_linear", "linear_f32", [p, i, p, p, p, i, i, i, i], i)


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


class Linear(nn.Linear):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias)
