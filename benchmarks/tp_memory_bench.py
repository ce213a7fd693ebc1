"""Resident memory of each worker rank at tensor-parallel sizes 1 and 2, for a dummy-weight Llama.

Each rank loads only its share of the attention and MLP weights; embeddings and the LM head are
replicated. The script starts `python -m services.worker --tensor-parallel-size N` with no
scheduler (a worker loads, measures and reports Ready before it needs one), reads every rank's
VmRSS once all have loaded, and prints per-rank memory, the ratio TP 2 / TP 1, and the same ratio
after subtracting what a process with torch imported holds before any model.

    python benchmarks/tp_memory_bench.py [--hidden 2048 --layers 8 ...] [--out results.json]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def llama_config(args) -> dict:
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": args.hidden,
        "intermediate_size": 4 * args.hidden,
        "num_hidden_layers": args.layers,
        "num_attention_heads": args.heads,
        "num_key_value_heads": args.heads // 2,
        "vocab_size": args.vocab,
        "max_position_embeddings": 2048,
        "rms_norm_eps": 1e-5,
        "tie_word_embeddings": False,
        "hidden_act": "silu",
        "eos_token_id": 0,
    }


def rss_mib(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return 0.0


def rank_pids(supervisor: int) -> list[int]:
    done = subprocess.run(["pgrep", "-P", str(supervisor)], capture_output=True, text=True)
    return [int(pid) for pid in done.stdout.split()]


def measure(model_dir: str, size: int, scratch: str) -> list[float]:
    log_path = os.path.join(scratch, f"worker-tp{size}.log")
    command = [
        sys.executable,
        "-m",
        "services.worker",
        "--model",
        model_dir,
        "--load-format",
        "dummy",
        "--device",
        "cpu",
        "--worker-endpoint",
        f"ipc://{scratch}/none.sock",
        "--kv-cache-memory",
        "0.01",
        "--swap-space",
        "0",
        "--metrics-port",
        "0",
        "--tensor-parallel-size",
        str(size),
        "--dist-init-method",
        f"file://{scratch}/init-{size}",
    ]
    with open(log_path, "w") as log:
        process = subprocess.Popen(command, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 600
        while Path(log_path).read_text().count("measured:") < size:
            if process.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"the worker did not load:\n{Path(log_path).read_text()[-3000:]}")
            time.sleep(0.5)
        pids = [process.pid] if size == 1 else rank_pids(process.pid)
        return [rss_mib(pid) for pid in pids]
    finally:
        process.terminate()
        process.wait(30)


def torch_baseline() -> float:
    """RSS of a process that imported what a worker imports, before any model."""
    probe = "import os, torch, transformers, services.worker.server; print(open('/proc/self/status').read())"
    out = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    return next(int(line.split()[1]) / 1024 for line in out.splitlines() if line.startswith("VmRSS:"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--out", default=None, help="write the figures as JSON here")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as scratch:
        model_dir = os.path.join(scratch, "model")
        os.makedirs(model_dir)
        with open(os.path.join(model_dir, "config.json"), "w") as f:
            json.dump(llama_config(args), f)
        baseline = torch_baseline()
        per_rank = {size: measure(model_dir, size, scratch) for size in (1, 2)}
    one, two = per_rank[1][0], max(per_rank[2])
    results = {
        "config": llama_config(args),
        "baseline_mib": baseline,
        "rss_mib": per_rank,
        "ratio": two / one,
        "ratio_above_baseline": (two - baseline) / (one - baseline),
    }
    print(f"{'tensor-parallel size':>22} {'rank':>5} {'RSS MiB':>9}")
    for size, values in per_rank.items():
        for rank, value in enumerate(values):
            print(f"{size:>22} {rank:>5} {value:>9.0f}")
    print(f"a process with torch imported and no model: {baseline:.0f} MiB")
    print(f"TP 2 / TP 1, per rank: {results['ratio']:.2f}; above that baseline: {results['ratio_above_baseline']:.2f}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=2)


if __name__ == "__main__":
    main()
