"""Quantized products on a GPU at Llama-3.1-8B's shapes: the Triton codes kernel (W4A16 in groups of 128, and
FP8 W8A16; W4A16 also with its inputs never split, to show what splitting gives a decode step's rows) and W8A8 by
the Triton int8 kernel and by torch's integer product (cuBLAS), against torch's float16 product of the same weight.

    python benchmarks/quant_gpu_bench.py            # needs CUDA; writes benchmarks/results/quant_gpu_bench.json

Each figure is the median of 50 timed calls after 10 warm-up calls, by CUDA events.
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from benchmarks.paper_harness import machine  # noqa: E402
from benchmarks.provenance import commit  # noqa: E402
from kernels.quant_triton import (  # noqa: E402
    codes_gemm_triton,
    int8_linear_gpu,
    pack_codes_gpu,
)

SHAPES = {"q/k/v": (6144, 4096), "o": (4096, 4096), "gate/up": (28672, 4096), "down": (4096, 14336)}  # (N, K)
ROWS = (1, 16, 256)
GROUP = 128


def timed(call, repeats: int = 50) -> float:
    """Median milliseconds of `call`."""
    for _ in range(10):
        call()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        call()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def main() -> None:
    if not torch.cuda.is_available():
        sys.exit("needs a CUDA device")
    device = torch.device("cuda")
    rows_out = []
    for name, (n, k) in SHAPES.items():
        weight = torch.randn(n, k, device=device, dtype=torch.float16) * 0.02
        codes = torch.randint(0, 16, (n, k), dtype=torch.uint8, device=device)
        scales = torch.rand(n, k // GROUP, device=device) * 0.01
        offsets = -8 * scales
        int4 = pack_codes_gpu(codes, scales, offsets, "uint4")
        fp8_codes = weight.to(torch.float8_e4m3fn).view(torch.uint8)
        fp8 = pack_codes_gpu(
            fp8_codes, torch.ones(n, k // GROUP, device=device), torch.zeros(n, k // GROUP, device=device), "fp8"
        )
        int8_weight = torch.randint(-128, 128, (k, n), dtype=torch.int8, device=device)
        w_scales = torch.rand(n, device=device) * 0.01
        for rows in ROWS:
            x = torch.randn(rows, k, device=device, dtype=torch.float16)
            row = {
                "weight": name,
                "n": n,
                "k": k,
                "rows": rows,
                "fp16_ms": timed(lambda x=x, weight=weight: x @ weight.T),
                "w4a16_ms": timed(lambda x=x, int4=int4: codes_gemm_triton(x, *int4, "uint4")),
                "w4a16_unsplit_ms": timed(lambda x=x, int4=int4: codes_gemm_triton(x, *int4, "uint4", splits=1)),
                "fp8_w8a16_ms": timed(lambda x=x, fp8=fp8: codes_gemm_triton(x, *fp8, "fp8")),
                "w8a8_ms": timed(lambda x=x, w=int8_weight, s=w_scales: int8_linear_gpu(x, w, s, None)),
                "w8a8_int_mm_ms": timed(
                    lambda x=x, w=int8_weight, s=w_scales: int8_linear_gpu(x, w, s, None, sums_by="int_mm")
                ),
            }
            rows_out.append(row)
            print(
                f"{name:>8} {rows:>4} rows: fp16 {row['fp16_ms']:.3f} ms, W4A16 {row['w4a16_ms']:.3f} "
                f"({row['fp16_ms'] / row['w4a16_ms']:.2f}x; unsplit {row['w4a16_unsplit_ms']:.3f}), "
                f"FP8 {row['fp8_w8a16_ms']:.3f}, W8A8 {row['w8a8_ms']:.3f} ({row['fp16_ms'] / row['w8a8_ms']:.2f}x; "
                f"_int_mm {row['w8a8_int_mm_ms']:.3f})",
                flush=True,
            )
    out = ROOT / "benchmarks" / "results" / "quant_gpu_bench.json"
    out.write_text(json.dumps({**machine(), "commit": commit(), "group": GROUP, "rows": rows_out}, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
