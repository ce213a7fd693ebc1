"""A decode's product over 4-bit codes (W4A16) where the CPU has AMX tiles for bfloat16: the bfloat16 dot product
against the tiles (`cpu_linear.use_code_tiles`), both ways alternating in one process.

The projections of the gqa8 sweep shape (hidden 1,024: q, k and v together, gate and up together, down; groups
of 64) and of the 12-layer model's (hidden 768, groups of 128), bfloat16 rows of x, one thread by default
(PAGEDSERVE_BENCH_THREADS), 16, 32 and 48 rows (PAGEDSERVE_BENCH_ROWS). Prints the medians and the ratio, and
writes benchmarks/results/codes_tiles_bench.json (PAGEDSERVE_BENCH_OUT moves it).
"""

from __future__ import annotations

import json
import os
import platform
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from benchmarks.provenance import cpu_model  # noqa: E402
from kernels import cpu_linear  # noqa: E402

SHAPES = [  # name, N, K, group
    ("gqa8 qkv", 1536, 1024, 64),
    ("gqa8 gate+up", 5632, 1024, 64),
    ("gqa8 down", 1024, 2816, 64),
    ("12-layer qkv", 1280, 768, 128),
    ("12-layer down", 768, 2048, 128),
]
ROWS = [int(r) for r in os.environ.get("PAGEDSERVE_BENCH_ROWS", "16,32,48").split(",")]
REPEATS = int(os.environ.get("PAGEDSERVE_BENCH_REPEATS", "9"))
THREADS = int(os.environ.get("PAGEDSERVE_BENCH_THREADS", "1"))


def main() -> None:
    torch.set_num_threads(THREADS)
    torch.set_grad_enabled(False)
    build = cpu_linear.gemm_build()
    if build is None:
        sys.exit("no C compiler: the packed kernels cannot be built here")
    if not build.bf16_rows or not cpu_linear.use_code_tiles(True, build):
        sys.exit("no AMX tiles for bfloat16 here (or no bfloat16 dot product in this build): nothing to compare")
    generator = torch.Generator().manual_seed(0)
    rows_out = []
    print(f"{'projection':<16}{'N x K, group':>20}{'rows':>6}{'dot ms':>9}{'tiles ms':>10}{'speedup':>9}")
    for name, n, k, group in SHAPES:
        codes = torch.randint(0, 16, (n, k), dtype=torch.uint8, generator=generator)
        scales = torch.rand(n, k // group, generator=generator) * 0.01 + 0.001
        packed = cpu_linear.pack_codes(codes, scales, -8 * scales, "uint4", build)
        for rows in ROWS:
            x = torch.randn(rows, k, generator=generator).bfloat16()
            out = torch.empty(rows, n)
            times: dict[bool, list[float]] = {False: [], True: []}
            for repeat in range(REPEATS + 2):
                for tiles in (False, True):
                    assert cpu_linear.use_code_tiles(tiles, build) == tiles
                    started = time.perf_counter()
                    assert cpu_linear.gemm_codes(x, packed, None, out, build) is not None
                    if repeat >= 2:
                        times[tiles].append(time.perf_counter() - started)
            dot, tiles_ms = (statistics.median(times[t]) * 1e3 for t in (False, True))
            rows_out.append(
                {
                    "projection": name,
                    "n": n,
                    "k": k,
                    "group": group,
                    "rows": rows,
                    "dot_ms": round(dot, 3),
                    "tiles_ms": round(tiles_ms, 3),
                    "speedup": round(dot / tiles_ms, 2),
                }
            )
            print(f"{name:<16}{f'{n} x {k}, {group}':>20}{rows:>6}{dot:>9.3f}{tiles_ms:>10.3f}{dot / tiles_ms:>8.2f}x")
    cpu_linear.use_code_tiles(True, build)
    out_dir = os.environ.get("PAGEDSERVE_BENCH_OUT", os.path.join(os.path.dirname(__file__), "results"))
    os.makedirs(out_dir, exist_ok=True)
    result = {
        "machine": f"{cpu_model()}, {platform.machine()}, {os.cpu_count()} cores",
        "kernels": build.description,
        "threads": THREADS,
        "repeats": REPEATS,
        "date": time.strftime("%Y-%m-%d"),
        "rows": rows_out,
    }
    with open(os.path.join(out_dir, "codes_tiles_bench.json"), "w") as f:
        json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
