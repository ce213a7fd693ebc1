"""peer_bench's report: its tables of figures per system and of ratios per repetition, and its plot."""

from __future__ import annotations

import statistics
from pathlib import Path

HIGHER_IS_BETTER = {"output_throughput", "request_throughput"}


def spread(values: list[float], digits: int = 1) -> str:
    if not values:
        return "-"
    if len(values) == 1:
        return f"{values[0]:,.{digits}f}"
    return f"{statistics.median(values):,.{digits}f} ({min(values):,.{digits}f}–{max(values):,.{digits}f})"


def advantage(metric: str, ours: float, theirs: float) -> float:
    """Above 1 where pagedserve is better: a throughput's ratio, or a time's inverse ratio."""
    return ours / theirs if metric in HIGHER_IS_BETTER else theirs / ours


def table(runs: dict[str, list[dict]], scenarios: dict) -> list[dict]:
    rows = []
    for scenario_name, scenario in scenarios.items():
        for metric in scenario.metrics:
            ours = [r[scenario_name][metric] for r in runs.get("pagedserve", [])]
            row = {"scenario": scenario_name, "metric": metric, "pagedserve": ours}
            for peer, key in (("vllm", "ratio"), ("vllm-all-cores", "ratio_all_cores")):
                if peer in runs or peer == "vllm":
                    theirs = [r[scenario_name][metric] for r in runs.get(peer, [])]
                    row[peer] = theirs
                    row[key] = [advantage(metric, a, b) for a, b in zip(ours, theirs) if a and b]
            if "pagedserve-baseline" in runs:  # the same server on another checkpoint of the shape (bf16, say)
                row["baseline"] = [r[scenario_name][metric] for r in runs["pagedserve-baseline"]]
                row["ratio_baseline"] = [advantage(metric, a, b) for a, b in zip(ours, row["baseline"]) if a and b]
            if "vllm-all-cores" in runs:  # vLLM at its best: the better of its two settings, repetition by repetition
                pick = max if metric in HIGHER_IS_BETTER else min
                row["vllm-best"] = [pick(a, b) for a, b in zip(row["vllm"], row["vllm-all-cores"])]
                row["ratio_best"] = [advantage(metric, a, b) for a, b in zip(ours, row["vllm-best"]) if a and b]
            rows.append(row)
    for scenario_name in scenarios:  # pagedserve's worker waiting on the scheduler, as a share of its busy time
        shares = [r[scenario_name]["worker_waiting_share"] for r in runs.get("pagedserve", [])]
        rows.append(
            {"scenario": scenario_name, "metric": "worker waiting / busy", "system": "pagedserve", "share": shares}
        )
    for system, system_runs in runs.items():  # saturation under load as a share of the quiet figure
        if "throughput" in scenarios and "throughput_loaded" in scenarios:
            shares = [
                r["throughput_loaded"]["output_throughput"] / r["throughput"]["output_throughput"] for r in system_runs
            ]
            rows.append(
                {"scenario": "loaded / quiet", "metric": "output_throughput share", "system": system, "share": shares}
            )
    return rows


SPEC_RATIOS = (("pagedserve+spec", "pagedserve"), ("pagedserve+spec", "vllm+spec"))


def spec_table(runs: dict[str, list[dict]], scenarios: dict) -> list[dict]:
    """With --speculative-config: every system's figure, and plain ratios (a / b, per repetition) of
    pagedserve with speculation over pagedserve without, and over vLLM with the same config."""
    rows = []
    for scenario_name, scenario in scenarios.items():
        for metric in (*scenario.metrics, "acceptance_length"):
            values = {
                system: [r[scenario_name].get(metric) for r in system_runs] for system, system_runs in runs.items()
            }
            values = {system: v for system, v in values.items() if all(x is not None for x in v)}
            ratios = {
                f"{a} / {b}": [x / y for x, y in zip(values[a], values[b]) if y]
                for a, b in SPEC_RATIOS
                if a in values and b in values
            }
            rows.append({"scenario": scenario_name, "metric": metric, "values": values, "ratios": ratios})
    return rows


def print_spec_table(rows: list[dict], systems: list[str]) -> None:
    pairs = [f"{a} / {b}" for a, b in SPEC_RATIOS if a in systems and b in systems]
    print("\n| scenario | metric | " + " | ".join(systems) + " | " + " | ".join(f"{p} (×)" for p in pairs) + " |")
    print("| --- | --- | " + " | ".join("---" for _ in systems + pairs) + " |")
    for row in rows:
        cells = [
            spread(row["values"][s], 2 if row["metric"] == "acceptance_length" else 1) if s in row["values"] else ""
            for s in systems
        ]
        cells += [spread(row["ratios"].get(p, []), 2) for p in pairs]
        print(f"| {row['scenario']} | {row['metric']} | " + " | ".join(cells) + " |")
    print("a / b: the figure of a over that of b, per repetition (for TPOT lower is better, for throughput higher)")


def print_table(rows: list[dict]) -> None:
    all_cores = any("vllm-all-cores" in row for row in rows)
    baseline = any("baseline" in row for row in rows)
    extra = " vLLM, all cores | advantage over it (×) | over vLLM at its best (×) |" if all_cores else ""
    extra += " baseline model | advantage over it (×) |" if baseline else ""
    print("\n| scenario | metric | pagedserve | vLLM | pagedserve advantage (×) |" + extra)
    print(
        "| --- | --- | --- | --- | --- |"
        + (" --- | --- | --- |" if all_cores else "")
        + (" --- | --- |" if baseline else "")
    )
    for row in rows:
        if "share" in row:
            share = spread([100 * s for s in row["share"]])
            print(
                f"| {row['scenario']} ({row['system']}) | {row['metric']} | {share} % | | |"
                + (" | | |" if all_cores else "")
                + (" | |" if baseline else "")
            )
        else:
            cells = [spread(row["pagedserve"]), spread(row.get("vllm", [])), spread(row.get("ratio", []), 2)]
            if all_cores:
                cells += [
                    spread(row["vllm-all-cores"]),
                    spread(row["ratio_all_cores"], 2),
                    spread(row["ratio_best"], 2),
                ]
            if baseline:
                cells += [spread(row.get("baseline", [])), spread(row.get("ratio_baseline", []), 2)]
            print(f"| {row['scenario']} | {row['metric']} | " + " | ".join(cells) + " |")
    print(
        "advantage: throughput ratio, or vLLM's time over ours; above 1 means pagedserve is better. vLLM at its "
        "best: the better of its two settings in each repetition"
    )


def plot(sweeps: dict[str, dict[float, dict]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axis = plt.subplots(figsize=(6, 4))
    for system, by_rate in sweeps.items():
        rates = sorted(by_rate)
        axis.plot(rates, [by_rate[r]["mean_tpot_ms"] for r in rates], marker="o", label=system)
    axis.set_xlabel("request rate (req/s, Poisson)")
    axis.set_ylabel("mean time per output token (ms)")
    axis.set_title("ShareGPT-like lengths (161 in / 338 out)")
    axis.grid(alpha=0.3)
    axis.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=120)
