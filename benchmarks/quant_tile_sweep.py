"""The quantized GPU products under other tile plans and ways of reading codes, for judging `plan_tiles`' rules on a
GPU (never for one shape: the rules must hold across Llama-3.1-8B's four products):

- W4A16 with each word read once and spread over its codes, or read once per code (the first kernel's way);
- at 256 rows (a prompt), W4A16 and W8A8 under a handful of tile plans beside the one `plan_tiles` picks.

    python benchmarks/quant_tile_sweep.py      # needs CUDA; writes benchmarks/results/quant_tile_sweep.json

Every figure is the GPU's time alone: the median of 50 replays of a CUDA graph of 20 calls, a call's share.
"""

from __future__ import annotations

import json
import sys
from functools import partial
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from benchmarks.paper_harness import machine  # noqa: E402
from benchmarks.provenance import commit  # noqa: E402
from benchmarks.quant_gpu_bench import SHAPES, graph_timed, random_weights  # noqa: E402
from kernels.quant_triton import (  # noqa: E402
    TilePlan,
    codes_gemm_triton,
    int8_linear_gpu,
    quantize_rows_gpu,
)

PROMPT_PLANS = ((64, 128, 64, 8), (128, 64, 64, 4), (128, 64, 64, 8), (128, 128, 64, 8), (128, 64, 128, 8))


def main() -> None:
    if not torch.cuda.is_available():
        sys.exit("needs a CUDA device")
    device = torch.device("cuda")
    results = []
    for name, (n, k) in SHAPES.items():
        weight, int4, _, int8_weight, w_scales = random_weights(n, k, device)
        for rows in (1, 16, 256):
            x = torch.randn(rows, k, device=device, dtype=torch.float16)
            int4_product = partial(codes_gemm_triton, x, *int4, "uint4")
            int8_product = partial(int8_linear_gpu, x, int8_weight, w_scales, None)
            row = {
                "weight": name,
                "rows": rows,
                "fp16_ms": graph_timed(partial(torch.matmul, x, weight.T)),
                "quantize_rows_ms": graph_timed(partial(quantize_rows_gpu, x)),
                "w4a16_ms": graph_timed(int4_product),
                "w4a16_word_per_code_ms": graph_timed(partial(int4_product, unpack_once=False)),
                "w8a8_ms": graph_timed(int8_product),
                "w8a8_int_mm_ms": graph_timed(partial(int8_product, sums_by="int_mm")),
                "plans": [],
            }
            print(
                f"{name:>8} {rows:>4} rows: fp16 {row['fp16_ms']:.4f} ms, quantize {row['quantize_rows_ms']:.4f}, "
                f"W4A16 {row['w4a16_ms']:.4f} (a word a code {row['w4a16_word_per_code_ms']:.4f}), "
                f"W8A8 {row['w8a8_ms']:.4f} (_int_mm {row['w8a8_int_mm_ms']:.4f})",
                flush=True,
            )
            for block_m, block_n, block_k, warps in PROMPT_PLANS if rows >= 128 else ():
                plan = TilePlan(block_m, block_n, block_k, warps, 1, k // block_k)
                label = f"{block_m}x{block_n}x{block_k}, {warps} warps"
                try:
                    w4 = graph_timed(partial(int4_product, plan=plan))
                    w8 = graph_timed(partial(int8_product, plan=plan))
                except Exception as error:  # a tile the GPU's shared memory cannot hold
                    print(f"          {label}: {type(error).__name__}", flush=True)
                    continue
                row["plans"].append({"plan": label, "w4a16_ms": w4, "w8a8_ms": w8})
                print(f"          {label}: W4A16 {w4:.4f}, W8A8 {w8:.4f}", flush=True)
            results.append(row)
    out = ROOT / "benchmarks" / "results" / "quant_tile_sweep.json"
    out.write_text(json.dumps({**machine(), "commit": commit(), "rows": results}, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
