"""Data parallelism's routing policies compared: two engines behind one api, under multi-tenant
traffic (16 system prompts of 400-800 tokens, each shared by many requests with short suffixes of
their own), once per policy and repeat, interleaved.

For each run it prints the prefix-cache hit rate (prompt tokens found cached, over both engines'
schedulers), output throughput and TTFT, then each policy's median with its spread, and prefix
routing's ratios to round robin. Both engines share this machine's cores, so the ratios mean more
than the absolute figures. `--num-blocks` sets each engine's KV cache: by default 340 blocks, a
little over half of the system prompts' blocks, so the two caches together hold every prompt
once but not twice, as when tenants' prompts outgrow one replica's memory. Where each cache
holds them all (`--num-blocks 2048`), round robin finds them as well, after a miss per engine.

    python benchmarks/dp_bench.py --repeats 3 --out benchmarks/results/dp_bench.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import socket
import sys
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from benchmarks import serve_client  # noqa: E402
from benchmarks.paper_harness import SERVED_NAME, free_ports, machine, pagedserve, write_json  # noqa: E402
from benchmarks.peer_report import spread  # noqa: E402
from benchmarks.provenance import commit  # noqa: E402
from benchmarks.workloads import system_prompts, tenants  # noqa: E402

POLICIES = ("round_robin", "least_load", "prefix")
ENGINE_PORT_STRIDE = 10  # as shared.config: engine i's scheduler metrics on the base port + 10 i


def scheduler_counters(url: str) -> dict[str, float]:
    with urllib.request.urlopen(url, timeout=10) as response:
        text = response.read().decode()
    wanted = (
        "pagedserve_prefix_cache_hits_total",
        "pagedserve_prefix_cache_queries_total",
        "pagedserve_prompt_tokens_computed_total",
    )
    return {line.split()[0]: float(line.split()[1]) for line in text.splitlines() if line.split(" ")[0] in wanted}


def routed(api_url: str) -> list[int]:
    with urllib.request.urlopen(f"{api_url}/metrics", timeout=10) as response:
        lines = response.read().decode().splitlines()
    return [int(float(line.split()[1])) for line in lines if line.startswith("pagedserve_engine_routed_requests_total")]


def wait_all_engines(api_url: str, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(f"{api_url}/health", timeout=2) as response:
                if json.loads(response.read()).get("status") == "ok":
                    return
        except OSError:
            pass
        time.sleep(0.5)
    raise RuntimeError("the engines were not all up in time")


def metrics_base_port(engines: int) -> int:
    """A port free now with the one `ENGINE_PORT_STRIDE` above it, for each engine's scheduler metrics."""
    while True:
        base = free_ports(1)[0]
        if all(_bindable(port) for port in range(base, base + ENGINE_PORT_STRIDE * engines, ENGINE_PORT_STRIDE)):
            return base


