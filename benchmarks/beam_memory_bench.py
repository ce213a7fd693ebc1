"""Scheduler memory held by one width-16 beam search request, by output length.

Runs the real scheduler against a stand-in worker that reports 32 candidates per beam with
varied log-probabilities, so beams fork and are pruned at every step as in a real search.
tracemalloc counts the bytes allocated in the scheduler's own modules that are still alive;
the figure is the largest count over the run. Linear growth in the output length is the
target: each live beam owns its tokens, pruned beams are dropped. Prints a table and writes
benchmarks/results/beam_memory_bench.json.
"""

from __future__ import annotations

import json
import os
import platform
import sys
import time
import tracemalloc

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from services.scheduler.kv_cache_manager import KVCacheManager  # noqa: E402
from services.scheduler.scheduler import Budgets, Scheduler  # noqa: E402
from shared.protocol import AddRequest, SampledTokens, StepResult  # noqa: E402
from shared.sampling import SamplingParams  # noqa: E402

WIDTH = 16
LENGTHS = [int(x) for x in os.environ.get("PAGEDSERVE_BENCH_LENGTHS", "250,500,1000").split(",")]
SNAPSHOT_EVERY = 25
WATCHED = [tracemalloc.Filter(True, "*services/scheduler/*"), tracemalloc.Filter(True, "*shared/*")]


def _candidates(seq_id: int, position: int) -> tuple[list[int], list[float]]:
    ids = [(seq_id * 7919 + position * 104729 + i * 13) % 30000 + 10 for i in range(2 * WIDTH)]
    logprobs = [-0.05 * (i + 1) - ((seq_id * 31 + position * 17 + i) % 11) * 0.01 for i in range(2 * WIDTH)]
    order = sorted(range(len(ids)), key=lambda i: -logprobs[i])
    return [ids[i] for i in order], [logprobs[i] for i in order]


def run(length: int) -> dict:
    context = length + 64
    blocks = WIDTH * (context // 16 + 2) + 64
    scheduler = Scheduler(KVCacheManager(blocks, 16), Budgets(WIDTH, 4096, context), eos_token_ids=[0])
    params = SamplingParams(
        n=1,
        best_of=WIDTH,
        use_beam_search=True,
        temperature=0.0,
        max_tokens=length,
        ignore_eos=True,
        early_stopping="never",
        length_penalty=0.0,
    )
    tracemalloc.start()
    scheduler.add(AddRequest("beam", list(range(10, 42)), params, time.time()))
    tokens: dict[int, int] = {}
    peak, steps = 0, 0
    while scheduler.has_work():
        step = scheduler.schedule()
        for new in step.new_sequences:
            tokens[new.seq_id] = len(new.token_ids)
        for fork in step.forks:
            tokens[fork.seq_id] = tokens[fork.parent_seq_id]
        sampled = []
        for entry in step.scheduled:
            tokens[entry.seq_id] = tokens.get(entry.seq_id, 0) + len(entry.appended_token_ids)
            ids, logprobs = _candidates(entry.seq_id, tokens[entry.seq_id])
            sampled.append(SampledTokens(entry.seq_id, [ids[0]], [logprobs[0]], [ids], [logprobs]))
        scheduler.update(StepResult(step.step_id, sampled, 0.0, 0.0))
        steps += 1
        if steps % SNAPSHOT_EVERY == 0:
            stats = tracemalloc.take_snapshot().filter_traces(WATCHED).statistics("filename")
            peak = max(peak, sum(s.size for s in stats))
    tracemalloc.stop()
    return {"output_tokens": length, "steps": steps, "scheduler_mib": peak / 2**20}


def main() -> None:
    rows = [run(length) for length in LENGTHS]
    print(f"one beam search request, width {WIDTH}: scheduler memory (tracemalloc, largest over the run)")
    print(f"{'output tokens':>14} {'steps':>6} {'MiB':>8} {'MiB per 1k tokens':>18}")
    for row in rows:
        per_k = row["scheduler_mib"] / row["output_tokens"] * 1000
        print(f"{row['output_tokens']:>14} {row['steps']:>6} {row['scheduler_mib']:>8.2f} {per_k:>18.2f}")
    out_dir = os.environ.get("PAGEDSERVE_BENCH_OUT", os.path.join(os.path.dirname(__file__), "results"))
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "beam_memory_bench.json"), "w") as f:
        json.dump(
            {
                "width": WIDTH,
                "rows": rows,
                "machine": platform.platform(),
                "python": platform.python_version(),
                "date": time.strftime("%Y-%m-%d"),
            },
            f,
            indent=2,
        )


if __name__ == "__main__":
    main()
