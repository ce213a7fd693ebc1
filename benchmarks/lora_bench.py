"""Multi-LoRA serving: requests spread round-robin over 4 and over 16 adapters of the same base model,
on pagedserve and on vLLM's CPU build with the same adapters, and pagedserve serving the base model
alone for scale.

The adapters are random PEFT adapters made here (ranks 8 and 16 in turn, on q/k/v/o and the MLP's
three projections). Every system gets the same prompts (token ids, seeded) at the same concurrency;
output throughput is every request's tokens over the wall time. Repetitions alternate the systems,
which stay up throughout, so a slow minute of the machine falls on all of them.

    python benchmarks/lora_bench.py --repeats 3 --vllm-venv /work/vllm-venv \\
        --out benchmarks/results/lora_bench.json
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
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from benchmarks import peer_bench  # noqa: E402
from benchmarks.peer_report import spread  # noqa: E402
from benchmarks.provenance import commit, cpu_model  # noqa: E402
from benchmarks.serve_client import stream_completion  # noqa: E402

VOCAB = (4, 4000)
TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
SYSTEMS = ("pagedserve-base", "pagedserve", "vllm", "vllm-all-cores")


def make_adapters(model_dir: str, folder: Path, count: int, ranks: list[int]) -> list[tuple[str, str]]:
    """`count` random adapters of the model (ranks taken in turn from `ranks`), as (name, directory)."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(model_dir)
    torch.manual_seed(0)
    base = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    made = []
    for index in range(count):
        rank = ranks[index % len(ranks)]
        model = get_peft_model(
            base,
            LoraConfig(
                r=rank,
                lora_alpha=2 * rank,
                target_modules=list(TARGETS),
                init_lora_weights=False,
                task_type="CAUSAL_LM",
            ),
        )
        path = folder / f"adapter-{index}"
        model.save_pretrained(str(path))
        base = model.unload()
        made.append((f"adapter-{index}", str(path)))
    return made


def command(args, name: str, port: int, adapters: list[tuple[str, str]]) -> tuple[list[str], dict[str, str]]:
    modules = [f"{adapter}={path}" for adapter, path in adapters]
    lora = [
        "--enable-lora",
        "--max-loras",
        str(len(adapters)),
        "--max-lora-rank",
        str(max(args.ranks)),
        "--max-cpu-loras",
        str(len(adapters)),
        "--lora-modules",
        *modules,
    ]
    if name.startswith("pagedserve"):
        built, env = peer_bench.pagedserve_command(args, port)
        return built + ([] if name == "pagedserve-base" else lora), env
    build = peer_bench.vllm_all_cores_command if name == "vllm-all-cores" else peer_bench.vllm_command
    built, env = build(args, port)
    return built + lora, env


async def run_requests(base_url: str, args, models: list[str], seed: int) -> dict:
    rng = random.Random(seed)
    prompts = [[rng.randrange(*VOCAB) for _ in range(args.input_len)] for _ in range(args.requests)]
    gate = asyncio.Semaphore(args.concurrency)
    limits = httpx.Limits(max_connections=args.concurrency + 4)
    async with httpx.AsyncClient(timeout=httpx.Timeout(600.0), limits=limits) as client:

        async def one(index: int) -> dict:
            async with gate:
                return await stream_completion(
                    client, f"{base_url}/v1/completions", models[index % len(models)], prompts[index], args.output_len
                )

        started = time.perf_counter()
        done = await asyncio.gather(*(one(i) for i in range(args.requests)))
        wall = time.perf_counter() - started
    return {
        "output_throughput": sum(r["tokens"] for r in done) / wall,
        "median_ttft_ms": 1000 * statistics.median(r["ttft"] for r in done),
        "wall_s": wall,
        "requests": len(done),
    }


