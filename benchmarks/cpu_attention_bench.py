"""CPU paged attention, one layer: the compiled C kernel against the vectorized torch path.

Shapes of the shipped model (4 query heads, 2 KV heads, head size 64, block size 32, float32),
blocks scattered over the cache as serving leaves them, one thread (what the worker gets on a
2-core machine). Decode: batches of 1, 64 and 256 sequences at contexts of 128 and 512; prefill:
4 prompts of 128 tokens. The compiled kernel also runs over an int8 cache of the same values
(`--kv-cache-dtype int8`, a quarter of the bytes and their scales). Prints the median over repeats and writes
benchmarks/results/cpu_attention_bench.json (PAGEDSERVE_BENCH_OUT moves it).
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

from kernels.batch import PagedBatch  # noqa: E402
from kernels.cpu_attention import native_kernel, paged_attention_native, paged_attention_torch  # noqa: E402
from kernels.kv_quant import quantize  # noqa: E402

HEADS, KV_HEADS, HEAD_DIM, BLOCK_SIZE = 4, 2, 64, 32
REPEATS = int(os.environ.get("PAGEDSERVE_BENCH_REPEATS", "30"))
CASES = [("decode", 1, 128), ("decode", 64, 128), ("decode", 64, 512), ("decode", 256, 512), ("prefill", 4, 128)]


def setup(kind: str, seqs: int, context: int):
    generator = torch.Generator().manual_seed(0)
    blocks_per_seq = -(-context // BLOCK_SIZE)
    num_blocks = seqs * blocks_per_seq + 1
    cache = [torch.randn(num_blocks, BLOCK_SIZE, KV_HEADS, HEAD_DIM, generator=generator) for _ in range(2)]
    order = torch.randperm(num_blocks, generator=generator).tolist()
    tables = [order[s * blocks_per_seq : (s + 1) * blocks_per_seq] for s in range(seqs)]
    queries = 1 if kind == "decode" else context
    starts = [s * queries for s in range(seqs + 1)]
    batch = PagedBatch.build([0] * starts[-1], tables, starts, [context] * seqs, torch.device("cpu"))
    query = torch.randn(starts[-1], HEADS, HEAD_DIM, generator=generator)
    return query, cache[0], cache[1], batch


def median_ms(attention, query, key_cache, value_cache, batch) -> float:
    times = []
    for _ in range(REPEATS + 3):
        batch.derived.clear()  # each layer of a step builds its view once; time that too
        started = time.perf_counter()
        attention(query, key_cache, value_cache, batch, HEAD_DIM**-0.5)
        times.append(time.perf_counter() - started)
    return statistics.median(times[3:]) * 1e3


def main() -> None:
    torch.set_num_threads(1)
    if native_kernel() is None:
        sys.exit("no C compiler: the compiled kernel cannot be built here")
    rows = []
    print(f"{'case':<26}{'torch ms':>10}{'compiled ms':>13}{'speedup':>9}{'GB/s read':>11}{'int8 ms':>10}")
    for kind, seqs, context in CASES:
        args = setup(kind, seqs, context)
        torch_ms = median_ms(paged_attention_torch, *args)
        native_ms = median_ms(paged_attention_native, *args)
        query, key_cache, value_cache, batch = args
        int8_ms = median_ms(paged_attention_native, query, quantize(key_cache), quantize(value_cache), batch)
        kv_bytes = 2 * seqs * context * KV_HEADS * HEAD_DIM * 4
        row = {
            "kind": kind,
            "seqs": seqs,
            "context": context,
            "torch_ms": round(torch_ms, 3),
            "compiled_ms": round(native_ms, 3),
            "speedup": round(torch_ms / native_ms, 2),
            "compiled_gb_per_s": round(kv_bytes / native_ms / 1e6, 1),
            "compiled_int8_ms": round(int8_ms, 3),
        }
        rows.append(row)
        name = f"{kind} {seqs} x {context}"
        print(
            f"{name:<26}{torch_ms:>10.3f}{native_ms:>13.3f}{row['speedup']:>8.2f}x"
            f"{row['compiled_gb_per_s']:>11.1f}{int8_ms:>10.3f}"
        )
    out_dir = os.environ.get("PAGEDSERVE_BENCH_OUT", os.path.join(os.path.dirname(__file__), "results"))
    os.makedirs(out_dir, exist_ok=True)
    result = {
        "machine": f"{platform.machine()}, {os.cpu_count()} cores",
        "threads": 1,
        "repeats": REPEATS,
        "date": time.strftime("%Y-%m-%d"),
        "shapes": {
            "heads": HEADS,
            "kv_heads": KV_HEADS,
            "head_dim": HEAD_DIM,
            "block_size": BLOCK_SIZE,
            "dtype": "float32",
        },
        "rows": rows,
    }
    with open(os.path.join(out_dir, "cpu_attention_bench.json"), "w") as f:
        json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
