"""A serving benchmark client for OpenAI-compatible streaming completions.

Random token-id prompts of fixed lengths, `ignore_eos`, arrivals either all at once or Poisson at
a request rate, optionally capped at a number in flight. It reports the figures `vllm bench serve`
reports, under the same JSON keys, so `peer_bench.py` reads either client's results alike.

    python benchmarks/serve_client.py --base-url http://127.0.0.1:8000 --model tiny-python \
        --input-len 128 --output-len 128 --num-prompts 200 --max-concurrency 64
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


@dataclass(slots=True)
class Outcome:
    ok: bool
    ttft: float = 0.0
    latency: float = 0.0
    output_tokens: int = 0
    token_times: list[float] = field(default_factory=list)


async def _one(client: httpx.AsyncClient, url: str, payload: dict) -> Outcome:
    started = time.perf_counter()
    outcome = Outcome(ok=False)
    async with client.stream("POST", url, json=payload) as response:
        if response.status_code != 200:
            await response.aread()
            return outcome
        async for line in response.aiter_lines():
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


async def run(base_url: str, model: str, input_len: int, output_len: int, num_prompts: int,
              request_rate: float = float("inf"), max_concurrency: int | None = None, seed: int = 0,
              vocab_size: int = 4096) -> dict:
    rng = random.Random(seed)
    prompts = [[rng.randrange(1, vocab_size) for _ in range(input_len)] for _ in range(num_prompts)]
    url = base_url.rstrip("/") + "/v1/completions"
    limit = asyncio.Semaphore(max_concurrency or num_prompts)
    limits = httpx.Limits(max_connections=max_concurrency or num_prompts)

    async with httpx.AsyncClient(timeout=None, limits=limits) as client:
        async def limited(prompt):
            async with limit:
                payload = {"model": model, "prompt": prompt, "max_tokens": output_len, "stream": True,
                           "ignore_eos": True, "stream_options": {"include_usage": True}}
                return await _one(client, url, payload)

        started = time.perf_counter()
        tasks = []
        for prompt in prompts:
            tasks.append(asyncio.create_task(limited(prompt)))
            if request_rate != float("inf"):
                await asyncio.sleep(rng.expovariate(request_rate))
        outcomes = await asyncio.gather(*tasks)
        duration = time.perf_counter() - started
    return summarize(outcomes, duration)


def summarize(outcomes: list[Outcome], duration: float) -> dict:
    done = [o for o in outcomes if o.ok]
    tpots = [(o.latency - o.ttft) / (o.output_tokens - 1) for o in done if o.output_tokens > 1]
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
        "mean_e2el_ms": ms([o.latency for o in done], statistics.mean),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--base-url", required=True)
    parser.add_argument("--model", required=True)
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--num-prompts", type=int, default=200)
    parser.add_argument("--request-rate", type=float, default=float("inf"))
    parser.add_argument("--max-concurrency", type=int, default=None)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    result = asyncio.run(run(args.base_url, args.model, args.input_len, args.output_len, args.num_prompts,
                             args.request_rate, args.max_concurrency, args.seed))
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
