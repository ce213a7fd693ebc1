"""W8A8 products on a CPU: the compiled kernels of `cpu_int8_gemm.c` (x's rows quantized to int8 per token, times
int8 weights, summed in int32), with a torch reference that gives the same numbers (the tests hold every build to
it, and it serves where no build loads).

Weights are packed once into panels of the build's width (`pack_int8`); a call (`int8_linear`) takes x's float32
rows, which each thread quantizes as it goes, or rows the kernel before it already quantized (`Int8Rows`: the
RMSNorm and SiLU kernels write them in the `Int8RowsFormat` the product asks for), and is shared by the threads as
`cpu_linear`'s calls are.
Where the CPU has AMX tiles for int8, the AVX512-VNNI build multiplies blocks of 16 rows in them, the same sums
(`use_tiles`). `quantize_rows` quantizes rows alone, as the kernel does (the tests hold every build to it).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from kernels import native
from kernels.workspace import step_scratch

SPLIT_MACS = 1 << 21  # below this many multiply-adds a call is not worth sharing between threads
SPLIT_BYTES = 1 << 19  # unless its weight is larger than this: one core reads it at a share of the memory's rate
CHUNKS_PER_THREAD = 8  # a call's chunks a thread for a block of rows (the kernel widens them for several)
QUANTIZE_SPLIT_VALUES = 1 << 16  # values of x below which its quantization stays on one thread
CODE_RANGE = 127.5  # a row's largest magnitude maps here: compressed-tensors' symmetric int8 range
MAX_ROW_WIDTH = 65536  # int8_rows.h's INT8_ROWS_MAX_WIDTH: the widest row a norm or activation quantizes itself


@dataclass(frozen=True, slots=True)
class Int8Build:
    """One build of cpu_int8_gemm.c: its two kernels and what packing for them needs."""

    linear: Callable[..., Any]
    quantize: Callable[..., Any]
    panel_width: int
    description: str
    variant: str
    tiles: Callable[[int], int]  # int8_use_amx: whether products of 16 rows or more use AMX tiles from now on
    linear_codes: Callable[..., Any]  # int8_linear of rows already quantized
    unsigned_codes: bool  # whether it takes codes as code + 128 (VNNI's unsigned bytes)


@dataclass(frozen=True, slots=True)
class Int8RowsFormat:
    """How a W8A8 product takes its rows already quantized (kernels/int8_rows.h): the checkpoint's static scale
    (0: a scale per row), and whether codes go in as code + 128."""

    static_scale: float
    unsigned: bool


@dataclass(frozen=True, slots=True)
class Int8Rows:
    """Rows of x as int8 codes [rows, padded_width(in_features)] in an `Int8RowsFormat`, and each row's scale [rows]:
    the input of a W8A8 product, written by the kernel before it."""

    codes: torch.Tensor
    scales: torch.Tensor
    in_features: int

    @property
    def shape(self) -> tuple[int, int]:
        """As the float rows' it stands for."""
        return self.codes.shape[0], self.in_features


@dataclass(frozen=True, slots=True)
class Int8Panels:
    """A weight packed for `int8_linear`: [panels, ceil(K / 4), width] words of four int8 of one column, and each
    column's sum of weights (the kernel's correction for taking x + 128 as unsigned bytes)."""

    panels: torch.Tensor
    colsums: torch.Tensor
    out_features: int
    in_features: int


@functools.cache
def int8_build(variant: str | None = None) -> Int8Build | None:
    """The build that runs here (or `variant`'s), None where none loads."""
    p, i, f = native.POINTER, native.INT64, native.FLOAT
    linear = native.function(
        "cpu_int8_gemm", "int8_linear", [p, i, f, p, p, p, p, p, i, i, i, i, i, p, i], i, variant=variant
    )
    quantize = native.function(
        "cpu_int8_gemm", "quantize_rows", [p, i, i, i, i, p, i, p, f, i, p, i], i, variant=variant
    )
    width = native.function("cpu_int8_gemm", "int8_panel_width", [], i, variant=variant)
    tiles = native.function("cpu_int8_gemm", "int8_use_amx", [i], i, variant=variant)
    linear_codes = native.function(
        "cpu_int8_gemm", "int8_linear_codes", [p, p, p, p, p, p, p, i, i, i, i, i, p, i], i, variant=variant
    )
    unsigned = native.function("cpu_int8_gemm", "int8_codes_unsigned", [], i, variant=variant)
    if any(f is None for f in (linear, quantize, width, tiles, linear_codes, unsigned)):
        return None
    library = native.load("cpu_int8_gemm", variant)
    assert library is not None  # its functions loaded
    library.int8_description.restype = native.ctypes.c_char_p
    description = library.int8_description().decode()
    if tiles(int(native.cpu_flags() >= native.AMX_INT8)):
        description += ", AMX tiles from 16 rows"
    return Int8Build(
        linear,
        quantize,
        width(),
        description,
        native.variant_of(library),
        tiles,
        linear_codes,
        bool(unsigned()),
    )


