"""Prefill/decode disaggregation against one engine, on the same machine and KV budget.

Workload: 16 steady streams, each a closed loop of requests of 64 prompt tokens and 512 output tokens, and
Poisson arrivals of 2,048-token prompts (32 output tokens) at `--rate` per second, for `--seconds`; every
request runs to its length (`ignore_eos`). Systems, interleaved per repetition:

- `single`: one engine on every core (`pagedserve up`, the KV cache of `--kv-cache-gib`);
- `pd`: one prefill and one decode engine with the cores split between them (`pagedserve up --pd 1:1`), each
  with half the KV cache.

Per run: the steady streams' TPOT (per request: (latency - TTFT) / (tokens - 1)) at p50 and p99, their p99
gap between two tokens, the long prompts' median and p99 TTFT, output throughput, and goodput: requests per
second that met both objectives, TTFT at most `--ttft-slo` seconds and TPOT at most `--tpot-slo` seconds.

    python benchmarks/pd_bench.py --model DIR --repeats 3 --out benchmarks/results/pd_bench.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
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
from benchmarks.serve_client import Outcome, _one  # noqa: E402

STEADY_STREAMS, STEADY_IN, STEADY_OUT = 16, 64, 512
LONG_IN, LONG_OUT = 2048, 32
SYSTEMS = {"single": [], "pd": ["--pd", "1:1"]}


def payload(prompt: list[int], max_tokens: int) -> dict:
    return {
        "model": SERVED_NAME,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }


async def workload(url: str, seconds: float, rate: float, seed: int, vocab: int) -> tuple[list, list, float]:
    rng = random.Random(seed)
    steady: list[Outcome] = []
    long: list[Outcome] = []

    def prompt(n: int) -> list[int]:
        return [rng.randrange(10, vocab) for _ in range(n)]

    limits = httpx.Limits(max_connections=256, max_keepalive_connections=256)
    async with httpx.AsyncClient(timeout=httpx.Timeout(600.0), limits=limits) as client:
        await asyncio.gather(*(_one(client, url, payload(prompt(LONG_IN), 2)) for _ in range(2)))  # warm up
        started = time.perf_counter()
        deadline = started + seconds

        async def stream(delay: float) -> None:
            await asyncio.sleep(delay)  # the streams start spread over a second, not in one burst
            while time.perf_counter() < deadline:
                steady.append(await _one(client, url, payload(prompt(STEADY_IN), STEADY_OUT)))

        async def arrivals() -> None:
            pending = []
            while (now := time.perf_counter()) < deadline:
                await asyncio.sleep(min(rng.expovariate(rate), deadline - now))
                if time.perf_counter() < deadline:
                    pending.append(
                        asyncio.create_task(record(long, _one(client, url, payload(prompt(LONG_IN), LONG_OUT))))
                    )
            await asyncio.gather(*pending)

        await asyncio.gather(arrivals(), *(stream(i / STEADY_STREAMS) for i in range(STEADY_STREAMS)))
        return steady, long, time.perf_counter() - started


async def record(into: list, outcome) -> None:
    into.append(await outcome)


def tpot(outcome: Outcome) -> float:
    return (outcome.latency - outcome.ttft) / max(1, outcome.output_tokens - 1)


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else float("nan")


def summarize(steady: list[Outcome], long: list[Outcome], duration: float, args) -> dict:
    done = [o for o in steady + long if o.ok]
    gaps = [b - a for o in steady if o.ok for a, b in zip(o.token_times, o.token_times[1:])]
    met = [o for o in done if o.ttft <= args.ttft_slo and tpot(o) <= args.tpot_slo]
    return {
        "steady_requests": sum(o.ok for o in steady),
        "long_requests": sum(o.ok for o in long),
        "failed": len(steady) + len(long) - len(done),
        "steady_p50_tpot_ms": 1e3 * percentile([tpot(o) for o in steady if o.ok], 0.5),
        "steady_p99_tpot_ms": 1e3 * percentile([tpot(o) for o in steady if o.ok], 0.99),
        "steady_p99_gap_ms": 1e3 * percentile(gaps, 0.99),
        "long_median_ttft_s": percentile([o.ttft for o in long if o.ok], 0.5),
        "long_p99_ttft_s": percentile([o.ttft for o in long if o.ok], 0.99),
        "output_throughput": sum(o.output_tokens for o in done) / duration,
        "goodput": len(met) / duration,
        "seconds": duration,
    }


def run(system: str, args, seed: int) -> dict:
    budget = args.kv_cache_gib / (2 if system == "pd" else 1)
    flags = [*SYSTEMS[system], "--dtype", args.dtype, "--kv-cache-memory", str(budget), "--enable-prefix-caching"]
    with pagedserve(*flags, model=args.model) as (api_url, _):
        if system == "pd":  # both engines up before the clock starts
            while httpx.get(f"{api_url}/health", timeout=5).status_code != 200:
                time.sleep(0.5)
        with open(Path(args.model) / "config.json") as f:
            vocab = json.load(f)["vocab_size"]
        steady, long, duration = asyncio.run(
            workload(f"{api_url}/v1/completions", args.seconds, args.rate, seed, vocab)
        )
    return summarize(steady, long, duration, args)


METRICS = (
    ("steady_p99_tpot_ms", "lower"),
    ("steady_p50_tpot_ms", "lower"),
    ("steady_p99_gap_ms", "lower"),
    ("long_median_ttft_s", "lower"),
    ("goodput", "higher"),
    ("output_throughput", "higher"),
)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--seconds", type=float, default=60.0, help="how long requests keep arriving")
    parser.add_argument("--rate", type=float, default=0.3, help="2,048-token prompts per second (Poisson)")
    parser.add_argument("--kv-cache-gib", type=float, default=2.0, help="in all: each P/D engine gets half")
    parser.add_argument("--ttft-slo", type=float, default=3.0, help="seconds to the first token, for goodput")
    parser.add_argument("--tpot-slo", type=float, default=0.02, help="seconds per output token, for goodput")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    runs: dict[str, list[dict]] = {name: [] for name in SYSTEMS}
    for repeat in range(args.repeats):
        for name in SYSTEMS:
            result = run(name, args, seed=repeat)
            runs[name].append(result)
            print(
                f"repetition {repeat + 1}, {name}: " + ", ".join(f"{k} {v:.3g}" for k, v in result.items()), flush=True
            )
    print("\n| figure | one engine | 1 prefill + 1 decode | P/D over one engine |\n| --- | --- | --- | --- |")
    ratios = {}
    for metric, better in METRICS:
        single, pd = [r[metric] for r in runs["single"]], [r[metric] for r in runs["pd"]]
        ratio = [p / s if s else float("nan") for p, s in zip(pd, single)]
        ratios[metric] = ratio
        print(f"| {metric} ({better} is better) | {spread(single)} | {spread(pd)} | {spread(ratio)} |")
    record_ = {
        "machine": machine(),
        "commit": commit(),
        "model": args.model,
        "settings": {k: v for k, v in vars(args).items() if k != "out"},
        "workload": {"steady_streams": STEADY_STREAMS, "steady": [STEADY_IN, STEADY_OUT], "long": [LONG_IN, LONG_OUT]},
        "runs": runs,
        "ratios": ratios,
        "medians": {name: {m: statistics.median(r[m] for r in rs) for m, _ in METRICS} for name, rs in runs.items()},
    }
    if args.out:
        write_json(Path(args.out), record_)


if __name__ == "__main__":
    main()
