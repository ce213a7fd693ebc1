"""The quantized Triton kernels compiled for a Hopper GPU (sm_90) on a machine without one, as planned for a
product of `rows` rows by Llama-3.1-8B's 4,096 x 4,096: `python -m tests.compile_for_gpu ROWS` prints, as JSON,
each compiled kernel's stack (bytes a thread keeps in local memory: registers spilled) as `cuobjdump` from
Triton's wheel reads it, and whether the int8 sums run on the int8 tensor cores. tests/test_kernels.py runs it
with TRITON_INTERPRET unset."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from kernels import quant_triton

HOPPER = GPUTarget("cuda", 90, 32)
CUOBJDUMP = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")


def stack_bytes(kernel) -> int:
    with tempfile.NamedTemporaryFile(suffix=".cubin") as cubin:
        cubin.write(kernel.asm["cubin"])
        cubin.flush()
        usage = subprocess.run([CUOBJDUMP, "-res-usage", cubin.name], capture_output=True, text=True, check=True)
    return int(re.search(r"STACK:(\d+)", usage.stdout).group(1))


def compile_planned(fn, signature: dict, constants: dict, plan) -> object:
    tiles = {"BLOCK_M": plan.block_m, "BLOCK_N": plan.block_n, "BLOCK_K": plan.block_k}
    signature = {**signature, **dict.fromkeys(tiles, "constexpr")}
    return triton.compile(
        ASTSource(fn, signature, {**constants, **tiles}), target=HOPPER, options={"num_warps": plan.warps}
    )


def main(rows: int) -> dict:
    sizes = dict.fromkeys(("M", "N", "K"), "i32")
    stacks = {}
    for dtype, half, fp8, bits in (("*bf16", True, False, 4), ("*fp16", True, True, 8), ("*fp32", False, False, 4)):
        plan = quant_triton.plan_tiles(rows, 4096, 4096, 132, 2 * quant_triton.BLOCK_K, None, not half, unpacks=True)
        signature = {
            "x_ptr": dtype,
            "words_ptr": "*i32",
            "scales_ptr": "*fp32",
            "offsets_ptr": "*fp32",
            "out_ptr": "*fp32",
            "bias_ptr": dtype,
            **sizes,
            **dict.fromkeys(("stride_x", "stride_out", "stride_split", "GROUP", "SPAN"), "i32"),
            **dict.fromkeys(("BITS", "FP8", "HAS_BIAS", "HALF", "UNPACK_ONCE"), "constexpr"),
        }
        constants = {"BITS": bits, "FP8": fp8, "HAS_BIAS": True, "HALF": half, "UNPACK_ONCE": True}
        kernel = compile_planned(quant_triton._codes_gemm, signature, constants, plan)
        stacks[f"codes {dtype[1:]} rows"] = stack_bytes(kernel)
    plan = quant_triton.plan_tiles(rows, 4096, 4096, 132, 2 * quant_triton.BLOCK_K)
    signature = {"codes_ptr": "*i8", "weight_ptr": "*i8", "sums_ptr": "*i32", **sizes}
    signature |= {"stride_codes": "i32", "SPAN": "i32"}
    kernel = compile_planned(quant_triton._int8_sums, signature, {}, plan)
    stacks["int8 sums"] = stack_bytes(kernel)
    ptx = kernel.asm["ptx"]
    signature = {"x_ptr": "*bf16", "codes_ptr": "*i8", "scales_ptr": "*fp32", "K": "i32", "stride_x": "i32"}
    signature |= {"static_scale": "fp32", "static_inverse": "fp32", "STATIC": "constexpr", "BLOCK": "constexpr"}
    constants = {"STATIC": False, "BLOCK": quant_triton.QUANTIZE_BLOCK}
    options = {"num_warps": 4, "enable_fp_fusion": False}  # as quantize_rows_gpu launches it
    quantize = triton.compile(
        ASTSource(quant_triton._quantize_rows, signature, constants), target=HOPPER, options=options
    )
    stacks["quantize rows"] = stack_bytes(quantize)
    return {
        "stacks": stacks,
        "int8_tensor_cores": "mma" in ptx and ".s8" in ptx,
        "quantize_rounds_each_step": "fma" not in quantize.asm["ptx"] and "div.rn.f32" in quantize.asm["ptx"],
    }


if __name__ == "__main__":
    print(json.dumps(main(int(sys.argv[1]))))
