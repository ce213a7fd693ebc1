"""The paper's Figure 12: normalized latency against request rate, pagedserve against the three
reservation baselines (Orca Max, Pow2, Oracle), on ShareGPT-like and Alpaca-like traces.

Every system is the same server with the same model, kernels and KV budget (`--num-blocks`); only
`--kv-reservation` differs. `paged_int8` is pagedserve with `--kv-cache-dtype int8` in the same
bytes: `--num-blocks` float blocks' worth of int8 blocks. For each system and rate the same seeded trace arrives as a
Poisson
process. A system's sustained rate is where its normalized latency crosses `--slo` times the
paged server's lowest-rate normalized latency (interpolated between measured rates). Prints a
table, writes benchmarks/results/fig12_<workload><tag>.json and docs/fig12_<workload><tag>.png.

    python benchmarks/fig12_latency_vs_rate.py --workload sharegpt --rates 0.5,1,2,3,4 --num-prompts 100
"""

from __future__ import annotations

import argparse
import json
import sys
from contextlib import ExitStack
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

POLICIES = ("paged", "oracle", "pow2", "max")
LABELS = {
    "paged": "pagedserve",
    "oracle": "Orca (Oracle)",
    "pow2": "Orca (Pow2)",
    "max": "Orca (Max)",
    "paged_int8": "pagedserve int8",
}


def sustained_rate(points: list[tuple[float, float]], limit: float) -> float:
    """The rate where normalized latency first crosses `limit`, interpolated; the highest measured
    rate if it never does, 0 if even the lowest is above."""
    previous = None
    for rate, latency in points:
        if latency > limit:
            if previous is None:
                return 0.0
            (r0, l0) = previous
            return r0 + (rate - r0) * (limit - l0) / (latency - l0)
        previous = (rate, latency)
    return points[-1][0] if points else 0.0


