"""Multi-turn conversations against a device KV pool that holds about a quarter of their histories:
pagedserve with its host cache (`--kv-offloading-size`, written back as the device evicts blocks, and
written through as they are cached), without it, and vLLM's CPU build with prefix caching at the same
device budget (as it starts and with its worker on all cores).

Each user opens with a document and a question, then, after a think time, sends its whole history
again with an answer and a new question, turn after turn, so its prompt grows to 1-3k tokens. All
users run at once. Every system gets the same prompts (token ids, seeded) and the same number of
device blocks (`--num-gpu-blocks-override` on both). Output throughput is the tokens of every turn
over the wall time; TTFT is per turn, from the first turn on. Repetitions alternate the systems,
which stay up throughout, so a slow minute of the machine falls on all of them.

    python benchmarks/multiturn_bench.py --repeats 3 --vllm-venv /work/vllm-venv \\
        --out benchmarks/results/multiturn_bench.json
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
import urllib.request
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from benchmarks import peer_bench  # noqa: E402
from benchmarks.peer_report import spread  # noqa: E402
from benchmarks.provenance import commit, cpu_model  # noqa: E402
from benchmarks.serve_client import stream_completion  # noqa: E402

VOCAB = (4, 4000)  # token ids drawn from here: none of the tokenizer's special ids


def conversation(user: int, seed: int, turns: int, document: int, question: int, answer: int) -> list[list[int]]:
    """One user's prompts, turn by turn: each is the last one, an answer to it, and a new question."""
    rng = random.Random(seed * 1000 + user)

    def tokens(n: int) -> list[int]:
        return [rng.randrange(*VOCAB) for _ in range(n)]

    prompts = [tokens(document) + tokens(question)]
    for _ in range(turns - 1):
        prompts.append(prompts[-1] + tokens(answer) + tokens(question))
    return prompts


async def run_users(base_url: str, args, seed: int) -> dict:
    url = f"{base_url}/v1/completions"
    limits = httpx.Limits(max_connections=args.users + 4)
    async with httpx.AsyncClient(timeout=httpx.Timeout(600.0), limits=limits) as client:

        async def user(index: int) -> list[dict]:
            think = random.Random(seed * 7919 + index)
            turns = []
            prompts = conversation(index, seed, args.turns, args.document, args.question, args.answer)
            await asyncio.sleep(think.uniform(0, args.think))  # users do not all start in the same instant
            for turn, prompt in enumerate(prompts):
                done = await stream_completion(client, url, peer_bench.SERVED_NAME, prompt, args.max_tokens)
                turns.append({"turn": turn, "prompt": len(prompt), **done})
                await asyncio.sleep(think.expovariate(1 / args.think))
            return turns

        started = time.perf_counter()
        done = await asyncio.gather(*(user(i) for i in range(args.users)))
        wall = time.perf_counter() - started
    turns = [t for user_turns in done for t in user_turns]
    later = [t["ttft"] for t in turns if t["turn"] > 0]
    return {
        "median_ttft_ms": 1000 * statistics.median(t["ttft"] for t in turns),
        "median_ttft_later_turns_ms": 1000 * statistics.median(later),
        "output_throughput": sum(t["tokens"] for t in turns) / wall,
        "wall_s": wall,
        "turns": len(turns),
        "longest_prompt": max(t["prompt"] for t in turns),
    }


def scheduler_counters(port: int) -> dict[str, float]:
    """pagedserve's host-cache counters from its scheduler's /metrics (one port above the api's), and the time its
    worker spent on block transfers and whole forward passes (two above)."""
    wanted = (
        "pagedserve_blocks_offloaded_total",
        "pagedserve_prefix_cache_tier_hits_total",
        "pagedserve_prompt_tokens_computed_total",
        "pagedserve_preemptions_total",
        'pagedserve_step_phase_seconds_sum{phase="transfer"',
        'pagedserve_step_phase_seconds_sum{phase="forward"',
    )
    counters = {}
    for offset in (1, 2):
        with urllib.request.urlopen(f"http://127.0.0.1:{port + offset}/metrics", timeout=10) as response:
            text = response.read().decode()
        counters.update(
            {
                name: float(value)
                for name, value in (line.rsplit(" ", 1) for line in text.splitlines() if line.startswith(wanted))
            }
        )
    return counters


SYSTEMS = ("pagedserve+host", "pagedserve+host-write-through", "pagedserve", "vllm", "vllm-all-cores")


