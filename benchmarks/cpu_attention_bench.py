"""CPU paged attention, one layer: the compiled C kernel against the vectorized torch path.

Shapes of the shipped model (4 query heads, 2 KV heads, head size 64, block size 32, float32),
blocks scattered over the cache as serving leaves them, one thread (what the worker gets on a
2-core machine). Decode: batches of 1, 64 and 256 sequences at contexts of 128 and 512; prefill:
4 prompts of 128 tokens. The compiled kernel also runs over an int8 cache of the same values
(`--kv-cache-dtype int8`, a quarter of the bytes and their scales). Then a lone decode row (one stream) over the
12-layer shape's heads (12 query heads, 4 KV heads) at two threads, kept whole on one thread against cut by KV
heads between both (`head_slices`), each way in turn, over 12 layers' caches. Prints the median over repeats and
writes benchmarks/results/cpu_attention_bench.json (PAGEDSERVE_BENCH_OUT moves it).
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

from kernels import cpu_attention, native  # noqa: E402
from kernels.batch import PagedBatch  # noqa: E402
from kernels.cpu_attention import native_kernel, paged_attention_native, paged_attention_torch  # noqa: E402
from kernels.kv_quant import quantize  # noqa: E402

HEADS, KV_HEADS, HEAD_DIM, BLOCK_SIZE = 4, 2, 64, 32
REPEATS = int(os.environ.get("PAGEDSERVE_BENCH_REPEATS", "30"))
CASES = [("decode", 1, 128), ("decode", 64, 128), ("decode", 64, 512), ("decode", 256, 512), ("prefill", 4, 128)]
LONE_HEADS, LONE_KV_HEADS, LONE_LAYERS = 12, 4, 12
LONE_CONTEXTS = [int(c) for c in os.environ.get("PAGEDSERVE_BENCH_CONTEXTS", "32,256,1024,4096").split(",")]


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


def lone_row(storage: torch.dtype, context: int) -> dict:
    """One decode row over LONE_LAYERS layers' caches at two threads: whole against cut by KV heads, in turn."""
    generator = torch.Generator().manual_seed(0)
    blocks = -(-context // BLOCK_SIZE)
    layers = []
    for _ in range(LONE_LAYERS):
        pair = [torch.randn(blocks + 1, BLOCK_SIZE, LONE_KV_HEADS, HEAD_DIM, generator=generator) for _ in range(2)]
        layers.append([quantize(c) if storage is torch.int8 else c.to(storage) for c in pair])
    table = torch.randperm(blocks + 1, generator=generator)[:blocks].tolist()
    batch = PagedBatch.build([0], [table], [0, 1], [context], torch.device("cpu"))
    query = torch.randn(1, LONE_HEADS, HEAD_DIM, generator=generator)
    sliced = cpu_attention.head_slices
    times: dict[str, list[float]] = {"whole": [], "sliced": []}
    for _ in range(REPEATS + 3):
        for way in times:
            cpu_attention.head_slices = sliced if way == "sliced" else (lambda query_start, threads: 1)
            batch.derived.clear()
            started = time.perf_counter()
            for keys, values in layers:
                paged_attention_native(query, keys, values, batch, HEAD_DIM**-0.5)
            times[way].append(time.perf_counter() - started)
    cpu_attention.head_slices = sliced
    whole, cut = (statistics.median(times[way][3:]) * 1e3 for way in ("whole", "sliced"))
    return {
        "cache": str(storage).removeprefix("torch."),
        "context": context,
        "whole_ms": round(whole, 3),
        "sliced_ms": round(cut, 3),
        "speedup": round(whole / cut, 2),
    }


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
    native.set_threads(2)
    lone = []
    print(f"\none decode row, {LONE_LAYERS} layers of {LONE_HEADS} heads over {LONE_KV_HEADS} KV heads, 2 threads")
    print(f"{'cache':<10}{'context':>9}{'whole ms':>10}{'by KV heads ms':>16}{'speedup':>9}")
    for storage in (torch.bfloat16, torch.int8):
        for context in LONE_CONTEXTS:
            row = lone_row(storage, context)
            lone.append(row)
            print(
                f"{row['cache']:<10}{context:>9}{row['whole_ms']:>10.3f}{row['sliced_ms']:>16.3f}{row['speedup']:>8.2f}x"
            )
    native.set_threads(1)
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
        "lone_row_two_threads": lone,
    }
    with open(os.path.join(out_dir, "cpu_attention_bench.json"), "w") as f:
        json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
