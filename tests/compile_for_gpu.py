"""The quantized Triton kernels compiled for a Hopper GPU (sm_90) on a machine without one, as planned for a
product of `rows` rows by Llama-3.1-8B's 4,096 x 4,096: `python -m tests.compile_for_gpu ROWS` prints what was
compiled as JSON (tests/test_kernels.py runs it with TRITON_INTERPRET unset)."""

from __future__ import annotations

import json
import sys

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from kernels import quant_triton

HOPPER = GPUTarget("cuda", 90, 32)


def main(rows: int) -> dict:
    plan = quant_triton.plan_tiles(rows, 4096, 4096, multiprocessors=132, block_k=64)
    tiles = {"BLOCK_M": plan.block_m, "BLOCK_N": plan.block_n, "BLOCK_K": plan.block_k}
    sizes = dict.fromkeys(("M", "N", "K"), "i32")
    codes = []
    for dtype, half, fp8, bits in (("*bf16", True, False, 4), ("*fp16", True, True, 8), ("*fp32", False, False, 4)):
        signature = {
            "x_ptr": dtype,
            "words_ptr": "*i32",
            "scales_ptr": "*fp32",
            "offsets_ptr": "*fp32",
            "out_ptr": "*fp32",
            "bias_ptr": dtype,
            **sizes,
            **dict.fromkeys(("stride_x", "stride_out", "stride_split", "GROUP", "SPAN"), "i32"),
            **dict.fromkeys(("BITS", "FP8", "HAS_BIAS", "HALF", *tiles), "constexpr"),
        }
        constants = {"BITS": bits, "FP8": fp8, "HAS_BIAS": True, "HALF": half, **tiles}
        triton.compile(ASTSource(quant_triton._codes_gemm, signature, constants), target=HOPPER)
        codes.append(dtype)
    signature = {
        "codes_ptr": "*i8",
        "weight_ptr": "*i8",
        "sums_ptr": "*i32",
        **sizes,
        "stride_codes": "i32",
        "SPAN": "i32",
        **dict.fromkeys(tiles, "constexpr"),
    }
    ptx = triton.compile(ASTSource(quant_triton._int8_sums, signature, tiles), target=HOPPER).asm["ptx"]
    return {"tiles": tiles, "codes": codes, "int8_tensor_cores": "mma" in ptx and ".s8" in ptx}


if __name__ == "__main__":
    print(json.dumps(main(int(sys.argv[1]))))