def command(args, name: str, port: int) -> tuple[list[str], dict[str, str]]:
    """The system's server on `port`, with prefix caching and the same number of device blocks."""
    shared = ["--num-gpu-blocks-override", str(args.device_blocks), "--enable-prefix-caching"]
    if name.startswith("pagedserve"):
        built, env = peer_bench.pagedserve_command(args, port)
        offload = args.offload_gib if name.startswith("pagedserve+host") else 0.0
        policy = "write-through" if name.endswith("write-through") else "write-back"
        return built + shared + [
            "--kv-offloading-size",
            f"{offload:g}",
            "--kv-offloading-policy",
            policy,
            "--worker-metrics-port",
            str(port + 2),
        ], env
    build = peer_bench.vllm_all_cores_command if name == "vllm-all-cores" else peer_bench.vllm_command
    built, env = build(args, port)
    return built + shared, env


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    peer_bench.add_system_args(parser)
    parser.set_defaults(
        model=str(ROOT / "ops" / "configs" / "tiny-python-4k"),
        load_format="dummy",
        block_size=32,
        max_num_seqs=8,
        max_num_batched_tokens=2048,
        repeats=3,
    )
    parser.add_argument("--users", type=int, default=32)
    parser.add_argument("--turns", type=int, default=6)
    parser.add_argument("--document", type=int, default=700, help="tokens of each user's opening document")
    parser.add_argument("--question", type=int, default=120, help="tokens of each question")
    parser.add_argument("--answer", type=int, default=100, help="tokens of each answer sent back in the history")
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--think", type=float, default=1.0, help="mean seconds between a user's turns")
    parser.add_argument(
        "--device-blocks",
        type=int,
        default=0,
        help="device KV blocks on every system (0: a quarter of the users' final histories)",
    )
    parser.add_argument("--offload-gib", type=float, default=1.0, help="pagedserve's --kv-offloading-size")
    parser.add_argument(
        "--systems", default=",".join(SYSTEMS), help="which of them to run, comma-separated (vLLM's need --vllm-venv)"
    )
    parser.add_argument("--port", type=int, default=8400)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    peer_bench.settle_system_args(parser, args)
    final = args.document + args.question + (args.turns - 1) * (args.answer + args.question) + args.max_tokens
    working_set = args.users * -(-final // args.block_size)
    args.device_blocks = args.device_blocks or working_set // 4
    print(f"working set {working_set} blocks of {args.block_size} tokens; device pool {args.device_blocks}", flush=True)

    chosen = args.systems.split(",")
    if unknown := set(chosen) - set(SYSTEMS):
        parser.error(f"--systems: unknown {sorted(unknown)}; choose among {', '.join(SYSTEMS)}")
    systems = [name for name in SYSTEMS if name in chosen and (args.vllm_venv or name.startswith("pagedserve"))]
    ports = {name: args.port + 20 * i for i, name in enumerate(systems)}
    runs: dict[str, list[dict]] = {name: [] for name in systems}
    servers = []
    with tempfile.TemporaryDirectory(prefix="multiturn-") as scratch:
        try:
            for name in systems:
                server = peer_bench.Server(name, *command(args, name, ports[name]), ports[name], Path(scratch))
                servers.append(server)
                server.wait_ready()
            for repeat in range(args.repeats):
                for name in systems:
                    before = scheduler_counters(ports[name]) if name.startswith("pagedserve") else {}
                    result = asyncio.run(run_users(f"http://127.0.0.1:{ports[name]}", args, seed=repeat))
                    if before:
                        after = scheduler_counters(ports[name])
                        result["counters"] = {key: after[key] - before.get(key, 0.0) for key in after}
                    runs[name].append(result)
                    print(
                        f"repetition {repeat + 1} {name}: median TTFT {result['median_ttft_ms']:.0f} ms "
                        f"(later turns {result['median_ttft_later_turns_ms']:.0f}), "
                        f"{result['output_throughput']:.1f} tok/s, longest prompt {result['longest_prompt']}",
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
        "working_set_blocks": working_set,
        "runs": runs,
    }
    print_summary(record)
    if args.out:
        args.out.write_text(json.dumps(record, indent=1) + "\n")


def print_summary(record: dict) -> None:
    runs = record["runs"]
    print(f"\n{record['cpu']}, {record['date']}, {record['commit']}; median (range) over repetitions")
    for name, results in runs.items():
        print(
            f"{name:>16}: TTFT {spread([r['median_ttft_ms'] for r in results], 0)} ms, "
            f"later turns {spread([r['median_ttft_later_turns_ms'] for r in results], 0)} ms, "
            f"{spread([r['output_throughput'] for r in results])} tok/s"
        )
    for name, results in runs.items():
        counters = [r["counters"] for r in results if r.get("counters")]
        if counters:
            share = [
                c.get('pagedserve_step_phase_seconds_sum{phase="transfer",rank="0"}', 0.0)
                / max(c.get('pagedserve_step_phase_seconds_sum{phase="forward",rank="0"}', 0.0), 1e-9)
                for c in counters
            ]
            print(f"{name:>16}: block transfers {spread([100 * x for x in share], 2)}% of the worker's step time")

    def ratios(a_name: str, b_name: str) -> None:
        if a_name in runs and b_name in runs:
            a_runs, b_runs = runs[a_name], runs[b_name]
            print(
                f"{a_name} / {b_name}: TTFT "
                + spread([a["median_ttft_ms"] / b["median_ttft_ms"] for a, b in zip(a_runs, b_runs)], 2)
                + ", throughput "
                + spread([a["output_throughput"] / b["output_throughput"] for a, b in zip(a_runs, b_runs)], 2)
            )

    ratios("pagedserve+host", "pagedserve")
    ratios("pagedserve+host-write-through", "pagedserve+host")
    if "pagedserve+host" not in runs:
        return
    host = runs["pagedserve+host"]
    peers = [name for name in ("vllm", "vllm-all-cores") if name in runs]
    if peers:
        best = [min((runs[p][i] for p in peers), key=lambda r: r["median_ttft_ms"]) for i in range(len(host))]
        print(
            "host cache / vLLM at its best: TTFT "
            + spread([a["median_ttft_ms"] / b["median_ttft_ms"] for a, b in zip(host, best)], 2)
            + ", throughput "
            + spread([a["output_throughput"] / b["output_throughput"] for a, b in zip(host, best)], 2)
        )


if __name__ == "__main__":
    main()
