"""Embeddings per second: pagedserve against vLLM's CPU build, both with `--runner pooling`, on the same model,
dtype and batches, the same client sending the same token ids to `/v1/embeddings`.

Every system is up at once and each workload runs on each in turn, repetition after repetition (A B C A B C),
so a drift of the machine's speed falls on all alike. Each workload and repetition has inputs of its own, so
vLLM's prefix cache (on as it starts) finds nothing. vLLM runs as it starts and with its worker on every core
(VLLM_CPU_OMP_THREADS_BIND); the better of the two per repetition is "vLLM at its best".

    python benchmarks/embed_bench.py --vllm-venv /work/vllm-venv --model /path/to/model --dtype bfloat16 \
        --repeats 3 --out benchmarks/results/embeddings/NAME.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import tempfile
import time
import zlib
from dataclasses import asdict, dataclass
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from benchmarks import peer_bench  # noqa: E402
from benchmarks.provenance import commit, cpu_model  # noqa: E402


@dataclass(frozen=True, slots=True)
class Workload:
    inputs: int  # texts embedded in all
    tokens: int  # each one's length
    batch: int  # inputs per request
    concurrency: int  # requests in flight


WORKLOADS = {
    # A retrieval index being built: many passages, sent in batches.
    "passages_b32": Workload(inputs=512, tokens=128, batch=32, concurrency=2),
    # Queries as they come: one short text a request, several clients.
    "queries_c8": Workload(inputs=256, tokens=32, batch=1, concurrency=8),
    # Long documents, a few at a time.
    "documents_b4": Workload(inputs=64, tokens=512, batch=4, concurrency=2),
}


def token_ids(workload: Workload, seed: int, vocab: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(16, vocab) for _ in range(workload.tokens)] for _ in range(workload.inputs)]


async def embed_all(port: int, inputs: list[list[int]], workload: Workload) -> dict[str, float]:
    url = f"http://127.0.0.1:{port}/v1/embeddings"
    batches = [inputs[i : i + workload.batch] for i in range(0, len(inputs), workload.batch)]
    limit = asyncio.Semaphore(workload.concurrency)
    latencies: list[float] = []
    async with httpx.AsyncClient(timeout=None) as client:

        async def one(batch: list[list[int]]) -> None:
            async with limit:
                started = time.perf_counter()
                response = await client.post(url, json={"model": peer_bench.SERVED_NAME, "input": batch})
                response.raise_for_status()
                if len(response.json()["data"]) != len(batch):
                    raise RuntimeError("an answer without every embedding")
                latencies.append(time.perf_counter() - started)

        started = time.perf_counter()
        await asyncio.gather(*(one(batch) for batch in batches))
        duration = time.perf_counter() - started
    return {
        "embeddings_per_s": len(inputs) / duration,
        "tokens_per_s": len(inputs) * workload.tokens / duration,
        "median_request_ms": statistics.median(latencies) * 1e3,
    }


def commands(args: argparse.Namespace) -> dict[str, tuple[list[str], dict[str, str]]]:
    ours, _ = peer_bench.pagedserve_command(args, args.port)
    found = {"pagedserve": (ours + ["--runner", "pooling"], {})}
    if args.vllm_venv:
        for name, build in (("vllm", peer_bench.vllm_command), ("vllm-all-cores", peer_bench.vllm_all_cores_command)):
            command, env = build(args, args.port + 20 * len(found))
            found[name] = (command + ["--runner", "pooling"], env)
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    peer_bench.add_system_args(parser)
    parser.add_argument("--workloads", default=",".join(WORKLOADS))
    parser.add_argument("--vocab", type=int, default=4096, help="token ids are drawn from [16, vocab)")
    parser.add_argument("--port", type=int, default=8700)
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "embeddings" / "embed_bench.json"))
    args = parser.parse_args()
    peer_bench.settle_system_args(parser, args)
    workloads = {name: WORKLOADS[name] for name in args.workloads.split(",")}
    systems = commands(args)
    ports = {name: args.port + 20 * i for i, name in enumerate(systems)}
    runs: dict[str, list[dict]] = {name: [{} for _ in range(args.repeats)] for name in systems}
    servers = []
    with tempfile.TemporaryDirectory(prefix="embed-bench-") as scratch:
        try:
            for name, (command, env) in systems.items():
                servers.append(peer_bench.Server(name, command, env, ports[name], Path(scratch)))
                servers[-1].wait_ready()
            warm = Workload(inputs=16, tokens=64, batch=4, concurrency=2)
            for name in systems:
                asyncio.run(embed_all(ports[name], token_ids(warm, 0, args.vocab), warm))
            for repeat in range(args.repeats):
                for workload_name, workload in workloads.items():
                    # Inputs of their own for each workload and repetition: none is in a prefix cache (on by
                    # default in vLLM) from another.
                    inputs = token_ids(
                        workload, 1000 * (repeat + 1) + zlib.crc32(workload_name.encode()) % 1000, args.vocab
                    )
                    for name in systems:
                        result = asyncio.run(embed_all(ports[name], inputs, workload))
                        runs[name][repeat][workload_name] = result
                        print(f"  {repeat + 1} {name} {workload_name}: {result['embeddings_per_s']:.1f} /s", flush=True)
        finally:
            for server in servers:
                server.stop()
    table = summarize(runs, workloads)
    for row in table:
        print(row)
    record = {
        "benchmark": "embed_bench",
        "model": args.model,
        "settings": {"dtype": args.dtype, "max_num_batched_tokens": args.max_num_batched_tokens},
        "workloads": {name: asdict(w) for name, w in workloads.items()},
        "cpu": cpu_model(),
        "date": time.strftime("%Y-%m-%d"),
        "commit": commit(),
        "runs": runs,
        "table": table,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(record, indent=1))
    print(f"wrote {args.out}")


def summarize(runs: dict[str, list[dict]], workloads: dict[str, Workload]) -> list[dict]:
    """Per workload: pagedserve's embeddings per second, vLLM's at its best (the better setting in each
    repetition), and the ratio per repetition, as median and range."""
    rows = []
    for name in workloads:
        ours = [run[name]["embeddings_per_s"] for run in runs["pagedserve"]]
        row: dict = {"workload": name, "pagedserve": _spread(ours)}
        peers = [runs[s] for s in ("vllm", "vllm-all-cores") if s in runs]
        if peers:
            best = [max(peer[i][name]["embeddings_per_s"] for peer in peers) for i in range(len(ours))]
            row["vllm_best"] = _spread(best)
            row["ratio"] = _spread([a / b for a, b in zip(ours, best)])
        rows.append(row)
    return rows


def _spread(values: list[float]) -> dict[str, float]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


if __name__ == "__main__":
    main()
