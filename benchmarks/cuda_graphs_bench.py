"""Serving with decode steps on CUDA graphs against `--enforce-eager`, alternating in one sitting.

A dummy-weight model (by default Llama-3.1-8B's config) in float16 on one GPU, fixed lengths, all
requests at once under a cap on those in flight; each mode serves every concurrency, and the modes
alternate `--repeats` times. Prints output tokens/s and TPOT side by side and writes them as JSON.

    python benchmarks/cuda_graphs_bench.py --concurrency 1,16,64 --out benchmarks/results/cuda_graphs_8b.json
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks import serve_client  # noqa: E402
from benchmarks.paper_harness import SERVED_NAME, machine, pagedserve, write_json  # noqa: E402
from benchmarks.provenance import commit  # noqa: E402

MODES = {"cuda_graphs": [], "eager": ["--enforce-eager"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="ops/configs/llama-3.1-8b")
    parser.add_argument("--tokenizer", default="ops/models/tiny-python")
    parser.add_argument("--concurrency", default="1,16,64")
    parser.add_argument("--input-len", type=int, default=256)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--prompts-per-stream", type=int, default=4, help="requests per unit of concurrency")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--max-model-len", type=int, default=2048)
    parser.add_argument("--device", default="cuda", help="cpu: a dry run of the script (a CPU captures no graphs)")
    parser.add_argument("--dtype", default="float16")
    parser.add_argument("--server-args", default="", help="more flags for both modes")
    parser.add_argument("--out", default="benchmarks/results/cuda_graphs_8b.json")
    args = parser.parse_args()
    concurrencies = [int(c) for c in args.concurrency.split(",")]
    flags = [
        "--device",
        args.device,
        "--dtype",
        args.dtype,
        "--load-format",
        "dummy",
        "--tokenizer",
        args.tokenizer,
        "--max-model-len",
        str(args.max_model_len),
        *args.server_args.split(),
    ]
    runs: dict[str, dict[int, list[dict]]] = {mode: {c: [] for c in concurrencies} for mode in MODES}
    for repeat in range(args.repeats):
        for mode, extra in MODES.items():
            with pagedserve(*flags, *extra, model=args.model) as (url, _):
                for c in concurrencies:
                    result = asyncio.run(
                        serve_client.run(
                            url,
                            SERVED_NAME,
                            args.input_len,
                            args.output_len,
                            max(8, args.prompts_per_stream * c),
                            max_concurrency=c,
                            seed=repeat,
                        )
                    )
                    runs[mode][c].append(result)
                    print(
                        f"repeat {repeat} {mode:11s} c={c:3d}: {result['output_throughput']:8.1f} tok/s, "
                        f"TPOT {result['mean_tpot_ms']:.2f} ms, failed {result['failed']}",
                        flush=True,
                    )
    print(
        f"\n{'concurrency':>11s} {'graphs tok/s':>13s} {'eager tok/s':>12s} {'ratio':>6s} "
        f"{'graphs TPOT':>12s} {'eager TPOT':>11s}"
    )
    table = []
    for c in concurrencies:
        graphs = [r["output_throughput"] for r in runs["cuda_graphs"][c]]
        eager = [r["output_throughput"] for r in runs["eager"][c]]
        graphs_tpot = [r["mean_tpot_ms"] for r in runs["cuda_graphs"][c]]
        eager_tpot = [r["mean_tpot_ms"] for r in runs["eager"][c]]
        row = {
            "concurrency": c,
            "graphs_tok_s": graphs,
            "eager_tok_s": eager,
            "graphs_tpot_ms": graphs_tpot,
            "eager_tpot_ms": eager_tpot,
            "ratio": statistics.median(graphs) / statistics.median(eager),
        }
        table.append(row)
        print(
            f"{c:11d} {statistics.median(graphs):13.1f} {statistics.median(eager):12.1f} {row['ratio']:6.2f} "
            f"{statistics.median(graphs_tpot):10.2f}ms {statistics.median(eager_tpot):9.2f}ms"
        )
    write_json(
        Path(args.out),
        {
            "machine": machine(),
            "commit": commit(),
            "model": args.model,
            "input_len": args.input_len,
            "output_len": args.output_len,
            "table": table,
            "runs": runs,
        },
    )
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