def _bindable(port: int) -> bool:
    if port >= 65536:
        return False
    with socket.socket() as probe:
        try:
            probe.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def run_policy(policy: str, args, jobs) -> dict:
    base = metrics_base_port(args.engines)
    urls = [f"http://127.0.0.1:{base + ENGINE_PORT_STRIDE * i}/metrics" for i in range(args.engines)]
    flags = [
        "--data-parallel-size",
        str(args.engines),
        "--routing",
        policy,
        "--enable-prefix-caching",
        "--num-gpu-blocks-override",
        str(args.num_blocks),
        "--scheduler-metrics-port",
        str(base),
    ]
    with pagedserve(*flags, model=args.model) as (api_url, _):
        wait_all_engines(api_url)
        before = [scheduler_counters(url) for url in urls]
        result = asyncio.run(serve_client.run_jobs(api_url, SERVED_NAME, jobs, max_concurrency=args.concurrency))
        after = [scheduler_counters(url) for url in urls]
        result["requests_by_engine"] = routed(api_url)
    delta = {key: sum(a[key] - b[key] for a, b in zip(after, before)) for key in after[0]}
    queries = delta["pagedserve_prefix_cache_queries_total"]
    result["prefix_cache_hit_rate"] = delta["pagedserve_prefix_cache_hits_total"] / queries if queries else 0.0
    result["prompt_tokens_computed"] = delta["pagedserve_prompt_tokens_computed_total"]
    result["hit_rate_by_engine"] = [
        (a["pagedserve_prefix_cache_hits_total"] - b["pagedserve_prefix_cache_hits_total"])
        / max(1.0, a["pagedserve_prefix_cache_queries_total"] - b["pagedserve_prefix_cache_queries_total"])
        for a, b in zip(after, before)
    ]
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="model directory (default: the shipped tiny-python)")
    parser.add_argument("--engines", type=int, default=2)
    parser.add_argument("--policies", default=",".join(POLICIES))
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--num-prompts", type=int, default=192, help="requests per run")
    parser.add_argument("--prefixes", type=int, default=16, help="system prompts, 400-800 tokens each")
    parser.add_argument("--output-len", type=int, default=16)
    parser.add_argument("--concurrency", type=int, default=16, help="requests in flight at most")
    parser.add_argument("--num-blocks", type=int, default=340, help="KV blocks of 16 tokens per engine")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=None, help="write every run's figures here, as JSON")
    args = parser.parse_args()
    policies = args.policies.split(",")
    prompts = system_prompts(args.prefixes, seed=args.seed)
    jobs = tenants(args.num_prompts, prompts, output_len=args.output_len, seed=args.seed + 1)
    prompt_blocks = sum(len(p) // 16 for p in prompts)
    print(
        f"{args.prefixes} system prompts, {prompt_blocks} full blocks in all; each engine's KV cache "
        f"{args.num_blocks} blocks ({args.num_blocks / prompt_blocks:.2f} of them)",
        flush=True,
    )
    runs: dict[str, list[dict]] = {policy: [] for policy in policies}
    for repeat in range(args.repeats):
        for policy in policies:
            result = run_policy(policy, args, jobs)
            runs[policy].append(result)
            print(
                f"run {repeat + 1} {policy:<12} hit rate {result['prefix_cache_hit_rate']:.3f} "
                f"(by engine {', '.join(f'{h:.3f}' for h in result['hit_rate_by_engine'])}; requests "
                f"{'/'.join(map(str, result['requests_by_engine']))})  "
                f"output {result['output_throughput']:.1f} tok/s  mean TTFT {result['mean_ttft_ms']:.0f} ms  "
                f"failed {result['failed']}",
                flush=True,
            )
    print(
        f"\n{args.engines} engines, {args.num_prompts} requests over {args.prefixes} system prompts, "
        f"concurrency {args.concurrency}, {args.num_blocks} KV blocks per engine; median [min-max] of "
        f"{args.repeats} runs"
    )
    print(f"{'policy':<12} {'hit rate':<22} {'output tok/s':<28} {'mean TTFT ms':<28}")
    for policy in policies:
        rows = runs[policy]
        print(
            f"{policy:<12} {spread([r['prefix_cache_hit_rate'] for r in rows], 3):<22} "
            f"{spread([r['output_throughput'] for r in rows], 3):<28} "
            f"{spread([r['mean_ttft_ms'] for r in rows], 3):<28}"
        )
    ratios = {}
    if "prefix" in runs and "round_robin" in runs:
        pairs = list(zip(runs["prefix"], runs["round_robin"]))
        ratios = {
            "hit_rate": [p["prefix_cache_hit_rate"] / max(r["prefix_cache_hit_rate"], 1e-9) for p, r in pairs],
            "output_throughput": [p["output_throughput"] / r["output_throughput"] for p, r in pairs],
            "mean_ttft": [p["mean_ttft_ms"] / r["mean_ttft_ms"] for p, r in pairs],
        }
        print(
            "prefix / round_robin, per repeat: "
            + "; ".join(f"{name} {', '.join(f'{v:.2f}' for v in values)}" for name, values in ratios.items())
        )
    if args.out:
        write_json(
            args.out,
            {
                "machine": machine(),
                "commit": commit(),
                "args": vars(args) | {"out": str(args.out)},
                "system_prompt_blocks": prompt_blocks,
                "runs": runs,
                "prefix_over_round_robin": ratios,
            },
        )
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