def use_tiles(on: bool, build: Int8Build | None = None) -> bool:
    """Whether `build` (the one that runs here) multiplies in AMX tiles from now on: where asked, the CPU has them
    and Linux lets this process use them. The tests compare both ways; the worker keeps what the build chose."""
    build = build or int8_build()
    return build is not None and bool(build.tiles(int(on and native.cpu_flags() >= native.AMX_INT8)))


def padded_width(in_features: int) -> int:
    """x's codes per row: K rounded up to whole words of four."""
    return -(-in_features // 4) * 4


def pack_int8(weight: torch.Tensor, build: Int8Build | None = None) -> Int8Panels:
    """`weight` [N, K] int8 as the build's panels."""
    build = build or int8_build()
    assert build is not None, "no int8 kernel builds here"
    width = build.panel_width
    n, k = weight.shape
    panels, words = -(-n // width), padded_width(k) // 4
    padded = torch.zeros(panels * width, words * 4, dtype=torch.int8)
    padded[:n, :k] = weight
    columns = padded.view(panels, width, words, 4).transpose(1, 2).contiguous()  # [panels, words, width, 4]
    colsums = padded.sum(1, dtype=torch.int32)
    return Int8Panels(columns.view(torch.int32).view(panels, words, width), colsums, n, k)


def quantize_rows(
    x: torch.Tensor, static_scale: float = 0.0, build: Int8Build | None = None, name: str | None = "int8 rows"
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """x's float32 rows [M, K] as int8 codes [M, padded_width(K)] and a scale per row (see cpu_int8_gemm.c): per
    token, or `static_scale` for every row where it is positive. In the step's buffers of `name`; None where the
    kernel does not apply."""
    build = build or int8_build()
    if build is None or x.dtype is not torch.float32 or x.dim() != 2 or x.stride(1) != 1:
        return None
    rows, width = x.shape
    codes = step_scratch.take_if_large(name, (rows, padded_width(width)), torch.int8, x.device)
    scales = step_scratch.take_if_large(None if name is None else f"{name} scales", (rows,), torch.float32, x.device)
    args = (
        x.data_ptr(),
        x.stride(0),
        rows,
        width,
        codes.shape[1],
        codes.data_ptr(),
        codes.stride(0),
        scales.data_ptr(),
        float(static_scale),
    )
    done = native.share_units(build.quantize, args, rows, rows * width >= QUANTIZE_SPLIT_VALUES, 1)
    return (codes, scales) if done == 0 else None


def rows_format(static_scale: float = 0.0, build: Int8Build | None = None) -> Int8RowsFormat | None:
    """How the build that runs here takes rows quantized before the call; None where none loads."""
    build = build or int8_build()
    return None if build is None else Int8RowsFormat(float(static_scale), build.unsigned_codes)


def int8_linear(
    x: torch.Tensor | Int8Rows,
    packed: Int8Panels,
    w_scales: torch.Tensor,
    bias: torch.Tensor | None,
    static_scale: float = 0.0,
    out: torch.Tensor | None = None,
    build: Int8Build | None = None,
) -> torch.Tensor | None:
    """x's float32 rows quantized per row (or by `static_scale` where positive), or x's rows as the kernel before
    quantized them (`Int8Rows`, in this build's `rows_format`), times W, scaled back by each row's scale and
    `w_scales`, plus `bias`: float32 [M, N] (into `out` where given); None where the kernel does not apply."""
    build = build or int8_build()
    if build is None or torch.is_grad_enabled():
        return None
    rows, n, k = x.shape[0], packed.out_features, packed.in_features
    rows_in: tuple[int | float, ...]
    if isinstance(x, Int8Rows):
        if x.in_features != k or x.codes.shape[1] != padded_width(k) or not x.codes.is_contiguous():
            return None
        rows_in, kernel = (x.codes.data_ptr(), x.scales.data_ptr()), build.linear_codes
    elif x.dtype is torch.float32 and x.dim() == 2 and x.stride(1) == 1:
        rows_in, kernel = (x.data_ptr(), x.stride(0), float(static_scale)), build.linear
    else:
        return None
    if out is None:
        out = torch.empty((rows, n), dtype=torch.float32)
    split = rows * n * k >= SPLIT_MACS or packed.panels.nbytes >= SPLIT_BYTES
    args = (
        *rows_in,
        packed.panels.data_ptr(),
        packed.colsums.data_ptr(),
        w_scales.data_ptr(),
        0 if bias is None else bias.data_ptr(),
        out.data_ptr(),
        out.stride(0),
        rows,
        n,
        k,
    )
    done = native.share_units(kernel, args, packed.panels.shape[0], split, CHUNKS_PER_THREAD)
    return out if done == 0 else None


def writing(rows: Int8Rows, rows_format: Int8RowsFormat) -> tuple[int | float, ...]:
    """The arguments by which a kernel before the product writes `rows` in `rows_format` (the norm's and the
    activation's, in this order): codes, scales, static scale, unsigned, rows, width, padded width."""
    return (
        rows.codes.data_ptr(),
        rows.scales.data_ptr(),
        rows_format.static_scale,
        int(rows_format.unsigned),
        *rows.shape,
        rows.codes.shape[1],
    )


def rows_buffers(name: str, rows: int, width: int, device: torch.device) -> Int8Rows:
    """The step's buffers `name` for `rows` rows of `width` values as codes (named, so that a recorded decode
    step holds one buffer a name: kernels/replay.py)."""
    codes = step_scratch.take(f"{name} codes", (rows, padded_width(width)), torch.int8, device)
    scales = step_scratch.take(f"{name} scales", (rows,), torch.float32, device)
    return Int8Rows(codes, scales, width)


def quantize_rows_reference(x: torch.Tensor, static_scale: float = 0.0) -> tuple[torch.Tensor, torch.Tensor]:
    """`quantize_rows` in torch, the same numbers: codes [M, K] and scales [M]."""
    x = x.float()
    if static_scale > 0:
        scales = torch.full((x.shape[0],), static_scale, dtype=torch.float32, device=x.device)
        inverse = torch.full_like(scales, 1.0) / static_scale
    else:
        top = x.abs().amax(dim=1)
        # tensors divided by tensors, as IEEE division: CUDA divides by a number as a product by its reciprocal,
        # and a number divided by a tensor is a reciprocal times it
        scales = torch.where(top > 0, top / torch.full_like(top, CODE_RANGE), torch.ones_like(top))
        inverse = torch.where(top > 0, torch.full_like(top, CODE_RANGE) / top, torch.zeros_like(top))
    codes = (x * inverse[:, None]).round().clamp(-128, 127).to(torch.int8)
    return codes, scales


def int8_rows_reference(x: torch.Tensor, rows_format: Int8RowsFormat) -> Int8Rows:
    """x's float32 rows as the kernel before a product writes them in `rows_format` (the same codes and scales, in
    fresh tensors), computed in torch."""
    codes, scales = quantize_rows_reference(x, rows_format.static_scale)
    offset = 128 if rows_format.unsigned else 0
    padded = torch.full((x.shape[0], padded_width(x.shape[1])), offset, dtype=torch.int32, device=x.device)
    padded[:, : x.shape[1]] += codes.int()
    return Int8Rows(padded.to(torch.uint8).view(torch.int8), scales, x.shape[1])


def int8_linear_reference(
    x: torch.Tensor, weight: torch.Tensor, w_scales: torch.Tensor, bias: torch.Tensor | None, static_scale: float = 0.0
) -> torch.Tensor:
    """`int8_linear` in torch from the unpacked int8 weight [N, K]: the same codes, their sums exactly, then the
    same float steps."""
    return scaled_sums(*quantize_rows_reference(x, static_scale), weight, w_scales, bias)


def scaled_sums(
    codes: torch.Tensor, scales: torch.Tensor, weight: torch.Tensor, w_scales: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    """Codes [M, >= K] times the int8 weight [N, K], exactly, then times each row's scale and w_scales, plus bias."""
    k = weight.shape[1]
    sums = codes[:, :k].to(torch.int64) @ weight.to(torch.int64).T  # exact, as the kernel's int32 sums are
    return scale_sums(sums, scales, w_scales, bias)


def scale_sums(
    sums: torch.Tensor, scales: torch.Tensor, w_scales: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    """Exact integer sums [M, N] as the kernels finish them: times each row's scale and w_scales, plus bias."""
    out = sums.to(torch.float32) * (scales[:, None] * w_scales.float()[None, :])
    return out if bias is None else out.add_(bias)  # a float32 sum of the bias's values, as `out + bias.float()`
