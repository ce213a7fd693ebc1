"""The paper's Figure 16: throughput when every request starts with the same few-shot prefix.

The same seeded trace (a one-shot prefix of 80 tokens or a five-shot one of 341, then a short
prompt of its own and a short output, as in the paper's translation workload) is served with
prefix caching on and off, and by the Oracle reservation baseline, which shares nothing; every
system has the same KV budget, and the whole trace arrives at once, so request throughput is the
highest rate each sustains. Prints a table, writes benchmarks/results/fig16_shared_prefix.json and
docs/fig16_shared_prefix.png.

    python benchmarks/fig16_shared_prefix.py --num-prompts 200
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.paper_harness import (  # noqa: E402
    ROOT,
    budget_flags,
    machine,
    pagedserve,
    pyplot,
    run_at_rate,
    save_figure,
    write_json,
)
from benchmarks.provenance import commit  # noqa: E402
from benchmarks.workloads import WORKLOADS, describe  # noqa: E402

SYSTEMS = {  # name: flags
    "pagedserve, prefix caching": ["--enable-prefix-caching"],
    "pagedserve, no sharing": [],
    "Orca (Oracle)": ["--kv-reservation", "oracle"],
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--num-prompts", type=int, default=200)
    parser.add_argument("--num-blocks", type=int, default=256)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--max-model-len", type=int, default=1024)
    parser.add_argument("--model", default=None)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out-dir", default=str(ROOT / "benchmarks" / "results"))
    parser.add_argument("--plot-dir", default=str(ROOT / "docs"))
    args = parser.parse_args()
    results: dict[str, dict[str, dict]] = {}
    traces = {}
    for workload in ("prefix1", "prefix5"):
        jobs = WORKLOADS[workload](args.num_prompts + 2, seed=args.seed, max_model_len=args.max_model_len)
        traces[workload] = describe(jobs[2:])
        for system, extra in SYSTEMS.items():
            flags = [*budget_flags(args), *extra]
            with pagedserve(*flags, model=args.model) as (api, metrics):
                result = run_at_rate(api, metrics, jobs, float("inf"), seed=args.seed)
            results.setdefault(workload, {})[system] = result
            print(
                f"{workload:<8} {system:<28} {result['request_throughput']:7.2f} req/s  "
                f"{result['output_throughput']:8.1f} output tok/s",
                flush=True,
            )
    for workload, by_system in results.items():
        shared, alone = by_system["pagedserve, prefix caching"], by_system["pagedserve, no sharing"]
        print(
            f"{workload}: prefix caching gives {shared['request_throughput'] / alone['request_throughput']:.2f}x "
            f"the throughput without it, "
            f"{shared['request_throughput'] / by_system['Orca (Oracle)']['request_throughput']:.2f}x Oracle's"
        )
    write_json(
        Path(args.out_dir) / "fig16_shared_prefix.json",
        {"figure": "16", "traces": traces, "args": vars(args), "commit": commit(), **machine(), "results": results},
    )
    plot(results, Path(args.plot_dir) / "fig16_shared_prefix.png")


def plot(results: dict[str, dict[str, dict]], path: Path) -> None:
    figure, axes = pyplot().subplots(figsize=(6, 4))
    workloads = list(results)
    width = 0.8 / len(SYSTEMS)
    for i, system in enumerate(SYSTEMS):
        axes.bar(
            [w + i * width for w in range(len(workloads))],
            [results[w][system]["request_throughput"] for w in workloads],
            width,
            label=system,
        )
    axes.set_xticks(
        [w + width * (len(SYSTEMS) - 1) / 2 for w in range(len(workloads))],
        ["one-shot prefix (80)", "five-shot prefix (341)"],
    )
    axes.set_ylabel("request throughput (req/s)")
    axes.set_title("shared prefix, same KV budget, CPU")
    axes.legend()
    save_figure(figure, path)


if __name__ == "__main__":
    main()