def int8_blocks_in_the_same_bytes(args) -> int:
    """int8 rows take head_dim + 4 bytes where the model's dtype takes head_dim times its size."""
    with open(Path(args.model or ROOT / "ops" / "models" / "tiny-python") / "config.json") as f:
        config = json.load(f)
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    element = 2 if "--device cuda" in args.server_args else 4  # half precision on a GPU, float32 on a CPU
    return args.num_blocks * head_dim * element // (head_dim + 4)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workload", choices=["sharegpt", "alpaca"], default="sharegpt")
    parser.add_argument("--rates", default="0.5,1,2,3,4", help="requests per second, comma separated")
    parser.add_argument("--num-prompts", type=int, default=100)
    parser.add_argument("--num-blocks", type=int, default=256, help="device KV blocks of every system")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--max-model-len", type=int, default=1024)
    parser.add_argument("--policies", default=",".join(POLICIES))
    parser.add_argument("--slo", type=float, default=2.0, help="latency limit, times paged's lowest-rate latency")
    parser.add_argument("--model", default=None, help="model directory (default: the shipped model)")
    parser.add_argument(
        "--server-args",
        default="",
        help="more `pagedserve up` flags, e.g. '--device cuda --load-format dummy' for a real-shape model on a GPU",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--tag", default="", help="added to the result and plot file names")
    parser.add_argument("--out-dir", default=str(ROOT / "benchmarks" / "results"))
    parser.add_argument("--plot-dir", default=str(ROOT / "docs"))
    parser.add_argument(
        "--interleave",
        action="store_true",
        help="start every system at once and run them in "
        "turn at each rate, so that a drift in the machine's speed touches all alike (the CPU; on a "
        "GPU the systems' weights would not fit together)",
    )
    parser.add_argument(
        "--combine",
        nargs="+",
        metavar="JSON",
        help="run nothing: join the systems of earlier "
        "result files (each run the same way, e.g. in two calls on a lent GPU) into one figure",
    )
    args = parser.parse_args()
    if args.combine:
        return combine(args)
    rates = [float(r) for r in args.rates.split(",")]
    policies = args.policies.split(",")
    warmup = 2
    jobs = WORKLOADS[args.workload](args.num_prompts + warmup, seed=args.seed, max_model_len=args.max_model_len)
    runs: dict[str, list[dict]] = {policy: [] for policy in policies}

    def measure(policy: str, server: tuple[str, str], i: int, rate: float) -> None:
        # The warm-up requests go once per server, before its first rate.
        result = run_at_rate(
            *server, jobs if i == 0 else jobs[warmup:], rate, seed=args.seed, warmup=warmup if i == 0 else 0
        )
        runs[policy].append({"rate": rate, **result})
        print(
            f"{LABELS[policy]:<14} rate {rate:5.2f}/s  normalized {result['normalized_latency_s_per_token']:.4f} "
            f"s/token  throughput {result['request_throughput']:.2f} req/s  "
            f"tokens {result['kv_slots_percent']['tokens']:.1f} % of KV used or stranded",
            flush=True,
        )

    def save() -> dict:  # after each system or rate: a cut-off run keeps what it measured
        payload = summarize({p: points for p, points in runs.items() if points}, args, describe(jobs[warmup:]))
        write_json(Path(args.out_dir) / f"fig12_{args.workload}{args.tag}.json", payload)
        return payload

    def server(policy: str):
        if policy == "paged_int8":
            blocks = int8_blocks_in_the_same_bytes(args)
            print(f"{LABELS[policy]}: {blocks} int8 blocks in the bytes of {args.num_blocks}", flush=True)
            flags = [
                "--kv-reservation",
                "paged",
                "--kv-cache-dtype",
                "int8",
                *budget_flags(argparse.Namespace(**{**vars(args), "num_blocks": blocks})),
            ]
        else:
            flags = ["--kv-reservation", policy, *budget_flags(args)]
        return pagedserve(*flags, *args.server_args.split(), model=args.model)

    if args.interleave:
        with ExitStack() as stack:
            servers = {policy: stack.enter_context(server(policy)) for policy in policies}
            for i, rate in enumerate(rates):
                for policy in policies:
                    measure(policy, servers[policy], i, rate)
                payload = save()
    else:
        for policy in policies:
            with server(policy) as running:
                for i, rate in enumerate(rates):
                    measure(policy, running, i, rate)
            payload = save()
    report(payload, args)


def combine(args) -> None:
    files = [json.loads(Path(name).read_text()) for name in args.combine]
    runs = {policy: points for payload in files for policy, points in payload["runs"].items()}
    runs = {policy: runs[policy] for policy in sorted(runs, key=POLICIES.index)}  # pagedserve first: the baseline
    recorded = argparse.Namespace(
        **{**files[0]["args"], "slo": args.slo, "tag": args.tag, "combine": args.combine, "policies": ",".join(runs)}
    )
    payload = {
        **summarize(runs, recorded, files[0]["trace"]),
        "commit": files[0]["commit"],
        **{key: files[0][key] for key in ("machine", "processor", "cores", "gpu", "python", "date")},
    }
    write_json(Path(args.out_dir) / f"fig12_{recorded.workload}{args.tag}.json", payload)
    report(payload, argparse.Namespace(**{**vars(recorded), "out_dir": args.out_dir, "plot_dir": args.plot_dir}))


def report(payload: dict, args) -> None:
    runs, limit, sustained = payload["runs"], payload["slo_s_per_token"], payload["sustained_rate"]
    policies = list(runs)
    print(
        f"\nsustained rate at normalized latency <= {limit:.4f} s/token ({args.slo:g} x {LABELS[policies[0]]} "
        "at the lowest rate):"
    )
    for policy in policies:
        ratio = sustained[policies[0]] / sustained[policy] if sustained[policy] else float("inf")
        print(f"  {LABELS[policy]:<14} {sustained[policy]:.2f} req/s   {LABELS[policies[0]]} / this: {ratio:.2f}x")
    model = Path(args.model).name if args.model else "tiny-python"
    plot(
        runs,
        limit,
        f"{model}, {args.workload}-like, {args.num_blocks} KV blocks of {args.block_size}, "
        f"context {args.max_model_len}",
        Path(args.plot_dir) / f"fig12_{args.workload}{args.tag}.png",
    )


def summarize(runs: dict[str, list[dict]], args, trace: dict) -> dict:
    first = next(iter(runs))
    limit = args.slo * runs[first][0]["normalized_latency_s_per_token"]
    sustained = {
        p: sustained_rate([(r["rate"], r["normalized_latency_s_per_token"]) for r in points], limit)
        for p, points in runs.items()
    }
    return {
        "figure": "12",
        "workload": args.workload,
        "trace": trace,
        "args": vars(args),
        "commit": commit(),
        **machine(),
        "slo_s_per_token": limit,
        "sustained_rate": sustained,
        "runs": runs,
    }


def plot(runs: dict[str, list[dict]], limit: float, title: str, path: Path) -> None:
    figure, axes = pyplot().subplots(figsize=(6, 4))
    for policy, points in runs.items():
        axes.plot(
            [p["rate"] for p in points],
            [p["normalized_latency_s_per_token"] for p in points],
            marker="o",
            label=LABELS[policy],
        )
    axes.axhline(limit, color="grey", linestyle=":", label="latency limit")
    axes.set_xlabel("request rate (req/s)")
    axes.set_ylabel("normalized latency (s/token)")
    axes.set_yscale("log")
    axes.set_title(title)
    axes.legend()
    save_figure(figure, path)


if __name__ == "__main__":
    main()
