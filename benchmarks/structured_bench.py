"""Structured outputs: what a JSON schema on every request costs, here and in vLLM, and whether
compiling new schemas delays anyone else.

1. Throughput at concurrency 32 without a constraint and with the same JSON schema on every request
   (`response_format`, through `--extra-body` when vLLM's client drives), pagedserve and vLLM up at
   once, each scenario on each in turn, repetition after repetition. The schema keeps every output
   inside it for all 128 tokens (64 items at least), so each token pays for its mask.
2. pagedserve's time to first token of unconstrained requests (concurrency 4) alone, and while ten
   requests with ten schemas it has never seen arrive among them.

    python benchmarks/structured_bench.py --vllm-venv /work/vllm-venv --repeats 3
    python benchmarks/structured_bench.py --repeats 1          # pagedserve alone, our client
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import random
import sys
import tempfile
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from benchmarks import serve_client, workloads  # noqa: E402
from benchmarks.peer_bench import (  # noqa: E402
    SERVED_NAME,
    Scenario,
    add_system_args,
    run_interleaved,
    settle_system_args,
    start_system,
)
from benchmarks.peer_report import spread  # noqa: E402

RECORDS = {
    "type": "array",
    "items": {
        "type": "object",
        "properties": {
            "id": {"type": "integer"},
            "name": {"type": "string"},
            "tags": {"type": "array", "items": {"type": "string"}},
        },
        "required": ["id", "name", "tags"],
    },
    "minItems": 64,  # more than 128 tokens can hold: no system's grammar ends early and leaves it free
}
SCHEMA_BODY = json.dumps(
    {"response_format": {"type": "json_schema", "json_schema": {"name": "records", "schema": RECORDS}}}
)
METRICS = ("output_throughput", "mean_tpot_ms", "mean_ttft_ms")


def scenarios(num_prompts: int, output_len: int) -> dict[str, Scenario]:
    return {
        "free_c32": Scenario(128, output_len, num_prompts, max_concurrency=32, metrics=METRICS),
        "schema_c32": Scenario(128, output_len, num_prompts, max_concurrency=32, metrics=METRICS, body=SCHEMA_BODY),
    }


def new_schema(rng: random.Random) -> dict:
    """A schema no server has seen: 40 properties of every kind under fresh names."""
    kinds = [
        {"type": "integer", "minimum": 0, "maximum": 10_000},
        {"type": "string", "maxLength": 20},
        {"enum": [f"v{rng.randrange(10**6)}" for _ in range(8)]},
        {"type": "boolean"},
        {"type": "string", "pattern": "^[a-z]{2,6}-[0-9]{3}$"},
        {"type": "array", "items": {"type": "number"}, "maxItems": 4},
        {"type": "object", "properties": {"x": {"type": "integer"}, "y": {"type": "string"}}},
    ]
    properties = {f"p{rng.randrange(10**9)}": rng.choice(kinds) for _ in range(40)}
    return {"type": "object", "properties": properties, "required": list(properties)[:20]}


async def ttft_while_compiling(base_url: str, seed: int, num_prompts: int, compiles: int) -> dict:
    """Unconstrained requests' figures, with `compiles` new-schema requests sent among them."""
    jobs = workloads.fixed(num_prompts, 128, 32, seed=seed)
    measured = asyncio.create_task(serve_client.run_jobs(base_url, SERVED_NAME, jobs, max_concurrency=4, seed=seed))
    rng = random.Random(seed)
    statuses = []
    async with httpx.AsyncClient(timeout=None) as client:
        for _ in range(compiles):
            await asyncio.sleep(0.2)
            body = {
                "model": SERVED_NAME,
                "prompt": [rng.randrange(4096) for _ in range(16)],
                "max_tokens": 8,
                "response_format": {"type": "json_schema", "json_schema": {"name": "new", "schema": new_schema(rng)}},
            }
            statuses.append(asyncio.create_task(client.post(f"{base_url}/v1/completions", json=body)))
        answers = await asyncio.gather(*statuses)
        result = await measured
    result["compile_requests_ok"] = sum(a.status_code == 200 for a in answers)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_system_args(parser)
    parser.add_argument("--num-prompts", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--ttft-prompts", type=int, default=40)
    parser.add_argument("--compiles", type=int, default=10)
    parser.add_argument("--port", type=int, default=8500)
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "structured_bench.json"))
    args = parser.parse_args()
    settle_system_args(parser, args)
    systems = ["pagedserve"] + (["vllm"] if args.vllm_venv else [])
    table = scenarios(args.num_prompts, args.output_len)
    with tempfile.TemporaryDirectory(prefix="structured-bench-") as scratch:
        runs = run_interleaved(args, systems, table, Path(scratch))
        server = start_system(args, "pagedserve", args.port + 100, Path(scratch))
        ttft = {"alone": [], "compiling": []}
        try:
            base_url = f"http://127.0.0.1:{args.port + 100}"
            for repeat in range(args.repeats):
                for case, compiles in (("alone", 0), ("compiling", args.compiles)):
                    seed = 100 * repeat + compiles  # fresh prompts and fresh schemas every time
                    result = asyncio.run(ttft_while_compiling(base_url, seed, args.ttft_prompts, compiles))
                    ttft[case].append(result)
                    print(
                        f"  ttft {case}: mean {result['mean_ttft_ms']:.1f} ms, "
                        f"median {result['median_ttft_ms']:.1f} ms",
                        flush=True,
                    )
        finally:
            server.stop()

    def figures(system: str, scenario: str, metric: str) -> list[float]:
        return [run[scenario][metric] for run in runs[system]]

    rows = {
        "schema / free throughput, pagedserve": [
            s / f
            for s, f in zip(
                figures("pagedserve", "schema_c32", "output_throughput"),
                figures("pagedserve", "free_c32", "output_throughput"),
            )
        ]
    }
    if "vllm" in runs:
        rows["schema / free throughput, vLLM"] = [
            s / f
            for s, f in zip(
                figures("vllm", "schema_c32", "output_throughput"), figures("vllm", "free_c32", "output_throughput")
            )
        ]
        rows["pagedserve / vLLM, with the schema"] = [
            p / v
            for p, v in zip(
                figures("pagedserve", "schema_c32", "output_throughput"),
                figures("vllm", "schema_c32", "output_throughput"),
            )
        ]
    rows["TTFT while compiling / alone (mean)"] = [
        c["mean_ttft_ms"] / a["mean_ttft_ms"] for a, c in zip(ttft["alone"], ttft["compiling"])
    ]
    print(f"\n{'figure':44} median (min–max) over {args.repeats} repetitions")
    for system in systems:
        for scenario in table:
            for metric in METRICS:
                print(f"{system + ' ' + scenario + ' ' + metric:44} {spread(figures(system, scenario, metric))}")
    for case, results in ttft.items():
        print(f"{'pagedserve TTFT ms, ' + case:44} {spread([r['mean_ttft_ms'] for r in results])}")
    for name, values in rows.items():
        print(f"{name:44} {spread(values, 3)}")
    record = {
        "machine": f"{platform.machine()}, {os.cpu_count()} cores, {platform.platform()}",
        "date": time.strftime("%Y-%m-%d"),
        "client": args.client,
        "model": args.model,
        "schema": RECORDS,
        "runs": runs,
        "ttft": ttft,
        "ratios": rows,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(record, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
