"""Quantized products on a GPU: weights as codes (W4A16, W8A16, FP8 W8A16) unpacked in a Triton kernel as they are
read, and W8A8 through torch's integer product (`torch._int_mm`, cuBLAS's int8 GEMM). CPUs have `cpu_gemm.c` and
`cpu_int8_gemm.c`; under TRITON_INTERPRET=1 the Triton kernel runs on a CPU too, for the tests.

Codes lie as GPTQ lays them: [K / per word, N] int32 words, each `32 / bits` codes of consecutive inputs of one
output, the first in the low bits (FP8: four e4m3 bytes). A weight's value is code x scale + offset, with a scale
and an offset per output and group of inputs ([K / group, N] each).
"""

from __future__ import annotations

import os

import torch

from kernels import cpu_int8_linear

try:
    import triton
    import triton.language as tl
except ImportError:
    triton = None

BLOCK_M, BLOCK_N, BLOCK_K = 16, 64, 32  # BLOCK_K divides every group size served (32 and up)
BITS = {"uint4": 4, "uint8": 8, "fp8": 8}
INT_MM_MIN_ROWS = 17  # cuBLAS's int8 product takes more than 16 rows: fewer are padded with zero rows


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
) -> torch.Tensor:
    """x [M, K] times the weight the codes stand for, plus bias: [M, N] in x's dtype (float32 accumulation)."""
    m, k = x.shape
    n = words.shape[1]
    group = k // scales.shape[0]
    if group % BLOCK_K or k % BLOCK_K:
        raise ValueError(f"the codes kernel takes groups and widths that are multiples of {BLOCK_K}")
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    interpreted = os.environ.get("TRITON_INTERPRET") == "1"  # its bfloat16 dot is wrong: float32 there
    grid = (triton.cdiv(m, BLOCK_M), triton.cdiv(n, BLOCK_N))
    _codes_gemm[grid](
        x,
        words,
        scales,
        offsets,
        out,
        bias if bias is not None else out,
        m,
        n,
        k,
        x.stride(0),
        out.stride(0),
        group,
        BITS=BITS[kind],
        FP8=kind == "fp8",
        HAS_BIAS=bias is not None,
        HALF=not interpreted and x.dtype in (torch.float16, torch.bfloat16),
        BLOCK_M=BLOCK_M,
        BLOCK_N=BLOCK_N,
        BLOCK_K=BLOCK_K,
    )
    return out


def int8_linear_torch(
    x: torch.Tensor,
    weight_t: torch.Tensor,
    w_scales: torch.Tensor,
    bias: torch.Tensor | None,
    static_scale: float = 0.0,
) -> torch.Tensor:
    """W8A8 with torch's integer product: x's rows quantized as the CPU kernel quantizes them, their int32 sums by
    `torch._int_mm` (weight_t: [K, N] int8), then the same float steps; float32 [M, N]."""
    codes, scales = cpu_int8_linear.quantize_rows_reference(x.float(), static_scale)
    rows = codes.shape[0]
    if rows < INT_MM_MIN_ROWS:
        codes = torch.cat([codes, codes.new_zeros(INT_MM_MIN_ROWS - rows, codes.shape[1])])
    sums = torch._int_mm(codes, weight_t)[:rows]
    out = sums.float() * (scales[:, None] * w_scales[None, :])
    return out if bias is None else out + bias.float()


if triton is not None:

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
        GROUP,
        BITS: tl.constexpr,
        FP8: tl.constexpr,
        HAS_BIAS: tl.constexpr,
        HALF: tl.constexpr,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr,
    ):
        rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
        cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        row_in, col_in = rows < M, cols < N
        per_word: tl.constexpr = 32 // BITS
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            ks = k0 + tl.arange(0, BLOCK_K)
            a = tl.load(x_ptr + rows[:, None].to(tl.int64) * stride_x + ks[None, :], mask=row_in[:, None], other=0.0)
            word = tl.load(
                words_ptr + (ks // per_word)[:, None].to(tl.int64) * N + cols[None, :], mask=col_in[None, :], other=0
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
                acc += tl.dot(a.to(tl.float32), b)
        if HAS_BIAS:
            acc += tl.load(bias_ptr + cols, mask=col_in, other=0.0).to(tl.float32)[None, :]
        tl.store(
            out_ptr + rows[:, None].to(tl.int64) * stride_out + cols[None, :],
            acc.to(out_ptr.dtype.element_ty),
            mask=row_in[:, None] & col_in[None, :],
        )
