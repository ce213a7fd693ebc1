"""The paper's Figure 2: what the KV memory in use holds, pagedserve against the reservation baselines.

Each system serves the same seeded ShareGPT-like trace, all requests at once, with the same KV
budget; the scheduler's `pagedserve_kv_slots` gauges are sampled twenty times a second and split
the used slots into token states, slots reserved for tokens a request will still produce, and
slots no token will ever fill (internal fragmentation). The baselines reserve one contiguous run
of blocks (first fit), so while a request waits, the free blocks in runs too short for its
reservation count as external fragmentation. Prints a table, writes
benchmarks/results/fig2_memory_breakdown.json and docs/fig2_memory_breakdown.png.

    python benchmarks/fig2_memory_breakdown.py --num-prompts 100
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.fig12_latency_vs_rate import LABELS, POLICIES  # noqa: E402
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

STATES = (
    ("tokens", "token states"),
    ("reserved", "reserved"),
    ("unused", "internal fragmentation"),
    ("fragmented", "external fragmentation"),
)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workload", choices=["sharegpt", "alpaca"], default="sharegpt")
    parser.add_argument("--num-prompts", type=int, default=100)
    parser.add_argument("--num-blocks", type=int, default=256)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--max-model-len", type=int, default=1024)
    parser.add_argument("--policies", default=",".join(POLICIES))
    parser.add_argument("--model", default=None)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out-dir", default=str(ROOT / "benchmarks" / "results"))
    parser.add_argument("--plot-dir", default=str(ROOT / "docs"))
    args = parser.parse_args()
    jobs = WORKLOADS[args.workload](args.num_prompts + 2, seed=args.seed, max_model_len=args.max_model_len)
    breakdown = {}
    print(f"{'system':<14} {'token states':>13} {'reserved':>9} {'internal frag.':>15} {'external':>9}  samples")
    for policy in args.policies.split(","):
        flags = ["--kv-reservation", policy, *budget_flags(args)]
        with pagedserve(*flags, model=args.model) as (api, metrics):
            result = run_at_rate(api, metrics, jobs, float("inf"), seed=args.seed)
        shares = result["kv_slots_percent"]
        breakdown[policy] = {**shares, "request_throughput": result["request_throughput"]}
        print(
            f"{LABELS[policy]:<14} {shares['tokens']:12.1f}% {shares['reserved']:8.1f}% {shares['unused']:14.1f}% "
            f"{shares['fragmented']:8.1f}%  {shares['samples']}",
            flush=True,
        )
    payload = {
        "figure": "2",
        "workload": args.workload,
        "trace": describe(jobs[2:]),
        "args": vars(args),
        "commit": commit(),
        **machine(),
        "breakdown_percent": breakdown,
    }
    write_json(Path(args.out_dir) / "fig2_memory_breakdown.json", payload)
    plot(breakdown, Path(args.plot_dir) / "fig2_memory_breakdown.png")


def plot(breakdown: dict[str, dict], path: Path) -> None:
    figure, axes = pyplot().subplots(figsize=(6, 4))
    names = [LABELS[p] for p in breakdown]
    bottom = [0.0] * len(names)
    for state, label in STATES:
        values = [breakdown[p][state] for p in breakdown]
        axes.bar(names, values, bottom=bottom, label=label)
        bottom = [b + v for b, v in zip(bottom, values)]
    axes.set_ylabel("share of KV memory in use or stranded (%)")
    axes.set_ylim(0, 100)
    axes.set_title("KV memory in use, ShareGPT-like trace, same budget")
    axes.legend(loc="lower right")
    save_figure(figure, path)


if __name__ == "__main__":
    main()
