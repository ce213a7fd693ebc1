"""W8A8 products on a CPU: the compiled kernels of `cpu_int8_gemm.c` (int8 rows of x times int8 weights, summed
in int32) and the quantization of x's rows that feeds them, with a torch reference for each that gives the same
numbers (the tests hold every build to it, and it serves where no build loads).

Weights are packed once into panels of the build's width (`pack_int8`); a call quantizes x's float32 rows per
token (`quantize_rows`), then multiplies (`int8_gemm`), each kernel shared by the threads as `cpu_linear`'s are.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from kernels import native
from kernels.workspace import step_scratch

SPLIT_MACS = 1 << 21  # below this many multiply-adds a call is not worth sharing between threads
SPLIT_BYTES = 2 << 20  # unless its weight is larger than this (a second core then reads it faster)
CHUNKS_PER_THREAD = 8
QUANTIZE_SPLIT_VALUES = 1 << 16  # values of x below which its quantization stays on one thread
CODE_RANGE = 127.5  # a row's largest magnitude maps here: compressed-tensors' symmetric int8 range


@dataclass(frozen=True, slots=True)
class Int8Build:
    """One build of cpu_int8_gemm.c: its two kernels and what packing for them needs."""

    gemm: object
    quantize: object
    panel_width: int
    description: str
    variant: str


@dataclass(frozen=True, slots=True)
class Int8Panels:
    """A weight packed for `int8_gemm`: [panels, ceil(K / 4), width] words of four int8 of one column, and each
    column's sum of weights (the kernel's correction for taking x + 128 as unsigned bytes)."""

    panels: torch.Tensor
    colsums: torch.Tensor
    out_features: int
    in_features: int


@functools.cache
def int8_build(variant: str | None = None) -> Int8Build | None:
    """The build that runs here (or `variant`'s), None where none loads."""
    p, i, f = native.POINTER, native.INT64, native.FLOAT
    gemm = native.function("cpu_int8_gemm", "int8_gemm", [p, i, p, p, p, p, p, p, i, i, i, i, i, p, i], i,
                           variant=variant)
    quantize = native.function("cpu_int8_gemm", "quantize_rows", [p, i, i, i, i, p, i, p, f, i, p, i], i,
                               variant=variant)
    width = native.function("cpu_int8_gemm", "int8_panel_width", [], i, variant=variant)
    if gemm is None or quantize is None or width is None:
        return None
    library = native.load("cpu_int8_gemm", variant)
    library.int8_description.restype = native.ctypes.c_char_p
    return Int8Build(gemm, quantize, width(), library.int8_description().decode(), native.variant_of(library))


def padded_width(in_features: int) -> int:
    """x's codes per row: K rounded up to whole words of four."""
    return -(-in_features // 4) * 4


def pack_int8(weight: torch.Tensor, build: Int8Build | None = None) -> Int8Panels:
    """`weight` [N, K] int8 as the build's panels."""
    build = build or int8_build()
    width = build.panel_width
    n, k = weight.shape
    panels, words = -(-n // width), padded_width(k) // 4
    padded = torch.zeros(panels * width, words * 4, dtype=torch.int8)
    padded[:n, :k] = weight
    columns = padded.view(panels, width, words, 4).transpose(1, 2).contiguous()  # [panels, words, width, 4]
    colsums = padded.sum(1, dtype=torch.int32)
    return Int8Panels(columns.view(torch.int32).view(panels, words, width), colsums, n, k)


def quantize_rows(x: torch.Tensor, static_scale: float = 0.0, build: Int8Build | None = None,
                  name: str | None = "int8 rows") -> tuple[torch.Tensor, torch.Tensor] | None:
    """x's float32 rows [M, K] as int8 codes [M, padded_width(K)] and a scale per row (see cpu_int8_gemm.c): per
    token, or `static_scale` for every row where it is positive. In the step's buffers of `name`; None where the
    kernel does not apply."""
    build = build or int8_build()
    if build is None or x.dtype is not torch.float32 or x.dim() != 2 or x.stride(1) != 1:
        return None
    rows, width = x.shape
    codes = step_scratch.take_if_large(name, (rows, padded_width(width)), torch.int8, x.device)
    scales = step_scratch.take_if_large(None if name is None else f"{name} scales", (rows,), torch.float32,
                                        x.device)
    args = (x.data_ptr(), x.stride(0), rows, width, codes.shape[1], codes.data_ptr(), codes.stride(0),
            scales.data_ptr(), float(static_scale))
    done = native.share_units(build.quantize, args, rows, rows * width >= QUANTIZE_SPLIT_VALUES, 1)
    return (codes, scales) if done == 0 else None


def int8_gemm(codes: torch.Tensor, scales: torch.Tensor, packed: Int8Panels, w_scales: torch.Tensor,
              bias: torch.Tensor | None, out: torch.Tensor | None = None,
              build: Int8Build | None = None) -> torch.Tensor | None:
    """(codes W^T) * scales * w_scales + bias, float32 [M, N] (into `out` where given); None where the kernel
    does not apply."""
    build = build or int8_build()
    if build is None or torch.is_grad_enabled():
        return None
    rows = codes.shape[0]
    n, k = packed.out_features, packed.in_features
    if out is None:
        out = torch.empty((rows, n), dtype=torch.float32)
    split = rows * n * k >= SPLIT_MACS or packed.panels.nbytes >= SPLIT_BYTES
    args = (codes.data_ptr(), codes.stride(0), scales.data_ptr(), packed.panels.data_ptr(), packed.colsums.data_ptr(),
            w_scales.data_ptr(), 0 if bias is None else bias.data_ptr(), out.data_ptr(), out.stride(0), rows, n, k)
    done = native.share_units(build.gemm, args, packed.panels.shape[0], split, CHUNKS_PER_THREAD)
    return out if done == 0 else None


def quantize_rows_reference(x: torch.Tensor, static_scale: float = 0.0) -> tuple[torch.Tensor, torch.Tensor]:
    """`quantize_rows` in torch, the same numbers: codes [M, K] and scales [M]."""
    x = x.float()
    if static_scale > 0:
        scales = torch.full((x.shape[0],), static_scale, dtype=torch.float32)
        inverse = torch.full_like(scales, 1.0) / static_scale
    else:
        top = x.abs().amax(dim=1)
        scales = torch.where(top > 0, top / CODE_RANGE, torch.ones_like(top))
        # a tensor divided by a tensor, as IEEE division (a number divided by a tensor is a reciprocal times it)
        inverse = torch.where(top > 0, torch.full_like(top, CODE_RANGE) / top, torch.zeros_like(top))
    codes = (x * inverse[:, None]).round().clamp(-128, 127).to(torch.int8)
    return codes, scales


def int8_linear_reference(codes: torch.Tensor, scales: torch.Tensor, weight: torch.Tensor, w_scales: torch.Tensor,
                          bias: torch.Tensor | None) -> torch.Tensor:
    """`int8_gemm` in torch from the unpacked int8 weight [N, K]: int32 sums exactly, then the same float steps."""
    k = weight.shape[1]
    sums = codes[:, :k].to(torch.int64) @ weight.to(torch.int64).T  # exact; int32 in the kernel cannot overflow
    out = sums.to(torch.float32) * (scales[:, None] * w_scales.float()[None, :])
    return out if bias is None else out + bias.float()
