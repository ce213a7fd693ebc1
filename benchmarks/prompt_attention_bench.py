"""A prompt's attention over a bfloat16 cache, the compiled kernel's two ways where the CPU has AMX tiles for
bfloat16: the vector dot product (VDPBF16PS) and the tiles (`cpu_attention.use_tiles`), interleaved in one process.

The heads of the 12-layer benchmark model (12 x 4 x 64) and of two sweep shapes (16 x 2 x 64, 16 x 8 x 128), one
prompt of 256 and one of 1,024 tokens, blocks of 16 scattered over the cache, one thread by default
(PAGEDSERVE_BENCH_THREADS). Each repetition times both ways in turn; prints the medians, GFLOP/s (4 x heads x
head_dim per visible query-key pair) and the largest difference between the two outputs, and writes
benchmarks/results/prompt_attention_bench.json (PAGEDSERVE_BENCH_OUT moves it).
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
from kernels import cpu_attention  # noqa: E402
from kernels.batch import PagedBatch  # noqa: E402

SHAPES = [(12, 4, 64), (16, 2, 64), (16, 8, 128)]  # heads, KV heads, head size
PROMPTS = [256, 1024]
BLOCK_SIZE = 16
REPEATS = int(os.environ.get("PAGEDSERVE_BENCH_REPEATS", "9"))
THREADS = int(os.environ.get("PAGEDSERVE_BENCH_THREADS", "1"))


def prompt(heads: int, kv_heads: int, head_dim: int, length: int):
    generator = torch.Generator().manual_seed(0)
    blocks = -(-length // BLOCK_SIZE)
    cache = [torch.randn(blocks + 1, BLOCK_SIZE, kv_heads, head_dim, generator=generator).bfloat16() for _ in range(2)]
    table = torch.randperm(blocks + 1, generator=generator)[:blocks].tolist()
    batch = PagedBatch.build([0] * length, [table], [0, length], [length], torch.device("cpu"))
    query = torch.randn(length, heads, head_dim, generator=generator)
    return query, cache[0], cache[1], batch


def timed(tiles: bool, query, keys, values, batch) -> tuple[float, torch.Tensor]:
    assert cpu_attention.use_tiles(tiles) == tiles
    batch.derived.clear()
    started = time.perf_counter()
    out = cpu_attention.paged_attention_native(query, keys, values, batch, query.shape[2] ** -0.5)
    return time.perf_counter() - started, out.clone()


def main() -> None:
    torch.set_num_threads(THREADS)
    if cpu_attention.native_kernel("paged_attention_bf16") is None:
        sys.exit("no C compiler: the compiled kernel cannot be built here")
    if not cpu_attention.use_tiles(True):
        sys.exit("no AMX tiles for bfloat16 here (or no bfloat16 dot product in this build): nothing to compare")
    rows = []
    print(f"{'heads x kv x dim, prompt':<28}{'vector ms':>11}{'tiles ms':>10}{'speedup':>9}{'GFLOP/s':>17}{'diff':>10}")
    for heads, kv_heads, head_dim in SHAPES:
        for length in PROMPTS:
            case = prompt(heads, kv_heads, head_dim, length)
            times: dict[bool, list[float]] = {False: [], True: []}
            outs = {}
            for repeat in range(REPEATS + 2):
                for tiles in (False, True):
                    seconds, outs[tiles] = timed(tiles, *case)
                    if repeat >= 2:
                        times[tiles].append(seconds)
            vector, tiles_ms = (statistics.median(times[t]) * 1e3 for t in (False, True))
            flops = 4 * heads * head_dim * length * (length + 1) / 2
            row = {
                "heads": heads,
                "kv_heads": kv_heads,
                "head_dim": head_dim,
                "prompt": length,
                "vector_ms": round(vector, 3),
                "tiles_ms": round(tiles_ms, 3),
                "speedup": round(vector / tiles_ms, 2),
                "vector_gflops": round(flops / vector / 1e6, 1),
                "tiles_gflops": round(flops / tiles_ms / 1e6, 1),
                "max_difference": float((outs[True] - outs[False]).abs().max()),
            }
            rows.append(row)
            name = f"{heads} x {kv_heads} x {head_dim}, {length}"
            print(
                f"{name:<28}{vector:>11.2f}{tiles_ms:>10.2f}{row['speedup']:>8.2f}x"
                f"{row['vector_gflops']:>8.0f} -> {row['tiles_gflops']:<6.0f}{row['max_difference']:>10.1e}"
            )
    cpu_attention.use_tiles(True)
    out_dir = os.environ.get("PAGEDSERVE_BENCH_OUT", os.path.join(os.path.dirname(__file__), "results"))
    os.makedirs(out_dir, exist_ok=True)
    result = {
        "machine": f"{cpu_model()}, {platform.machine()}, {os.cpu_count()} cores",
        "threads": THREADS,
        "repeats": REPEATS,
        "date": time.strftime("%Y-%m-%d"),
        "block_size": BLOCK_SIZE,
        "rows": rows,
    }
    with open(os.path.join(out_dir, "prompt_attention_bench.json"), "w") as f:
        json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
