"""Fairness between tenants: tenant A keeps many long requests in flight, tenant B sends short ones
one at a time; B's time to first token under each scheduling policy, against B's alone.

For each repeat and policy (interleaved), one server (`--max-num-seqs` seats, so that A's flood
queues):
1. B alone: `--alone` requests one after another on the idle server: TTFT median and p99.
2. Contended, for `--duration` seconds: A's closed loop keeps `--flood` requests in flight (each
   finished one is replaced at once); B's closed loop sends its next request when the last one ends.
   B's TTFT median and p99, and the output throughput of both tenants together, counted from the
   tokens streamed (B) or returned whole (A, which does not stream) in the window after `--settle`
   seconds.
Tenants are named by the `user` field (the server has no api keys). It prints each run, then each
policy's medians with their spread, B's contended TTFT over its alone TTFT, and each policy's
throughput over FCFS's.

    python benchmarks/fairness_bench.py --repeats 3 --out benchmarks/results/fairness_bench.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from benchmarks.paper_harness import SERVED_NAME, machine, pagedserve, write_json  # noqa: E402
from benchmarks.peer_report import spread  # noqa: E402
from benchmarks.provenance import commit  # noqa: E402
from benchmarks.workloads import fixed  # noqa: E402

POLICIES = ("fcfs", "fair")


class Tenant:
    """One tenant's closed loop: its requests' TTFTs and the times of every token it was streamed, or,
    not streaming, of its whole responses (each time once per token)."""

    def __init__(self, name: str, input_len: int, output_len: int, seed: int, stream: bool = True):
        self.name, self.output_len, self.stream = name, output_len, stream
        self.prompts = [job.prompt for job in fixed(64, input_len, output_len, seed=seed)]
        self.ttfts: list[float] = []
        self.token_times: list[float] = []
        self.sent = 0

    async def one(self, client: httpx.AsyncClient) -> None:
        prompt = self.prompts[self.sent % len(self.prompts)]
        self.sent += 1
        payload = {
            "model": SERVED_NAME,
            "prompt": prompt,
            "max_tokens": self.output_len,
            "stream": self.stream,
            "ignore_eos": True,
            "temperature": 0,
            "user": self.name,
        }
        started = time.perf_counter()
        if not self.stream:
            response = await client.post("/v1/completions", json=payload)
            if response.status_code != 200:
                raise RuntimeError(f"{self.name}: {response.status_code} {response.text[:300]!r}")
            self.token_times += [time.perf_counter()] * response.json()["usage"]["completion_tokens"]
            return
        first = None
        async with client.stream("POST", "/v1/completions", json=payload) as response:
            if response.status_code != 200:
                raise RuntimeError(f"{self.name}: {response.status_code} {(await response.aread())[:300]!r}")
            async for line in response.aiter_lines():
                if line.startswith("data: {") and json.loads(line[6:])["choices"][0].get("text"):
                    now = time.perf_counter()
                    first = first if first is not None else now
                    self.token_times.append(now)
        self.ttfts.append((first if first is not None else time.perf_counter()) - started)

    async def loop(self, client: httpx.AsyncClient, until: float) -> None:
        while time.perf_counter() < until:
            await self.one(client)


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


async def measure(api_url: str, args) -> dict:
    limits = httpx.Limits(max_connections=args.flood + 4)
    async with httpx.AsyncClient(base_url=api_url, timeout=None, limits=limits) as client:
        alone = Tenant("tenant-b", args.b_input, args.b_output, seed=args.seed + 1)
        for _ in range(3):  # warm-up, not counted
            await alone.one(client)
        alone.ttfts.clear()
        for _ in range(args.alone):
            await alone.one(client)
        # The flood does not stream: on a machine of few cores a client reading 64 streams, and an api
        # writing them, would take the cores the server computes on, and B's alone figure has no such load.
        flood = Tenant("tenant-a", args.a_input, args.a_output, seed=args.seed, stream=False)
        steady = Tenant("tenant-b", args.b_input, args.b_output, seed=args.seed + 1)
        started = time.perf_counter()
        until = started + args.duration
        floods = [asyncio.create_task(flood.loop(client, until)) for _ in range(args.flood)]
        await asyncio.sleep(args.settle)  # A's flood reaches its steady state before B starts
        window_start = time.perf_counter()
        await steady.loop(client, until)
        window_end = time.perf_counter()
        for task in floods:
            task.cancel()
        await asyncio.gather(*floods, return_exceptions=True)
    tokens = sum(1 for t in flood.token_times + steady.token_times if window_start <= t < window_end)
    return {
        "b_alone_ttft_median_ms": 1000 * statistics.median(alone.ttfts),
        "b_alone_ttft_p99_ms": 1000 * percentile(alone.ttfts, 0.99),
        "b_ttft_median_ms": 1000 * statistics.median(steady.ttfts),
        "b_ttft_p99_ms": 1000 * percentile(steady.ttfts, 0.99),
        "b_requests": len(steady.ttfts),
        "b_ttfts_ms": [round(1000 * t, 1) for t in steady.ttfts],
        "a_requests_started": flood.sent,
        "output_throughput": tokens / (window_end - window_start),
        "window_s": window_end - window_start,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="model directory (default: the shipped tiny-python)")
    parser.add_argument("--policies", default=",".join(POLICIES))
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--flood", type=int, default=64, help="tenant A's requests in flight")
    parser.add_argument("--a-input", type=int, default=512)
    parser.add_argument("--a-output", type=int, default=128)
    parser.add_argument("--b-input", type=int, default=64)
    parser.add_argument("--b-output", type=int, default=16)
    parser.add_argument("--max-num-seqs", type=int, default=32, help="the server's seats: A's flood queues for them")
    parser.add_argument(
        "--max-num-batched-tokens",
        type=int,
        default=2048,
        help="the server's step budget: a step of A's prompts that B arrives during is that long",
    )
    parser.add_argument("--alone", type=int, default=20, help="B's requests on the idle server")
    parser.add_argument("--duration", type=float, default=60.0, help="seconds of the contended phase")
    parser.add_argument("--settle", type=float, default=10.0, help="seconds of A alone before B starts")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=None, help="write every run's figures here, as JSON")
    args = parser.parse_args()
    policies = args.policies.split(",")
    runs: dict[str, list[dict]] = {policy: [] for policy in policies}
    for repeat in range(args.repeats):
        for policy in policies:
            flags = [
                "--scheduling-policy",
                policy,
                "--max-num-seqs",
                str(args.max_num_seqs),
                "--max-num-batched-tokens",
                str(args.max_num_batched_tokens),
            ]
            with pagedserve(*flags, model=args.model) as (api_url, _):
                result = asyncio.run(measure(api_url, args))
            runs[policy].append(result)
            print(
                f"run {repeat + 1} {policy:<5} B TTFT median {result['b_ttft_median_ms']:.0f} ms, p99 "
                f"{result['b_ttft_p99_ms']:.0f} ms ({result['b_requests']} requests; alone "
                f"{result['b_alone_ttft_median_ms']:.0f} / {result['b_alone_ttft_p99_ms']:.0f} ms)  "
                f"output {result['output_throughput']:.1f} tok/s",
                flush=True,
            )
    summary: dict[str, dict[str, list[float]]] = {}
    print(
        f"\nA: {args.flood} requests of {args.a_input} in / {args.a_output} out in flight; B: one request of "
        f"{args.b_input} in / {args.b_output} out at a time; --max-num-seqs {args.max_num_seqs}; median "
        f"[min-max] of {args.repeats} runs"
    )
    print(
        f"{'policy':<8} {'B TTFT / alone, median':<26} {'B TTFT / alone, p99':<26} {'output tok/s':<24}"
        f"{'throughput / fcfs':<20}"
    )
    for policy in policies:
        rows = runs[policy]
        ratios = {
            "b_ttft_median_over_alone": [r["b_ttft_median_ms"] / r["b_alone_ttft_median_ms"] for r in rows],
            "b_ttft_p99_over_alone": [r["b_ttft_p99_ms"] / r["b_alone_ttft_median_ms"] for r in rows],
        }
        if "fcfs" in runs:
            ratios["throughput_over_fcfs"] = [
                r["output_throughput"] / f["output_throughput"] for r, f in zip(rows, runs["fcfs"])
            ]
        summary[policy] = ratios
        over_fcfs = spread(ratios["throughput_over_fcfs"], 2) if "throughput_over_fcfs" in ratios else "-"
        print(
            f"{policy:<8} {spread(ratios['b_ttft_median_over_alone'], 2):<26} "
            f"{spread(ratios['b_ttft_p99_over_alone'], 2):<26} "
            f"{spread([r['output_throughput'] for r in rows], 1):<24}{over_fcfs:<20}"
        )
    if args.out:
        write_json(
            args.out,
            {
                "machine": machine(),
                "commit": commit(),
                "args": vars(args) | {"out": str(args.out)},
                "runs": runs,
                "summary": summary,
            },
        )
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
