"""Prefill/decode disaggregation against one engine, on the same machine and KV budget.

Workload: 16 steady streams, each a closed loop of requests of 64 prompt tokens and 512 output tokens, and
Poisson arrivals of 2,048-token prompts (32 output tokens) at `--rate` per second, for `--seconds`; every
request runs to its length (`ignore_eos`). Systems, interleaved per repetition:

- `single`: one engine on every core (`pagedserve up`, the KV cache of `--kv-cache-gib`);
- `pd`: one prefill and one decode engine with the cores split between them (`pagedserve up --pd 1:1`), each
  with half the KV cache.

With `--vllm-venv`, vLLM's CPU build runs the same two ways: one server with its worker on every core
(`VLLM_CPU_OMP_THREADS_BIND=0-1`), and a prefill and a decode server on one core each linked by its
NixlConnector (`kv_buffer_device: cpu`; needs the `nixl` package in that venv), the client doing what its
proxy does: the prompt to the prefill server with `max_tokens` 1 and `do_remote_decode`, then the request to
the decode server with the `kv_transfer_params` it answered, streamed (TTFT counts from the first call).

Per run: the steady streams' TPOT (per request: (latency - TTFT) / (tokens - 1)) at p50 and p99, their p99
gap between two tokens, the long prompts' median and p99 TTFT, output throughput, and goodput: requests per
second that met both objectives, TTFT at most `--ttft-slo` seconds and TPOT at most `--tpot-slo` seconds.

    python benchmarks/pd_bench.py --model DIR --repeats 3 --out benchmarks/results/pd_bench.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from benchmarks.paper_harness import SERVED_NAME, free_ports, machine, pagedserve, write_json  # noqa: E402
from benchmarks.peer_bench import Server  # noqa: E402
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


async def through_prefill(client: httpx.AsyncClient, prefill_url: str, decode_url: str, body: dict) -> Outcome:
    """vLLM's P/D as its proxy runs it: the prompt on the prefill server, then the request on the decode server
    with the KV transfer parameters the first answered; times count from the first call."""
    started = time.perf_counter()
    first = {**body, "max_tokens": 1, "stream": False, "kv_transfer_params": {"do_remote_decode": True}}
    first.pop("stream_options")
    response = await client.post(prefill_url, json=first)
    if response.status_code != 200:
        return Outcome(ok=False)
    params = response.json().get("kv_transfer_params")
    outcome = await _one(client, decode_url, {**body, "kv_transfer_params": params})
    offset = time.perf_counter() - started - outcome.latency
    outcome.token_times = [t + offset for t in outcome.token_times]
    outcome.ttft, outcome.latency = outcome.ttft + offset, outcome.latency + offset
    return outcome


async def workload(
    urls: tuple[str, str | None], seconds: float, rate: float, seed: int, vocab: int
) -> tuple[list, list, float]:
    rng = random.Random(seed)
    steady: list[Outcome] = []
    long: list[Outcome] = []

    def prompt(n: int) -> list[int]:
        return [rng.randrange(10, vocab) for _ in range(n)]

    limits = httpx.Limits(max_connections=256, max_keepalive_connections=256)
    url, prefill_url = urls
    async with httpx.AsyncClient(timeout=httpx.Timeout(600.0), limits=limits) as client:

        def one(body: dict):  # noqa: ANN202
            return _one(client, url, body) if prefill_url is None else through_prefill(client, prefill_url, url, body)

        await asyncio.gather(*(one(payload(prompt(LONG_IN), 2)) for _ in range(2)))  # warm up
        started = time.perf_counter()
        deadline = started + seconds

        async def stream(delay: float) -> None:
            await asyncio.sleep(delay)  # the streams start spread over a second, not in one burst
            while time.perf_counter() < deadline:
                steady.append(await one(payload(prompt(STEADY_IN), STEADY_OUT)))

        async def arrivals() -> None:
            pending = []
            while (now := time.perf_counter()) < deadline:
                await asyncio.sleep(min(rng.expovariate(rate), deadline - now))
                if time.perf_counter() < deadline:
                    pending.append(asyncio.create_task(record(long, one(payload(prompt(LONG_IN), LONG_OUT)))))
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
    with open(Path(args.model) / "config.json") as f:
        vocab = json.load(f)["vocab_size"]
    if system.startswith("vllm"):
        return run_vllm(system, args, seed, vocab)
    budget = args.kv_cache_gib / (2 if system == "pd" else 1)
    flags = [*SYSTEMS[system], "--dtype", args.dtype, "--kv-cache-memory", str(budget), "--enable-prefix-caching"]
    with pagedserve(*flags, model=args.model) as (api_url, _):
        if system == "pd":  # both engines up before the clock starts
            while httpx.get(f"{api_url}/health", timeout=5).status_code != 200:
                time.sleep(0.5)
        steady, long, duration = asyncio.run(
            workload((f"{api_url}/v1/completions", None), args.seconds, args.rate, seed, vocab)
        )
    return summarize(steady, long, duration, args)


def vllm_server(args, port: int, cores: str | None, gib: float, role: str, logs: Path) -> Server:
    """One vLLM server; `cores`: its worker's threads bound to these (None: as it starts)."""
    command = [str(Path(args.vllm_venv) / "bin" / "vllm"), "serve", args.model, "--port", str(port)]
    command += ["--served-model-name", SERVED_NAME, "--dtype", args.dtype, "--max-model-len", "4096"]
    env = {"VLLM_CPU_KVCACHE_SPACE": f"{gib:g}"} | ({"VLLM_CPU_OMP_THREADS_BIND": cores} if cores else {})
    if role:
        config = {"kv_connector": "NixlConnector", "kv_role": role, "kv_buffer_device": "cpu"}
        command += ["--kv-transfer-config", json.dumps(config)]
        env["VLLM_NIXL_SIDE_CHANNEL_PORT"] = str(free_ports(1)[0])
    return Server(f"vllm-{role or 'single'}", command, env, port, logs)


