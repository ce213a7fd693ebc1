"""A warm restart: a long prompt sent to a server with `--kv-cache-dir`, the server stopped and started
again on the same folder, and the same prompt sent again. Reports the prompt tokens the second
request found cached and its time to first token against the first's (a single output token, so the
request's latency is its TTFT). Each repetition starts from an empty folder.

    python benchmarks/warm_restart_bench.py --repeats 3 --out benchmarks/results/warm_restart_bench.json
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from benchmarks import peer_bench  # noqa: E402
from benchmarks.peer_report import spread  # noqa: E402
from benchmarks.provenance import commit, cpu_model  # noqa: E402


def send(port: int, prompt: list[int]) -> tuple[float, int]:
    """Seconds to the (only) token, and the prompt tokens the server found cached."""
    body = {"model": peer_bench.SERVED_NAME, "prompt": prompt, "max_tokens": 1, "temperature": 0}
    started = time.perf_counter()
    response = httpx.post(f"http://127.0.0.1:{port}/v1/completions", json=body, timeout=600)
    elapsed = time.perf_counter() - started
    response.raise_for_status()
    details = response.json()["usage"].get("prompt_tokens_details") or {}
    return elapsed, details.get("cached_tokens", 0)


def one_run(args, seed: int, scratch: Path) -> dict:
    prompt = [random.Random(seed).randrange(4, 4000) for _ in range(args.prompt_tokens)]
    folder = scratch / f"kv-{seed}"
    command, env = peer_bench.pagedserve_command(args, args.port)
    command += ["--enable-prefix-caching", "--kv-cache-dir", str(folder)]
    timings = []
    for start in ("cold", "warm"):
        server = peer_bench.Server(f"pagedserve-{start}", command, env, args.port, scratch)
        try:
            server.wait_ready()
            send(args.port, [7] * 8)  # a first request of its own: start-up work off the clock
            timings.append(send(args.port, prompt))
        finally:
            server.stop()
    (cold, _), (warm, cached) = timings
    run = {
        "cold_ttft_ms": 1000 * cold,
        "warm_ttft_ms": 1000 * warm,
        "cached_tokens": cached,
        "cached_share": cached / len(prompt),
        "ttft_ratio": warm / cold,
    }
    print(
        f"run {seed + 1}: cold {run['cold_ttft_ms']:.0f} ms, warm {run['warm_ttft_ms']:.0f} ms "
        f"({run['ttft_ratio']:.2f}x), {cached} of {len(prompt)} prompt tokens cached",
        flush=True,
    )
    return run


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    peer_bench.add_system_args(parser)
    parser.set_defaults(
        model=str(ROOT / "ops" / "configs" / "llama-12l-768"),
        load_format="dummy",
        block_size=16,
        max_num_batched_tokens=2048,
        max_num_seqs=8,
        repeats=3,
    )
    # The longest prompt that leaves the 12-layer model's 2,048 positions room for one output token.
    parser.add_argument("--prompt-tokens", type=int, default=2047)
    parser.add_argument("--port", type=int, default=8600)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    peer_bench.settle_system_args(parser, args)
    with tempfile.TemporaryDirectory(prefix="warm-restart-") as scratch:
        runs = [one_run(args, seed, Path(scratch)) for seed in range(args.repeats)]
    record = {
        "cpu": cpu_model(),
        "commit": commit(),
        "date": time.strftime("%Y-%m-%d"),
        "settings": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "runs": runs,
    }
    cold, warm = spread([r["cold_ttft_ms"] for r in runs], 0), spread([r["warm_ttft_ms"] for r in runs], 0)
    print(
        f"\n{record['cpu']}, {record['date']}, {record['commit']}: warm / cold TTFT "
        f"{spread([r['ttft_ratio'] for r in runs], 2)}, cached share {spread([r['cached_share'] for r in runs], 3)}, "
        f"cold {cold} ms, warm {warm} ms"
    )
    if args.out:
        args.out.write_text(json.dumps(record, indent=1) + "\n")


if __name__ == "__main__":
    main()
