"""A gated MLP's activation, SiLU(gate) * up, from its fused gate_up projection: the compiled
kernel of `cpu_activation.c` on a CPU in float32, shared between cores as the linear layers are
(`native.share`); torch elsewhere."""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from kernels import native
from kernels.cpu_int8_linear import MAX_ROW_WIDTH, Int8Rows, Int8RowsFormat, rows_buffers, writing
from kernels.workspace import step_scratch

SPLIT_VALUES = 1 << 16  # outputs below which a call is not worth sharing between threads
CHUNKS_PER_THREAD = 4


@functools.cache
def native_kernel(symbol: str = "silu_mul_f32"):
    p, i = native.POINTER, native.INT64
    return native.function("cpu_activation", symbol, [p, i, p, i, i, i, i, p, i], i)


def silu_and_mul(gate_up: torch.Tensor, width: int, bf16_rows: bool = False) -> torch.Tensor:
    """`SiLU(gate_up[:, :width]) * gate_up[:, width:]`, written over the gate half of `gate_up` (a view
    of it is returned): no new tensor of activations' size, whose fresh pages cost more than the pass.
    With `bf16_rows`, into bfloat16 rows in the step's scratch where the compiled kernel runs (the
    rounding a product taking bfloat16 rows would do), and as without it elsewhere."""
    rows = gate_up.shape[0]
    if (
        gate_up.dtype is torch.float32
        and not gate_up.is_cuda
        and gate_up.dim() == 2
        and gate_up.stride(1) == 1
        and gate_up.shape[1] == 2 * width
        and not torch.is_grad_enabled()
        and (kernel := native_kernel("silu_mul_f32_bf16" if bf16_rows else "silu_mul_f32")) is not None
    ):
        if bf16_rows:
            out = step_scratch.take_if_large("activation rows", (rows, width), torch.bfloat16, gate_up.device)
            args = (gate_up.data_ptr(), gate_up.stride(0), out.data_ptr(), width, rows, width)
            if native.share_units(kernel, args, rows, rows * width >= SPLIT_VALUES, CHUNKS_PER_THREAD) == 0:
                return out
            return silu_and_mul(gate_up, width)
        args = (gate_up.data_ptr(), gate_up.stride(0), gate_up.data_ptr(), gate_up.stride(0), rows, width)
        if native.share_units(kernel, args, rows, rows * width >= SPLIT_VALUES, CHUNKS_PER_THREAD) == 0:
            return gate_up[:, :width]
    gate, up = gate_up.split(width, dim=-1)
    return F.silu(gate, inplace=True).mul_(up)


@functools.cache
def codes_kernel():
    p, i, f = native.POINTER, native.INT64, native.FLOAT
    return native.function("cpu_activation", "silu_mul_f32_int8", [p, i, p, p, f, i, i, i, i, i, p, i], i)


def silu_and_mul_int8(gate_up: torch.Tensor, width: int, rows_format: Int8RowsFormat) -> Int8Rows | None:
    """`silu_and_mul`'s rows quantized as a W8A8 down projection takes them (`rows_format`), in one pass, into the
    step's buffers "activation"; None where the compiled kernel does not take `gate_up`."""
    if (
        gate_up.dtype is not torch.float32
        or gate_up.is_cuda
        or gate_up.dim() != 2
        or gate_up.stride(1) != 1
        or gate_up.shape[1] != 2 * width
        or not 0 < width <= MAX_ROW_WIDTH
        or torch.is_grad_enabled()
        or (kernel := codes_kernel()) is None
    ):
        return None
    rows = gate_up.shape[0]
    out = rows_buffers("activation", rows, width, gate_up.device)
    args = (
        gate_up.data_ptr(),
        gate_up.stride(0),
        *writing(out, rows_format),
    )
    done = native.share_units(kernel, args, rows, rows * width >= SPLIT_VALUES, CHUNKS_PER_THREAD)
    return out if done == 0 else None