def run_vllm(system: str, args, seed: int, vocab: int) -> dict:
    cores = len(os.sched_getaffinity(0))
    with tempfile.TemporaryDirectory() as logs:
        if system == "vllm":
            port = free_ports(1)[0]
            servers = [vllm_server(args, port, f"0-{cores - 1}", args.kv_cache_gib, "", Path(logs))]
            urls: tuple[str, str | None] = (f"http://127.0.0.1:{port}/v1/completions", None)
        else:
            prefill_port, decode_port = free_ports(2)
            half = args.kv_cache_gib / 2
            split = system == "vllm-pd"  # each on half the cores; vllm-pd-auto: both as they start
            servers = [
                vllm_server(
                    args, prefill_port, f"0-{cores // 2 - 1}" if split else None, half, "kv_producer", Path(logs)
                ),
                vllm_server(
                    args, decode_port, f"{cores // 2}-{cores - 1}" if split else None, half, "kv_consumer", Path(logs)
                ),
            ]
            urls = (f"http://127.0.0.1:{decode_port}/v1/completions", f"http://127.0.0.1:{prefill_port}/v1/completions")
        try:
            for server in servers:
                server.wait_ready(900)
            steady, long, duration = asyncio.run(workload(urls, args.seconds, args.rate, seed, vocab))
        finally:
            for server in servers:
                server.stop()
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
    parser.add_argument("--vllm-venv", default=None, help="also vLLM's CPU build, one server and P/D (NixlConnector)")
    parser.add_argument("--systems", default="", help="a comma-separated subset (default: all)")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    systems = list(SYSTEMS) + (["vllm", "vllm-pd", "vllm-pd-auto"] if args.vllm_venv else [])
    systems = [s for s in systems if not args.systems or s in args.systems.split(",")]
    runs: dict[str, list[dict]] = {name: [] for name in systems}
    for repeat in range(args.repeats):
        for name in systems:
            result = run(name, args, seed=repeat)
            runs[name].append(result)
            print(
                f"repetition {repeat + 1}, {name}: " + ", ".join(f"{k} {v:.3g}" for k, v in result.items()), flush=True
            )
    ratios = {}
    for one_engine, split in (("single", "pd"), ("vllm", "vllm-pd"), ("vllm", "vllm-pd-auto")):
        if one_engine not in runs or split not in runs:
            continue
        print(f"\n| figure | {one_engine} | {split} | {split} over {one_engine} |\n| --- | --- | --- | --- |")
        for metric, better in METRICS:
            single, pd = [r[metric] for r in runs[one_engine]], [r[metric] for r in runs[split]]
            ratio = [p / s if s else float("nan") for p, s in zip(pd, single)]
            ratios[f"{split}/{metric}"] = ratio
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
