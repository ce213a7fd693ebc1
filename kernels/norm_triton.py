"""RMSNorm fused with the residual add before it, in Triton (the GPU's; `cpu_norm.c` is the CPU's):
one read of `x` and `residual`, one write of the sum and of the normalized row, where torch takes
five operations with a float32 copy of the row between them.

The arithmetic is HF's: the sum is rounded to the model's dtype, normalized in float32, rounded
again, and then scaled by the weight in the model's dtype.
"""

from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError:
    triton = None


def rms_norm_triton(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> torch.Tensor:
    """`x` normalized over its last dimension and scaled by `weight`; with `residual`, first
    `residual += x` (in place), and then `residual` is what is normalized."""
    width = x.shape[-1]
    rows = x.reshape(-1, width)
    if rows.stride(-1) != 1 or not weight.is_contiguous():
        raise ValueError("rms_norm_triton needs rows contiguous in their last dimension and a contiguous weight")
    sums = rows if residual is None else residual.view(-1, width)
    if residual is not None and (residual.shape != x.shape or sums.stride(-1) != 1):
        raise ValueError(f"residual {tuple(residual.shape)} does not match x {tuple(x.shape)}")
    out = torch.empty((rows.shape[0], width), dtype=x.dtype, device=x.device)
    if rows.shape[0]:
        _rms_norm_kernel[(rows.shape[0],)](
            rows,
            sums,
            weight,
            out,
            rows.stride(0),
            sums.stride(0),
            width,
            eps,
            HAS_RESIDUAL=residual is not None,
            BLOCK=triton.next_power_of_2(width),
        )
    return out.view(x.shape)


if triton is not None:

    @triton.jit
    def _rms_norm_kernel(
        x_ptr,
        residual_ptr,
        weight_ptr,
        out_ptr,
        stride_x,
        stride_residual,
        width,
        eps,
        HAS_RESIDUAL: tl.constexpr,
        BLOCK: tl.constexpr,
    ):
        row = tl.program_id(0).to(tl.int64)
        columns = tl.arange(0, BLOCK)
        inside = columns < width
        x = tl.load(x_ptr + row * stride_x + columns, mask=inside, other=0.0)
        if HAS_RESIDUAL:
            at = residual_ptr + row * stride_residual + columns
            x = (tl.load(at, mask=inside, other=0.0).to(tl.float32) + x.to(tl.float32)).to(x.dtype)
            tl.store(at, x, mask=inside)
        values = x.to(tl.float32)
        mean_square = tl.sum(values * values, axis=0) / width
        normalized = (values * tl.rsqrt(mean_square + eps)).to(x.dtype)
        weight = tl.load(weight_ptr + columns, mask=inside, other=0.0)
        scaled = (weight.to(tl.float32) * normalized.to(tl.float32)).to(x.dtype)
        tl.store(out_ptr + row * width + columns, scaled, mask=inside)
