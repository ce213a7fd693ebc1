"""RMSNorm, fused with the residual add before it: the compiled kernel of `cpu_norm.c` on a CPU for
float32, Triton's (`norm_triton.py`) on CUDA, torch elsewhere (and where no compiler is at hand). Before a W8A8
product the kernel may write its rows as int8 codes (`rms_norm_int8`)."""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from kernels import dispatch, native
from kernels.cpu_int8_linear import MAX_ROW_WIDTH, Int8Rows, Int8RowsFormat, rows_buffers, writing
from kernels.norm_triton import rms_norm_triton
from kernels.workspace import step_scratch

SPLIT_VALUES = 1 << 16  # outputs below which a call is not worth sharing between threads
CHUNKS_PER_THREAD = 4


@functools.cache
def native_kernel(symbol: str = "rms_norm_f32"):
    p, i = native.POINTER, native.INT64
    return native.function("cpu_norm", symbol, [p, p, p, native.FLOAT, p, i, i, i, i, p, i], i)


def compiled_takes(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether a compiled norm may take `x` and `weight` as far as their dtypes and device go (the caller
    checks the layout it needs)."""
    return (
        x.dtype is torch.float32
        and weight.dtype is torch.float32
        and not x.is_cuda
        and weight.is_contiguous()
        and not torch.is_grad_enabled()
    )


def rms_norm(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    residual: torch.Tensor | None = None,
    output_slot: str | None = None,
    bf16_rows: bool = False,
) -> torch.Tensor:
    """`x` normalized over its last dimension and scaled by `weight`; with `residual`, first
    `residual += x` (in place), and then `residual` is what is normalized. With `output_slot`, a large
    result is written into the step's buffer of that name (kernels/workspace.py), for a caller whose use
    of it ends before the next norm of that name. With `bf16_rows`, float32 `x` is normalized into
    bfloat16 where the compiled kernel runs (the rounding a product taking bfloat16 rows would do), and
    into float32 elsewhere."""
    if dispatch.use_triton(x):
        return rms_norm_triton(x, weight, eps, residual)
    width = x.shape[-1]
    if (
        compiled_takes(x, weight)
        and x.is_contiguous()
        and (residual is None or (residual.is_contiguous() and residual.shape == x.shape))
        and (kernel := native_kernel("rms_norm_f32_bf16" if bf16_rows else "rms_norm_f32")) is not None
    ):
        out = step_scratch.take_if_large(
            output_slot, tuple(x.shape), torch.bfloat16 if bf16_rows else x.dtype, x.device
        )
        rows = x.numel() // width
        args = (
            x.data_ptr(),
            0 if residual is None else residual.data_ptr(),
            weight.data_ptr(),
            eps,
            out.data_ptr(),
            rows,
            width,
            width,
        )
        if native.share_units(kernel, args, rows, rows * width >= SPLIT_VALUES, CHUNKS_PER_THREAD) == 0:
            return out
    if residual is not None:
        x = residual.add_(x)
    if x.dtype == torch.float32:
        return F.rms_norm(x, weight.shape, weight, eps)
    dtype = x.dtype  # half types: computed in float32, as HF does
    x = x.to(torch.float32)
    return weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)).to(dtype)


@functools.cache
def codes_kernel():
    p, i, f = native.POINTER, native.INT64, native.FLOAT
    return native.function("cpu_norm", "rms_norm_f32_int8", [p, p, p, f, p, p, f, i, i, i, i, i, p, i], i)


def rms_norm_int8(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    residual: torch.Tensor | None,
    rows_format: Int8RowsFormat,
    output_slot: str,
) -> Int8Rows | None:
    """As `rms_norm`, the normalized rows quantized as a W8A8 product takes them (`rows_format`), into the step's
    buffers of `output_slot`: the rows `rms_norm` gives, quantized as the product would quantize them, in one pass.
    None, with `x` and `residual` untouched, where the compiled kernel does not take them."""
    width = x.shape[-1]
    if (
        x.dim() != 2
        or not 0 < width <= MAX_ROW_WIDTH
        or not compiled_takes(x, weight)
        or not x.is_contiguous()
        or (residual is not None and not (residual.is_contiguous() and residual.shape == x.shape))
        or (kernel := codes_kernel()) is None
    ):
        return None
    rows = x.shape[0]
    out = rows_buffers(output_slot, rows, width, x.device)
    args = (
        x.data_ptr(),
        0 if residual is None else residual.data_ptr(),
        weight.data_ptr(),
        eps,
        *writing(out, rows_format),
    )
    done = native.share_units(kernel, args, rows, rows * width >= SPLIT_VALUES, CHUNKS_PER_THREAD)
    assert done == 0, "the int8 norm failed after its checks"  # residual may have been added to: no fallback
    return out


@functools.cache
def heads_kernel():
    p, i = native.POINTER, native.INT64
    return native.function("cpu_norm", "rms_norm_heads_f32", [p, p, native.FLOAT, p, i, i, i, i, i, p, i], i)


def rms_norm_heads(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Each head of `x` [tokens, heads, head_dim] normalized on its own and scaled by `weight` [head_dim]
    (Qwen3's norm of q and k). Where the compiled kernel runs, in place: `x` may be a view of the q/k/v
    projection's rows, whose heads are then normalized where they lie, and `x` is returned; elsewhere a new
    tensor."""
    tokens, heads, width = x.shape
    if (
        compiled_takes(x, weight)
        and x.stride(2) == 1
        and x.stride(1) == width
        and (kernel := heads_kernel()) is not None
    ):
        args = (x.data_ptr(), weight.data_ptr(), eps, x.data_ptr(), tokens, heads, width, x.stride(0))
        if native.share_units(kernel, args, tokens, x.numel() >= SPLIT_VALUES, CHUNKS_PER_THREAD) == 0:
            return x
    return rms_norm(x, weight, eps)
