"""Quantized products on a GPU at Llama-3.1-8B's shapes: the Triton codes kernel (W4A16 in groups of 128, and
FP8 W8A16; W4A16 also with its inputs never split, to show what splitting gives a decode step's rows) and W8A8 by
the Triton int8 kernel and by torch's integer product (cuBLAS), against torch's float16 product of the same weight.

    python benchmarks/quant_gpu_bench.py            # needs CUDA; writes benchmarks/results/quant_gpu_bench.json

Each figure is the median of 50 timed calls after 10 warm-up calls, by CUDA events: eager calls (what a prompt
step pays, launches included) and replays of a CUDA graph of 20 calls (what a decode step in the worker's graphs
pays: the GPU's time alone).
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


def graph_timed(call, calls: int = 20) -> float:
    """Median milliseconds of one `call` replayed in a CUDA graph of `calls` calls."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            call()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            call()
    return timed(graph.replay) / calls


def random_weights(n: int, k: int, device: torch.device) -> tuple:
    """One [N, K] weight in each form: float16; 4-bit and FP8 codes as the codes kernel reads them; int8 with its
    per-output scales."""
    weight = torch.randn(n, k, device=device, dtype=torch.float16) * 0.02
    codes = torch.randint(0, 16, (n, k), dtype=torch.uint8, device=device)
    scales = torch.rand(n, k // GROUP, device=device) * 0.01
    int4 = pack_codes_gpu(codes, scales, -8 * scales, "uint4")
    ones, zeros = torch.ones(n, k // GROUP, device=device), torch.zeros(n, k // GROUP, device=device)
    fp8 = pack_codes_gpu(weight.to(torch.float8_e4m3fn).view(torch.uint8), ones, zeros, "fp8")
    int8_weight = torch.randint(-128, 128, (n, k), dtype=torch.int8, device=device)
    return weight, int4, fp8, int8_weight, torch.rand(n, device=device) * 0.01


def main() -> None:
    if not torch.cuda.is_available():
        sys.exit("needs a CUDA device")
    device = torch.device("cuda")
    rows_out = []
    for name, (n, k) in SHAPES.items():
        weight, int4, fp8, int8_weight, w_scales = random_weights(n, k, device)
        for rows in ROWS:
            x = torch.randn(rows, k, device=device, dtype=torch.float16)
            calls = {
                "fp16": lambda x=x, weight=weight: x @ weight.T,
                "w4a16": lambda x=x, int4=int4: codes_gemm_triton(x, *int4, "uint4"),
                "w4a16_unsplit": lambda x=x, int4=int4: codes_gemm_triton(x, *int4, "uint4", splits=1),
                "fp8_w8a16": lambda x=x, fp8=fp8: codes_gemm_triton(x, *fp8, "fp8"),
                "w8a8": lambda x=x, w=int8_weight, s=w_scales: int8_linear_gpu(x, w, s, None),
                "w8a8_int_mm": lambda x=x, w=int8_weight, s=w_scales: int8_linear_gpu(x, w, s, None, sums_by="int_mm"),
            }
            row = {"weight": name, "n": n, "k": k, "rows": rows}
            for label, call in calls.items():
                row[f"{label}_ms"] = timed(call)
                row[f"{label}_graph_ms"] = graph_timed(call)
            rows_out.append(row)
            for how in ("", "_graph"):
                fp16 = row[f"fp16{how}_ms"]
                print(
                    f"{name:>8} {rows:>4} rows {'graph' if how else 'eager'}: fp16 {fp16:.3f} ms, "
                    f"W4A16 {row[f'w4a16{how}_ms']:.3f} ({fp16 / row[f'w4a16{how}_ms']:.2f}x; "
                    f"unsplit {row[f'w4a16_unsplit{how}_ms']:.3f}), FP8 {row[f'fp8_w8a16{how}_ms']:.3f}, "
                    f"W8A8 {row[f'w8a8{how}_ms']:.3f} ({fp16 / row[f'w8a8{how}_ms']:.2f}x; "
                    f"_int_mm {row[f'w8a8_int_mm{how}_ms']:.3f})",
                    flush=True,
                )
    out = ROOT / "benchmarks" / "results" / "quant_gpu_bench.json"
    out.write_text(json.dumps({**machine(), "commit": commit(), "group": GROUP, "rows": rows_out}, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
