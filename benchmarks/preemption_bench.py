"""Cost of preempting one request by swapping against recomputing it, by block size.

Swap cost: moving the request's KV blocks to the CPU swap space and back (the worker's own
swap path). Recompute cost: one prefill forward over the request's tokens. The model is a
random-weight Llama of a realistic width built from a config (no download). Runs on CUDA when
there is one, else on this machine's CPU. Prints a table and writes
benchmarks/results/preemption_bench.json and docs/fig19_preemption.png (the paper's Figure 19a).
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
from transformers import LlamaConfig  # noqa: E402

from services.worker.kv_cache import KVCache  # noqa: E402
from services.worker.model_runner import ModelRunner  # noqa: E402
from services.worker.models import LlamaForCausalLM  # noqa: E402

NUM_TOKENS = 512
REPEATS = 5


def build_model(device: torch.device, dtype: torch.dtype) -> LlamaForCausalLM:
    config = LlamaConfig(
        hidden_size=1024,
        intermediate_size=2816,
        num_hidden_layers=8,
        num_attention_heads=8,
        num_key_value_heads=8,
        vocab_size=32000,
        max_position_embeddings=4096,
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    model.tie_weights()
    return model.to(device=device, dtype=dtype).eval()


def timed(fn, sync) -> float:
    times = []
    for _ in range(REPEATS):
        sync()
        started = time.perf_counter()
        fn()
        sync()
        times.append((time.perf_counter() - started) * 1e3)
    return statistics.median(times)


def main() -> None:
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.float16 if device.type == "cuda" else torch.float32
    model = build_model(device, dtype)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    rows = []
    for block_size in (8, 16, 32, 64):
        num_blocks = NUM_TOKENS // block_size
        cache = KVCache(
            model.config.num_hidden_layers,
            num_blocks * 2,
            block_size,
            model.num_kv_heads,
            model.head_dim,
            dtype,
            device,
            num_cpu_blocks=num_blocks,
        )
        runner = ModelRunner(model, cache, device, seed=0)
        pairs = [(i, i) for i in range(num_blocks)]
        swap_ms = timed(lambda cache=cache, pairs=pairs: (cache.swap_out(pairs), cache.swap_in(pairs)), sync)
        recompute_ms = 1e3 * NUM_TOKENS / runner.measure_prefill_rate(NUM_TOKENS)
        kv_mib = num_blocks * sum(layer[:, 0].numel() * layer.element_size() for layer in cache.layers) / 2**20
        rows.append(
            {"block_size": block_size, "kv_mib": kv_mib, "swap_out_and_in_ms": swap_ms, "recompute_ms": recompute_ms}
        )
    name = torch.cuda.get_device_name() if device.type == "cuda" else f"CPU ({os.cpu_count()} cores)"
    print(f"one request of {NUM_TOKENS} tokens, 8-layer 1024-wide Llama, {dtype}, on {name}")
    print(f"{'block size':>10}{'KV MiB':>10}{'swap out+in ms':>16}{'recompute ms':>14}")
    for r in rows:
        print(f"{r['block_size']:>10}{r['kv_mib']:>10.1f}{r['swap_out_and_in_ms']:>16.2f}{r['recompute_ms']:>14.2f}")
    out = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "preemption_bench.json"), "w") as f:
        json.dump(
            {
                "date": time.strftime("%Y-%m-%d"),
                "device": name,
                "dtype": str(dtype),
                "tokens": NUM_TOKENS,
                "rows": rows,
            },
            f,
            indent=2,
        )
    plot(rows, name, os.path.join(os.path.dirname(out), "..", "docs", "fig19_preemption.png"))


def plot(rows: list[dict], device: str, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(figsize=(6, 4))
    sizes = [r["block_size"] for r in rows]
    axes.plot(sizes, [r["swap_out_and_in_ms"] for r in rows], marker="o", label="swap out and in")
    axes.plot(sizes, [r["recompute_ms"] for r in rows], marker="o", label="recompute")
    axes.set_xscale("log", base=2)
    axes.set_xticks(sizes, [str(s) for s in sizes])
    axes.set_xlabel("block size (tokens)")
    axes.set_ylabel(f"ms for one {NUM_TOKENS}-token request")
    axes.set_title(f"preemption cost by block size, {device}")
    axes.legend()
    figure.tight_layout()
    figure.savefig(os.path.normpath(path), dpi=100)


if __name__ == "__main__":
    main()
