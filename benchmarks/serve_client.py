"""A serving benchmark client for OpenAI-compatible streaming completions.

Requests come from a workload (`benchmarks/workloads.py`: fixed lengths, ShareGPT-like,
Alpaca-like, a shared prefix, parallel samples or beams), all with `ignore_eos` so each runs to its
true output length. Arrivals are all at once or Poisson at a request rate, optionally capped at a
number in flight, after a few warm-up requests; everything is seeded. It reports the figures `vllm
bench serve` reports, under the same JSON keys (so `peer_bench.py` reads either client's results
alike), and the paper's normalized latency: end-to-end latency over output length, averaged over
requests.

    python benchmarks/serve_client.py --base-url http://127.0.0.1:8000 --model tiny-python \
        --workload sharegpt --num-prompts 200 --request-rate 4 --out result.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import time
from dataclasses import dataclass, field

import httpx

if __package__ in (None, ""):
    import os
    import sys

    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks.workloads import WORKLOADS, Job, fixed  # noqa: E402


@dataclass(slots=True)
class Outcome:
    ok: bool
    ttft: float = 0.0
    latency: float = 0.0
    output_tokens: int = 0
    token_times: list[float] = field(default_factory=list)


async def _event_stream_lines(response: httpx.Response):
    """An event stream's lines, broken at LF (and CRLF) only, as SSE breaks them: httpx's aiter_lines
    also breaks at U+2028 and the like, which a server may send unescaped inside JSON text."""
    pending = ""
    async for text in response.aiter_text():
        *lines, pending = (pending + text).split("\n")
        for line in lines:
            yield line.removesuffix("\r")
    if pending:
        yield pending


async def stream_completion(
    client: httpx.AsyncClient, url: str, model: str, prompt: list[int], max_tokens: int
) -> dict:
    """One greedy streamed completion of `max_tokens` (`ignore_eos`): its time to the first text and its
    output tokens. A status other than 200 raises, so that a benchmark never counts a refusal."""
    body = {
        "model": model,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    started = time.perf_counter()
    ttft, tokens = None, 0
    async with client.stream("POST", url, json=body) as response:
        if response.status_code != 200:
            raise RuntimeError(f"{url}: {response.status_code} {(await response.aread())[:300]!r}")
        async for line in _event_stream_lines(response):
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if ttft is None and chunk.get("choices") and chunk["choices"][0].get("text"):
                ttft = time.perf_counter() - started
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
    return {"ttft": ttft if ttft is not None else time.perf_counter() - started, "tokens": tokens}


async def _one(client: httpx.AsyncClient, url: str, payload: dict) -> Outcome:
    started = time.perf_counter()
    outcome = Outcome(ok=False)
    async with client.stream("POST", url, json=payload) as response:
        if response.status_code != 200:
            await response.aread()
            return outcome
        async for line in _event_stream_lines(response):
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                outcome.output_tokens = chunk["usage"]["completion_tokens"]
            if chunk.get("choices") and chunk["choices"][0].get("text"):
                outcome.token_times.append(time.perf_counter() - started)
    outcome.latency = time.perf_counter() - started
    outcome.ttft = outcome.token_times[0] if outcome.token_times else outcome.latency
    outcome.ok = outcome.output_tokens > 0
    return outcome


async def run(
    base_url: str,
    model: str,
    input_len: int,
    output_len: int,
    num_prompts: int,
    request_rate: float = float("inf"),
    max_concurrency: int | None = None,
    seed: int = 0,
    vocab_size: int = 4096,
    params: dict | None = None,
) -> dict:
    jobs = fixed(num_prompts, input_len, output_len, seed=seed, vocab_size=vocab_size)
    for job in jobs:
        job.params.update(params or {})
    return await run_jobs(base_url, model, jobs, request_rate, max_concurrency, seed)


async def run_jobs(
    base_url: str,
    model: str,
    jobs: list[Job],
    request_rate: float = float("inf"),
    max_concurrency: int | None = None,
    seed: int = 0,
    warmup: int = 0,
) -> dict:
    """Send `jobs` and summarize; the first `warmup` of them run one at a time before, not counted."""
    rng = random.Random(seed)
    url = base_url.rstrip("/") + "/v1/completions"
    limit = asyncio.Semaphore(max_concurrency or max(1, len(jobs)))
    limits = httpx.Limits(max_connections=max_concurrency or max(1, len(jobs)))

    async with httpx.AsyncClient(timeout=None, limits=limits) as client:

        async def limited(job: Job) -> Outcome:
            async with limit:
                payload = {
                    "model": model,
                    "prompt": job.prompt,
                    "max_tokens": job.output_len,
                    "stream": True,
                    "ignore_eos": True,
                    "stream_options": {"include_usage": True},
                    **job.params,
                }
                return await _one(client, url, payload)

        for job in jobs[:warmup]:
            await limited(job)
        started = time.perf_counter()
        tasks = []
        for job in jobs[warmup:]:
            tasks.append(asyncio.create_task(limited(job)))
            if request_rate != float("inf"):
                await asyncio.sleep(rng.expovariate(request_rate))
        outcomes = await asyncio.gather(*tasks)
        duration = time.perf_counter() - started
    return summarize(outcomes, duration)


def summarize(outcomes: list[Outcome], duration: float) -> dict:
    done = [o for o in outcomes if o.ok]
    tpots = [(o.latency - o.ttft) / (o.output_tokens - 1) for o in done if o.output_tokens > 1]
    # The paper's normalized latency: each request's end-to-end latency per output token, averaged.
    normalized = [o.latency / o.output_tokens for o in done]
    itls = [b - a for o in done for a, b in zip(o.token_times, o.token_times[1:])]
    output = sum(o.output_tokens for o in done)

    def ms(values, how):
        return how(values) * 1e3 if values else 0.0

    def p99(values):
        return sorted(values)[min(len(values) - 1, int(len(values) * 0.99))]

    return {
        "completed": len(done),
        "failed": len(outcomes) - len(done),
        "duration": duration,
        "request_throughput": len(done) / duration,
        "output_throughput": output / duration,
        "mean_ttft_ms": ms([o.ttft for o in done], statistics.mean),
        "median_ttft_ms": ms([o.ttft for o in done], statistics.median),
        "p99_ttft_ms": ms([o.ttft for o in done], p99),
        "mean_tpot_ms": ms(tpots, statistics.mean),
        "median_tpot_ms": ms(tpots, statistics.median),
        "p99_tpot_ms": ms(tpots, p99),
        "mean_itl_ms": ms(itls, statistics.mean),
        "median_itl_ms": ms(itls, statistics.median),
        "p99_itl_ms": ms(itls, p99),
        "mean_e2el_ms": ms([o.latency for o in done], statistics.mean),
        "median_e2el_ms": ms([o.latency for o in done], statistics.median),
        "p99_e2el_ms": ms([o.latency for o in done], p99),
        "normalized_latency_s_per_token": statistics.mean(normalized) if normalized else 0.0,
        "total_output_tokens": output,
    }


def print_table(result: dict) -> None:
    rows = [
        ("requests completed / failed", f"{result['completed']} / {result['failed']}"),
        ("duration s", f"{result['duration']:.2f}"),
        ("request throughput req/s", f"{result['request_throughput']:.2f}"),
        ("output throughput tok/s", f"{result['output_throughput']:.1f}"),
        ("normalized latency s/token", f"{result['normalized_latency_s_per_token']:.4f}"),
    ]
    for metric in ("ttft", "tpot", "itl", "e2el"):
        rows.append(
            (
                f"{metric.upper()} ms mean / median / p99",
                " / ".join(f"{result.get(f'{how}_{metric}_ms', 0.0):.1f}" for how in ("mean", "median", "p99")),
            )
        )
    width = max(len(name) for name, _ in rows)
    for name, value in rows:
        print(f"{name:<{width}}  {value}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--base-url", required=True)
    parser.add_argument("--model", required=True)
    parser.add_argument("--workload", choices=sorted(WORKLOADS), default="fixed")
    parser.add_argument("--input-len", type=int, default=128, help="for --workload fixed")
    parser.add_argument("--output-len", type=int, default=128, help="for --workload fixed")
    parser.add_argument("--max-model-len", type=int, default=1024, help="the server's context: lengths are capped")
    parser.add_argument("--num-prompts", type=int, default=200)
    parser.add_argument("--request-rate", type=float, default=float("inf"))
    parser.add_argument("--max-concurrency", type=int, default=None)
    parser.add_argument("--warmup", type=int, default=2, help="requests sent one by one first, not counted")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=None, help="write the result as JSON here too")
    args = parser.parse_args()
    if args.workload == "fixed":
        jobs = fixed(args.num_prompts + args.warmup, args.input_len, args.output_len, seed=args.seed)
    else:
        jobs = WORKLOADS[args.workload](
            args.num_prompts + args.warmup, seed=args.seed, max_model_len=args.max_model_len
        )
    result = asyncio.run(
        run_jobs(
            args.base_url, args.model, jobs, args.request_rate, args.max_concurrency, args.seed, warmup=args.warmup
        )
    )
    print_table(result)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"args": vars(args), "result": result}, f, indent=2)


if __name__ == "__main__":
    main()
