"""Quantized products on a GPU: weights as codes (W4A16, W8A16, FP8 W8A16) unpacked in a Triton kernel as they are
read, and W8A8's int8 sums in another (torch's `_int_mm`, cuBLAS's, stays for comparison in
benchmarks/quant_gpu_bench.py). CPUs have `cpu_gemm.c` and `cpu_int8_gemm.c`; under TRITON_INTERPRET=1 the Triton
kernels run on a CPU too, for the tests.

Codes lie as GPTQ lays them: [K / per word, N] int32 words, each `32 / bits` codes of consecutive inputs of one
output, the first in the low bits (FP8: four e4m3 bytes). A weight's value is code x scale + offset, with a scale
and an offset per output and group of inputs ([K / group, N] each).
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass

import torch

from kernels import cpu_int8_linear

try:
    import triton
    import triton.language as tl
except ImportError:
    triton = None

BLOCK_K = 32  # the narrowest tile of inputs: it divides every group size served (32 and up)
BITS = {"uint4": 4, "uint8": 8, "fp8": 8}
INT_MM_ROWS = 32
QUANTIZE_BLOCK = 1024


@dataclass(frozen=True, slots=True)
class TilePlan:
    """How a product's [M, N] output is cut: tiles of block_m x block_n, each summed over its inputs in steps of
    block_k by `warps` warps, the inputs split `splits` ways where the tiles alone would leave most of the GPU's
    multiprocessors idle (a decode step's few rows); the splits' partial sums are added in a fixed order
    afterwards. Each tile fits its warps' registers on sm_90 with nothing spilled to local memory
    (tests/compile_for_gpu.py checks)."""

    block_m: int
    block_n: int
    block_k: int
    warps: int
    splits: int
    steps_per_split: int

    def grid(self, m: int, n: int) -> tuple[int, int, int]:
        return -(-m // self.block_m), -(-n // self.block_n), self.splits


def plan_tiles(
    m: int,
    n: int,
    k: int,
    multiprocessors: int,
    block_k: int,
    splits: int | None = None,
    float32_rows: bool = False,
    unpacks: bool = False,
) -> TilePlan:
    """float32 rows are multiplied in float32 on the CUDA cores (not the tensor cores), whose sums take twice the
    registers of a half-precision tile's: narrower tiles. A kernel that `unpacks` its weight tile in registers
    takes tiles of 128 rows beyond 64, so each unpacked tile serves twice the rows: on an H200, 128 x 64 tiles
    took half the time of 64 x 128 for the codes kernel (docs/kernel-measurements.md, two of an 8B model's
    products)."""
    tall = unpacks and m > 64 and not float32_rows
    block_m = 16 if m <= 16 else 32 if m <= 32 or float32_rows else 128 if tall else 64
    block_n = 64 if m <= 16 or float32_rows or tall else 128
    block_k = BLOCK_K if float32_rows else block_k
    steps = -(-k // block_k)
    tiles = -(-m // block_m) * -(-n // block_n)
    wanted = splits if splits is not None else -(-2 * multiprocessors // tiles)  # two tiles' work a multiprocessor
    per_split = -(-steps // max(1, min(wanted, steps)))
    return TilePlan(block_m, block_n, block_k, 4 if block_m == 16 else 8, -(-steps // per_split), per_split)


def _multiprocessors(device: torch.device) -> int:
    return _cuda_multiprocessors(device.index or 0) if device.type == "cuda" else 1


@functools.cache
def _cuda_multiprocessors(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def pack_codes_gpu(
    codes: torch.Tensor, scales: torch.Tensor, offsets: torch.Tensor, kind: str
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`codes` [N, K] (uint8), `scales` and `offsets` [N, K / group] as the kernel reads them: words [K / per word,
    N] int32 and [K / group, N] float32 each."""
    bits = BITS[kind]
    per_word = 32 // bits
    n, k = codes.shape
    shifts = torch.arange(per_word, dtype=torch.int32, device=codes.device) * bits
    parts = codes.to(torch.int32).T.reshape(k // per_word, per_word, n) << shifts[None, :, None]
    words = parts.sum(1, dtype=torch.int32)
    return words.contiguous(), scales.T.float().contiguous(), offsets.T.float().contiguous()


def codes_gemm_triton(
    x: torch.Tensor,
    words: torch.Tensor,
    scales: torch.Tensor,
    offsets: torch.Tensor,
    kind: str,
    bias: torch.Tensor | None = None,
    splits: int | None = None,
    unpack_once: bool = True,
    plan: TilePlan | None = None,
) -> torch.Tensor:
    """x [M, K] times the weight the codes stand for, plus bias: [M, N] in x's dtype (float32 accumulation; a
    float32 x is multiplied in float32, never TF32, as torch's own float32 product is). `unpack_once` False reads
    each word once for every code in it (the first kernel's way); `plan` replaces `plan_tiles`' (both for
    benchmarks/quant_tile_sweep.py)."""
    m, k = x.shape
    x = x if x.stride(1) == 1 else x.contiguous()  # the kernel walks a row's inputs one element apart
    n = words.shape[1]
    group = k // scales.shape[0]
    if group % BLOCK_K or k % BLOCK_K:
        raise ValueError(f"the codes kernel takes groups and widths that are multiples of {BLOCK_K}")
    interpreted = os.environ.get("TRITON_INTERPRET") == "1"  # its bfloat16 dot is wrong: float32 there
    half = not interpreted and x.dtype in (torch.float16, torch.bfloat16)
    block_k = 2 * BLOCK_K if group % (2 * BLOCK_K) == 0 and k % (2 * BLOCK_K) == 0 else BLOCK_K
    plan = plan or plan_tiles(m, n, k, _multiprocessors(x.device), block_k, splits, not half, unpacks=True)
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    partial = out if plan.splits == 1 else torch.empty((plan.splits, m, n), dtype=torch.float32, device=x.device)
    _codes_gemm[plan.grid(m, n)](
        x,
        words,
        scales,
        offsets,
        partial,
        bias if bias is not None else out,
        m,
        n,
        k,
        x.stride(0),
        n,
        m * n,
        group,
        plan.steps_per_split * plan.block_k,
        BITS=BITS[kind],
        FP8=kind == "fp8",
        HAS_BIAS=bias is not None,
        HALF=half,
        UNPACK_ONCE=unpack_once,
        BLOCK_M=plan.block_m,
        BLOCK_N=plan.block_n,
        BLOCK_K=plan.block_k,
        num_warps=plan.warps,
    )
    if plan.splits > 1:
        out.copy_(partial.sum(0))
    return out


def int8_linear_gpu(
    x: torch.Tensor,
    weight: torch.Tensor,
    w_scales: torch.Tensor,
    bias: torch.Tensor | None,
    static_scale: float = 0.0,
    sums_by: str = "triton",
    splits: int | None = None,
    plan: TilePlan | None = None,
) -> torch.Tensor:
    """W8A8 on a GPU: x's rows quantized as the CPU kernel quantizes them, their int32 sums with the int8 weight [N,
    K] (the checkpoint's layout: each output's inputs adjacent, as the int8 tensor cores read both operands) by the
    Triton kernel, or by `torch._int_mm` (`sums_by` "int_mm", for comparison), then the CPU kernel's float steps in
    the same order; float32 [M, N], the numbers `int8_linear_reference` gives."""
    codes, scales = quantize_rows_gpu(x, static_scale)
    sums = _sums_by_int_mm(codes, weight) if sums_by == "int_mm" else _sums_by_triton(codes, weight, splits, plan)
    return cpu_int8_linear.scale_sums(sums, scales, w_scales, bias)


def quantize_rows_gpu(x: torch.Tensor, static_scale: float = 0.0) -> tuple[torch.Tensor, torch.Tensor]:
    """`quantize_rows_reference` in one kernel, a program a row: the same int8 codes [M, K] and scales [M]."""
    m, k = x.shape
    x = x if x.stride(1) == 1 else x.contiguous()  # the kernel walks a row's inputs one element apart
    codes = torch.empty((m, k), dtype=torch.int8, device=x.device)
    scales = torch.empty(m, dtype=torch.float32, device=x.device)
    _quantize_rows[(m,)](
        x,
        codes,
        scales,
        k,
        x.stride(0),
        *(_static_scale_and_inverse(static_scale) if static_scale > 0 else (0.0, 0.0)),
        STATIC=static_scale > 0,
        BLOCK=QUANTIZE_BLOCK,
        enable_fp_fusion=False,  # a product then a sum, each rounded, as the reference rounds them
    )
    return codes, scales


@functools.cache
def _static_scale_and_inverse(static_scale: float) -> tuple[float, float]:
    """A checkpoint's static input scale and its inverse as the CPU kernel makes them: float32, and IEEE division
    (made once per scale, not on every product)."""
    pair = torch.tensor([static_scale, 1.0], dtype=torch.float32)
    return pair[0].item(), (pair[1] / pair[0]).item()


def _sums_by_triton(
    codes: torch.Tensor, weight: torch.Tensor, splits: int | None, plan: TilePlan | None
) -> torch.Tensor:
    m, k = codes.shape
    n = weight.shape[0]
    plan = plan or plan_tiles(m, n, k, _multiprocessors(codes.device), 2 * BLOCK_K, splits)
    sums = torch.empty((plan.splits, m, n), dtype=torch.int32, device=codes.device)
    _int8_sums[plan.grid(m, n)](
        codes,
        weight,
        sums,
        m,
        n,
        k,
        codes.stride(0),
        plan.steps_per_split * plan.block_k,
        BLOCK_M=plan.block_m,
        BLOCK_N=plan.block_n,
        BLOCK_K=plan.block_k,
        num_warps=plan.warps,
    )
    return sums[0] if plan.splits == 1 else sums.sum(0, dtype=torch.int32)


def _sums_by_int_mm(codes: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """cuBLAS's int8 product takes rows in multiples of 32 on some shapes: zero rows pad them to one."""
    rows = codes.shape[0]
    padded = -(-rows // INT_MM_ROWS) * INT_MM_ROWS
    if padded != rows:
        codes = torch.cat([codes, codes.new_zeros(padded - rows, codes.shape[1])])
    return torch._int_mm(codes, weight.T)[:rows]


if triton is not None:
    CODE_RANGE = tl.constexpr(cpu_int8_linear.CODE_RANGE)
    ROUNDING = tl.constexpr(12582912.0)  # 1.5 x 2^23: added, then taken away, rounds a float32 half to even

    @triton.jit
    def _tile(M, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
        """This program's output rows and columns, and which of them exist."""
        rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
        cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        return rows, cols, rows < M, cols < N

    @triton.jit
    def _codes_gemm(
        x_ptr,
        words_ptr,
        scales_ptr,
        offsets_ptr,
        out_ptr,
        bias_ptr,
        M,
        N,
        K,
        stride_x,
        stride_out,
        stride_split,
        GROUP,
        SPAN,
        BITS: tl.constexpr,
        FP8: tl.constexpr,
        HAS_BIAS: tl.constexpr,
        HALF: tl.constexpr,
        UNPACK_ONCE: tl.constexpr,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr,
    ):
        rows, cols, row_in, col_in = _tile(M, N, BLOCK_M, BLOCK_N)
        split = tl.program_id(2)
        per_word: tl.constexpr = 32 // BITS
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        k_start = split * SPAN
        for k0 in range(k_start, tl.minimum(K, k_start + SPAN), BLOCK_K):
            ks = k0 + tl.arange(0, BLOCK_K)
            a = tl.load(x_ptr + rows[:, None].to(tl.int64) * stride_x + ks[None, :], mask=row_in[:, None], other=0.0)
            if UNPACK_ONCE:  # each word read once, its codes spread over the inputs they stand for
                word_rows = k0 // per_word + tl.arange(0, BLOCK_K // per_word)
                word = tl.load(words_ptr + word_rows[:, None].to(tl.int64) * N + cols[None, :], mask=col_in[None, :])
                shifts = tl.arange(0, per_word) * BITS
                code = tl.reshape((word[:, None, :] >> shifts[None, :, None]) & ((1 << BITS) - 1), (BLOCK_K, BLOCK_N))
            else:
                word = tl.load(
                    words_ptr + (ks // per_word)[:, None].to(tl.int64) * N + cols[None, :],
                    mask=col_in[None, :],
                    other=0,
                )
                code = (word >> ((ks % per_word) * BITS)[:, None]) & ((1 << BITS) - 1)
            if FP8:  # e4m3: its exponent and mantissa moved into float32's, 2^120 rebiasing 7 to 127
                magnitude = ((code & 0x7F) << 20).to(tl.float32, bitcast=True) * 1.329227995784916e36
                value = tl.where((code & 0x80) != 0, -magnitude, magnitude)
            else:
                value = code.to(tl.float32)
            group = (k0 // GROUP).to(tl.int64)
            scale = tl.load(scales_ptr + group * N + cols, mask=col_in, other=0.0)
            offset = tl.load(offsets_ptr + group * N + cols, mask=col_in, other=0.0)
            b = value * scale[None, :] + offset[None, :]
            if HALF:
                acc += tl.dot(a, b.to(a.dtype))
            else:
                acc += tl.dot(a.to(tl.float32), b, input_precision="ieee")
        if HAS_BIAS:  # once: the first split's partial sums carry it
            bias = tl.load(bias_ptr + cols, mask=col_in, other=0.0).to(tl.float32)
            acc += tl.where(split == 0, bias, 0.0)[None, :]
        tl.store(
            out_ptr + split.to(tl.int64) * stride_split + rows[:, None].to(tl.int64) * stride_out + cols[None, :],
            acc.to(out_ptr.dtype.element_ty),
            mask=row_in[:, None] & col_in[None, :],
        )

    @triton.jit
    def _int8_sums(
        codes_ptr,
        weight_ptr,
        sums_ptr,
        M,
        N,
        K,
        stride_codes,
        SPAN,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr,
    ):
        rows, cols, row_in, col_in = _tile(M, N, BLOCK_M, BLOCK_N)
        split = tl.program_id(2)
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.int32)
        k_start = split * SPAN
        k_end = tl.minimum(K, k_start + SPAN)
        for k0 in range(k_start, k_end, BLOCK_K):
            ks = k0 + tl.arange(0, BLOCK_K)
            k_in = ks < k_end
            a = tl.load(
                codes_ptr + rows[:, None].to(tl.int64) * stride_codes + ks[None, :],
                mask=row_in[:, None] & k_in[None, :],
                other=0,
            )
            b = tl.load(
                weight_ptr + cols[None, :].to(tl.int64) * K + ks[:, None], mask=k_in[:, None] & col_in[None, :], other=0
            )
            acc += tl.dot(a, b, out_dtype=tl.int32)
        tl.store(
            sums_ptr + (split.to(tl.int64) * M + rows[:, None]) * N + cols[None, :],
            acc,
            mask=row_in[:, None] & col_in[None, :],
        )

    @triton.jit
    def _quantize_rows(
        x_ptr,
        codes_ptr,
        scales_ptr,
        K,
        stride_x,
        static_scale,
        static_inverse,
        STATIC: tl.constexpr,
        BLOCK: tl.constexpr,
    ):
        row = tl.program_id(0).to(tl.int64)
        x_row = x_ptr + row * stride_x
        if STATIC:
            scale = static_scale
            inverse = static_inverse
        else:
            top = tl.zeros((BLOCK,), dtype=tl.float32)
            for k0 in range(0, K, BLOCK):
                ks = k0 + tl.arange(0, BLOCK)
                top = tl.maximum(top, tl.abs(tl.load(x_row + ks, mask=ks < K, other=0.0).to(tl.float32)))
            largest = tl.max(top, axis=0)
            scale = tl.where(largest > 0, tl.math.div_rn(largest, CODE_RANGE), 1.0)
            inverse = tl.where(largest > 0, tl.math.div_rn(CODE_RANGE, largest), 0.0)
        for k0 in range(0, K, BLOCK):
            ks = k0 + tl.arange(0, BLOCK)
            scaled = tl.load(x_row + ks, mask=ks < K, other=0.0).to(tl.float32) * inverse
            rounded = (scaled + ROUNDING) - ROUNDING
            tl.store(codes_ptr + row * K + ks, tl.clamp(rounded, -128.0, 127.0).to(tl.int8), mask=ks < K)
        tl.store(scales_ptr + row, scale)
