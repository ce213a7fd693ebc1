"""CPU linear layers, float32, one thread: torch's BLAS against the packed-panel kernel (`cpu_gemm.c`)
and, up to six rows, the unpacked one (`cpu_linear.c`).

Weights of the 12-layer, 768-wide Llama of `ops/configs/llama-12l-768` (fused q/k/v and gate/up,
the down projection and the LM head) and of the shipped model's MLP, at 1 to 128 rows (a decode
step's batch). Prints GFLOP/s (median over repeats) and writes benchmarks/results/cpu_linear_bench.json
(PAGEDSERVE_BENCH_OUT moves it; PAGEDSERVE_BENCH_ROWS and PAGEDSERVE_BENCH_REPEATS shrink it).

Each weight above is small enough to stay in the third-level cache between repeats. A real step
reads every layer's weights from memory (300 MiB on the 12-layer model), so a second table times
the linear layers of a whole 12-layer step, torch and packed calls alternating, at 1 and 2 threads
(PAGEDSERVE_BENCH_STEP_ROWS, PAGEDSERVE_BENCH_THREADS). Its last column has the panels on 2 MiB
huge pages, where the others have torch's default 4 KiB pages (run it without THP_MEM_ALLOC_ENABLE):
the worker asks for huge pages, and most of its panels land on them.
"""

from __future__ import annotations

import json
import mmap
import os
import platform
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from kernels.cpu_linear import GEMM_MAX_ROWS, MAX_ROWS, gemm, gemm_kernel, linear, native_kernel, pack  # noqa: E402

REPEATS = int(os.environ.get("PAGEDSERVE_BENCH_REPEATS", "25"))
ROWS = [int(r) for r in os.environ.get("PAGEDSERVE_BENCH_ROWS", "1,4,16,48,64").split(",")]
STEP_ROWS = [int(r) for r in os.environ.get("PAGEDSERVE_BENCH_STEP_ROWS", "1,4,16,48,128,256").split(",")]
THREADS = [int(t) for t in os.environ.get("PAGEDSERVE_BENCH_THREADS", "1,2").split(",")]
STEP_LAYERS = 12
HUGE_PAGE = 2 << 20
WEIGHTS = {  # name: (out features, in features)
    "12-layer qkv": (1280, 768), "12-layer o": (768, 768), "12-layer gate_up": (4096, 768),
    "12-layer down": (768, 2048), "12-layer lm_head": (4096, 768),
    "shipped gate_up": (1408, 256), "shipped down": (256, 704),
}


def median_s(run) -> float:
    times = []
    for _ in range(REPEATS + 3):
        started = time.perf_counter()
        run()
        times.append(time.perf_counter() - started)
    return statistics.median(times[3:])


def on_huge_pages(tensor: torch.Tensor, mappings: list[mmap.mmap]) -> torch.Tensor:
    """A copy of `tensor` in memory that asks the kernel for huge pages (where it has them on request)."""
    mapping = mmap.mmap(-1, tensor.nbytes + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    mapping.madvise(mmap.MADV_HUGEPAGE)
    mappings.append(mapping)
    whole = torch.frombuffer(mapping, dtype=torch.uint8)
    start = -whole.data_ptr() % HUGE_PAGE
    return whole[start:start + tensor.nbytes].view(tensor.dtype).view(tensor.shape).copy_(tensor)


def whole_step() -> list[dict]:
    """Milliseconds for the linear layers of one 12-layer step, torch against packed, alternating."""
    shapes = [WEIGHTS[f"12-layer {name}"] for name in ("qkv", "o", "gate_up", "down")] * STEP_LAYERS
    shapes.append(WEIGHTS["12-layer lm_head"])
    weights = [torch.randn(out_features, in_features) * 0.02 for out_features, in_features in shapes]
    panels = [pack(weight) for weight in weights]
    mappings: list[mmap.mmap] = []
    huge = [on_huge_pages(panel, mappings) for panel in panels]
    rows_out = []
    print(f"\nlinear layers of a whole {STEP_LAYERS}-layer step (weights from memory), ms")
    print(f"{'threads':>7}{'rows':>6}{'torch':>9}{'packed':>9}{'huge pages':>12}")
    for threads in THREADS:
        torch.set_num_threads(threads)
        for rows in STEP_ROWS:
            x = {width: torch.randn(rows, width) for _, width in shapes}
            calls = {"torch": lambda: [F.linear(x[w.shape[1]], w) for w in weights],
                     "packed": lambda: [gemm(x[w.shape[1]], p, w.shape[0], None) for w, p in zip(weights, panels)],
                     "packed_huge": lambda: [gemm(x[w.shape[1]], p, w.shape[0], None) for w, p in zip(weights, huge)]}
            times = {name: [] for name in calls}
            for _ in range(max(3, REPEATS // 5)):
                for name, call in calls.items():
                    started = time.perf_counter()
                    call()
                    times[name].append(time.perf_counter() - started)
            row = {"threads": threads, "rows": rows,
                   **{f"{name}_ms": round(1e3 * statistics.median(t), 2) for name, t in times.items()}}
            rows_out.append(row)
            print(f"{threads:>7}{rows:>6}{row['torch_ms']:>9.2f}{row['packed_ms']:>9.2f}{row['packed_huge_ms']:>12.2f}")
    torch.set_num_threads(1)
    return rows_out


def main() -> None:
    torch.set_num_threads(1)
    torch.set_grad_enabled(False)
    if gemm_kernel() is None:
        sys.exit("no C compiler or no AVX2: the packed kernel cannot be built here")
    if max(ROWS + STEP_ROWS) > GEMM_MAX_ROWS:
        sys.exit(f"{max(ROWS + STEP_ROWS)} rows: past the packed kernel's {GEMM_MAX_ROWS}")
    rows_out = []
    print(f"{'weight (out x in)':<32}{'rows':>5}{'torch':>8}{'packed':>8}{'unpacked':>10}  GFLOP/s")
    for name, (out_features, in_features) in WEIGHTS.items():
        weight = torch.randn(out_features, in_features) * 0.02
        panels = pack(weight)
        for rows in ROWS:
            x = torch.randn(rows, in_features)
            flops = 2 * rows * out_features * in_features / 1e9
            row = {"weight": name, "out_features": out_features, "in_features": in_features, "rows": rows,
                   "torch": flops / median_s(lambda: F.linear(x, weight)),
                   "packed": flops / median_s(lambda: gemm(x, panels, out_features, None))}
            if rows <= MAX_ROWS and native_kernel() is not None:
                row["unpacked"] = flops / median_s(lambda: linear(x, weight))
            rows_out.append({k: round(v, 1) if isinstance(v, float) else v for k, v in row.items()})
            unpacked = f"{row['unpacked']:>10.1f}" if "unpacked" in row else f"{'-':>10}"
            print(f"{name + f' ({out_features} x {in_features})':<32}{rows:>5}{row['torch']:>8.1f}"
                  f"{row['packed']:>8.1f}{unpacked}")
    step = whole_step()
    out_dir = os.environ.get("PAGEDSERVE_BENCH_OUT", os.path.join(os.path.dirname(__file__), "results"))
    os.makedirs(out_dir, exist_ok=True)
    result = {"machine": f"{platform.machine()}, {os.cpu_count()} cores", "threads": 1, "repeats": REPEATS,
              "date": time.strftime("%Y-%m-%d"), "unit": "GFLOP/s", "rows": rows_out,
              "whole_step": step}
    with open(os.path.join(out_dir, "cpu_linear_bench.json"), "w") as f:
        json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