async def warm_up(base_url: str, models: list[str]) -> None:
    """One short request per model, so that every adapter is loaded before the timed runs (on each system
    alike): the figures are of serving, not of reading adapters from disk the first time."""
    async with httpx.AsyncClient(timeout=httpx.Timeout(600.0)) as client:
        for model in models:
            await stream_completion(client, f"{base_url}/v1/completions", model, list(range(10, 18)), 1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    peer_bench.add_system_args(parser)
    parser.set_defaults(
        model=str(ROOT / "ops" / "configs" / "llama-12l-768"),
        load_format="dummy",
        block_size=32,
        max_num_seqs=64,
        repeats=3,
    )
    parser.add_argument("--adapter-counts", default="4,16", help="adapters the requests are spread over, per scenario")
    parser.add_argument("--ranks", default="8,16", help="ranks of the adapters, in turn")
    parser.add_argument("--requests", type=int, default=48)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--input-len", type=int, default=256)
    parser.add_argument("--output-len", type=int, default=96)
    parser.add_argument(
        "--systems", default=",".join(SYSTEMS), help="which of them to run, comma-separated (vLLM's need --vllm-venv)"
    )
    parser.add_argument("--port", type=int, default=8500)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    peer_bench.settle_system_args(parser, args)
    args.ranks = [int(r) for r in args.ranks.split(",")]
    counts = [int(c) for c in args.adapter_counts.split(",")]
    chosen = args.systems.split(",")
    if unknown := set(chosen) - set(SYSTEMS):
        parser.error(f"--systems: unknown {sorted(unknown)}; choose among {', '.join(SYSTEMS)}")
    systems = [name for name in SYSTEMS if name in chosen and (args.vllm_venv or name.startswith("pagedserve"))]
    ports = {name: args.port + 20 * i for i, name in enumerate(systems)}
    runs: dict[str, list[dict]] = {}
    servers = []
    with tempfile.TemporaryDirectory(prefix="lora-bench-") as scratch:
        adapters = make_adapters(args.model, Path(scratch), max(counts), args.ranks)
        try:
            for name in systems:
                server = peer_bench.Server(
                    name, *command(args, name, ports[name], adapters), ports[name], Path(scratch)
                )
                servers.append(server)
                server.wait_ready()
                models = [peer_bench.SERVED_NAME] if name == "pagedserve-base" else [a for a, _ in adapters]
                asyncio.run(warm_up(f"http://127.0.0.1:{ports[name]}", models))
            for repeat in range(args.repeats):
                for count in counts:
                    names = [adapter for adapter, _ in adapters[:count]]
                    for name in systems:
                        label = name if name == "pagedserve-base" else f"{name}/{count}"
                        if name == "pagedserve-base" and count != counts[0]:
                            continue  # the base model alone: once per repetition
                        models = [peer_bench.SERVED_NAME] if name == "pagedserve-base" else names
                        result = asyncio.run(run_requests(f"http://127.0.0.1:{ports[name]}", args, models, seed=repeat))
                        runs.setdefault(label, []).append(result)
                        print(
                            f"repetition {repeat + 1} {label}: {result['output_throughput']:.1f} tok/s, "
                            f"median TTFT {result['median_ttft_ms']:.0f} ms",
                            flush=True,
                        )
        finally:
            for server in servers:
                server.stop()
    record = {
        "cpu": cpu_model(),
        "commit": commit(),
        "date": time.strftime("%Y-%m-%d"),
        "settings": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "runs": runs,
    }
    print_summary(record, counts)
    if args.out:
        args.out.write_text(json.dumps(record, indent=1) + "\n")


def print_summary(record: dict, counts: list[int]) -> None:
    runs = record["runs"]
    print(f"\n{record['cpu']}, {record['date']}, {record['commit']}; median (range) over repetitions")
    for label, results in runs.items():
        print(
            f"{label:>20}: {spread([r['output_throughput'] for r in results])} tok/s, "
            f"TTFT {spread([r['median_ttft_ms'] for r in results], 0)} ms"
        )
    for count in counts:
        ours = runs.get(f"pagedserve/{count}")
        if ours is None:
            continue
        peers = [runs[f"{p}/{count}"] for p in ("vllm", "vllm-all-cores") if f"{p}/{count}" in runs]
        if peers:
            best = [max(p[i]["output_throughput"] for p in peers) for i in range(len(ours))]
            print(
                f"{count} adapters, pagedserve / vLLM at its best: throughput "
                + spread([o["output_throughput"] / b for o, b in zip(ours, best)], 2)
            )
        if "pagedserve-base" in runs:
            base = runs["pagedserve-base"]
            print(
                f"{count} adapters / the base model alone (pagedserve): throughput "
                + spread([o["output_throughput"] / b["output_throughput"] for o, b in zip(ours, base)], 2)
            )


if __name__ == "__main__":
    main()
