"""Paged attention kernel speed on a GPU: decode bandwidth and prefill throughput.

Decode: batch 1, 8, 64, 256 at context 512, 2k, 8k; time (also with tiles of 32 keys, which spill no
registers at heads of 128 when compiled for sm_90), achieved bandwidth (GB/s and % of the
GPU's peak, counting 2 * batch * context * kv_heads * head_dim * element size bytes of K and V),
and the ratio against contiguous-KV attention on the same data (torch's
scaled_dot_product_attention, and FlashAttention when installed). Prefill: prompts of 512 and
2k tokens; time and TFLOP/s. Shapes: 32 query heads, 8 KV heads, head_dim 128, float16,
block size 16 (Llama-3-8B's attention). Needs CUDA. Prints a table and writes
benchmarks/results/kernel_bench.json.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from kernels import kv_quant  # noqa: E402
from kernels.batch import PagedBatch  # noqa: E402
from kernels.paged_attention import paged_attention_triton  # noqa: E402

HEADS, KV_HEADS, HEAD_DIM, BLOCK_SIZE, DTYPE = 32, 8, 128, 16, torch.float16
PEAK_GBPS = {"H100": 3352.0, "H200": 4800.0, "A100": 2039.0}

try:
    from flash_attn import flash_attn_func
except ImportError:
    flash_attn_func = None


def peak_bandwidth() -> float | None:
    name = torch.cuda.get_device_name()
    return next((v for k, v in PEAK_GBPS.items() if k in name), None)


def time_ms(fn, repeats: int = 20) -> float:
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def paged_setup(batch: int, context: int, query_len: int):
    blocks_per_seq = -(-context // BLOCK_SIZE)
    num_blocks = batch * blocks_per_seq
    order = torch.randperm(num_blocks, device="cuda").to(torch.int32)  # non-contiguous pages
    tables = order.view(batch, blocks_per_seq)
    key_cache = torch.randn((num_blocks, BLOCK_SIZE, KV_HEADS, HEAD_DIM), dtype=DTYPE, device="cuda")
    value_cache = torch.randn_like(key_cache)
    query = torch.randn((batch * query_len, HEADS, HEAD_DIM), dtype=DTYPE, device="cuda")
    starts = [i * query_len for i in range(batch + 1)]
    paged = PagedBatch(
        slot_mapping=torch.empty(0, dtype=torch.int64, device="cuda"),
        block_tables=tables.contiguous(),
        query_start_loc=torch.tensor(starts, dtype=torch.int32, device="cuda"),
        context_lens=torch.full((batch,), context, dtype=torch.int32, device="cuda"),
        query_start_list=starts,
        context_lens_list=[context] * batch,
    )
    # The same keys and values laid out contiguously, for the baselines.
    gather = tables.long().view(-1)
    k = key_cache[gather].view(batch, blocks_per_seq * BLOCK_SIZE, KV_HEADS, HEAD_DIM)[:, :context]
    v = value_cache[gather].view(batch, blocks_per_seq * BLOCK_SIZE, KV_HEADS, HEAD_DIM)[:, :context]
    return query, key_cache, value_cache, paged, k.contiguous(), v.contiguous()


def decode_row(batch: int, context: int, peak: float | None) -> dict:
    query, key_cache, value_cache, paged, k, v = paged_setup(batch, context, 1)
    scale = HEAD_DIM**-0.5
    paged_ms = time_ms(lambda: paged_attention_triton(query, key_cache, value_cache, paged, scale))
    tiles_32_ms = time_ms(lambda: paged_attention_triton(query, key_cache, value_cache, paged, scale, block_n=32))
    q4 = query.view(batch, 1, HEADS, HEAD_DIM).transpose(1, 2)
    k4, v4 = k.transpose(1, 2), v.transpose(1, 2)
    sdpa_ms = time_ms(lambda: F.scaled_dot_product_attention(q4, k4, v4, scale=scale, enable_gqa=True))
    row = {"batch": batch, "context": context, "paged_ms": paged_ms, "tiles_32_ms": tiles_32_ms, "sdpa_ms": sdpa_ms}
    if flash_attn_func is not None:
        row["flash_ms"] = time_ms(
            lambda: flash_attn_func(query.view(batch, 1, HEADS, HEAD_DIM), k, v, softmax_scale=scale)
        )
    moved = 2 * batch * context * KV_HEADS * HEAD_DIM * torch.finfo(DTYPE).bits // 8
    row["gbps"] = moved / paged_ms / 1e6
    row["peak_percent"] = 100 * row["gbps"] / peak if peak else None
    return row


def quantized_decode_row(batch: int, context: int, kv_cache_dtype: str, peak: float | None) -> dict:
    """Decode over an int8 or E4M3 cache (kernels/kv_quant.py), which the kernel reads directly:
    each row is HEAD_DIM bytes and a float32 scale."""
    query, key_cache, value_cache, paged, _, _ = paged_setup(batch, context, 1)
    storage = kv_quant.STORAGE[kv_cache_dtype]
    key_cache, value_cache = kv_quant.quantize(key_cache, storage), kv_quant.quantize(value_cache, storage)
    paged_ms = time_ms(lambda: paged_attention_triton(query, key_cache, value_cache, paged, HEAD_DIM**-0.5))
    moved = 2 * batch * context * KV_HEADS * (HEAD_DIM + kv_quant.SCALE_BYTES)
    gbps = moved / paged_ms / 1e6
    return {
        "batch": batch,
        "context": context,
        "kv_cache_dtype": kv_cache_dtype,
        "paged_ms": paged_ms,
        "gbps": gbps,
        "peak_percent": 100 * gbps / peak if peak else None,
    }


def prefill_row(prompt: int, batch: int) -> dict:
    query, key_cache, value_cache, paged, k, v = paged_setup(batch, prompt, prompt)
    scale = HEAD_DIM**-0.5
    paged_ms = time_ms(lambda: paged_attention_triton(query, key_cache, value_cache, paged, scale), repeats=10)
    tiles_32_ms = time_ms(
        lambda: paged_attention_triton(query, key_cache, value_cache, paged, scale, block_n=32), repeats=10
    )
    q4 = query.view(batch, prompt, HEADS, HEAD_DIM).transpose(1, 2)
    sdpa_ms = time_ms(
        lambda: F.scaled_dot_product_attention(
            q4, k.transpose(1, 2), v.transpose(1, 2), is_causal=True, scale=scale, enable_gqa=True
        ),
        repeats=10,
    )
    flops = 4 * batch * HEADS * prompt * prompt * HEAD_DIM / 2  # causal: half of QK^T and PV
    return {
        "prompt": prompt,
        "batch": batch,
        "paged_ms": paged_ms,
        "tiles_32_ms": tiles_32_ms,
        "sdpa_ms": sdpa_ms,
        "tflops": flops / paged_ms / 1e9,
    }


def main() -> None:
    if not torch.cuda.is_available():
        print("kernel_bench needs a CUDA GPU; none is visible here.")
        return
    peak = peak_bandwidth()
    decode = [decode_row(b, c, peak) for b in (1, 8, 64, 256) for c in (512, 2048, 8192)]
    prefill = [prefill_row(p, b) for p, b in ((512, 8), (2048, 2))]
    quantized = [quantized_decode_row(64, 2048, kind, peak) for kind in ("int8", "fp8")]
    print(f"{torch.cuda.get_device_name()}; peak HBM {peak} GB/s; heads {HEADS}/{KV_HEADS}, d {HEAD_DIM}, fp16")
    print(
        f"{'batch':>6}{'context':>8}{'paged ms':>10}{'GB/s':>9}{'% peak':>8}{'sdpa ms':>9}{'paged/sdpa':>11}"
        f"{'flash ms':>10}{'32-key tiles ms':>16}"
    )
    for r in decode:
        flash = f"{r['flash_ms']:>10.3f}" if "flash_ms" in r else f"{'-':>10}"
        pct = f"{r['peak_percent']:>8.1f}" if r["peak_percent"] is not None else f"{'-':>8}"
        print(
            f"{r['batch']:>6}{r['context']:>8}{r['paged_ms']:>10.3f}{r['gbps']:>9.0f}{pct}"
            f"{r['sdpa_ms']:>9.3f}{r['paged_ms'] / r['sdpa_ms']:>11.2f}{flash}{r['tiles_32_ms']:>16.3f}"
        )
    print(
        f"{'prompt':>6}{'batch':>8}{'paged ms':>10}{'TFLOP/s':>9}{'sdpa ms':>9}{'paged/sdpa':>11}"
        f"{'32-key tiles ms':>16}"
    )
    for r in prefill:
        print(
            f"{r['prompt']:>6}{r['batch']:>8}{r['paged_ms']:>10.3f}{r['tflops']:>9.1f}{r['sdpa_ms']:>9.3f}"
            f"{r['paged_ms'] / r['sdpa_ms']:>11.2f}{r['tiles_32_ms']:>16.3f}"
        )
    for r in quantized:
        pct = f"{r['peak_percent']:.1f} % of peak" if r["peak_percent"] is not None else ""
        print(
            f"{r['kv_cache_dtype']} cache, batch {r['batch']}, context {r['context']}: {r['paged_ms']:.3f} ms, "
            f"{r['gbps']:.0f} GB/s {pct}"
        )
    out = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "kernel_bench.json"), "w") as f:
        json.dump(
            {
                "device": torch.cuda.get_device_name(),
                "date": time.strftime("%Y-%m-%d"),
                "decode": decode,
                "prefill": prefill,
                "quantized_decode": quantized,
            },
            f,
            indent=2,
        )


if __name__ == "__main__":
    main()
