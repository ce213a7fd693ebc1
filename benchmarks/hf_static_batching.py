"""Throughput against HF transformers' `generate` with static batching, on the same requests and model.

The same seeded ShareGPT-like trace goes to pagedserve (every request at once, continuous batching)
and to `generate` in fixed batches of `--batch-size` in arrival order: each batch is padded to its
longest prompt and runs until its longest output is done, as static batching must. Both count the
useful tokens (each request's own output length; a padded batch that reaches the context stops
short) over their wall time; both run the model in
float32 on the CPU with the same torch thread count. Prints both and the ratio, writes
benchmarks/results/hf_static_batching.json.

    python benchmarks/hf_static_batching.py --num-prompts 64 --batch-size 16
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.paper_harness import ROOT, machine, pagedserve, run_at_rate, write_json  # noqa: E402
from benchmarks.provenance import commit  # noqa: E402
from benchmarks.workloads import WORKLOADS, Job, describe  # noqa: E402
from services.launcher import SHIPPED_MODEL  # noqa: E402


def hf_generate(
    model_dir: str, jobs: list[Job], batch_size: int, threads: int, max_model_len: int
) -> tuple[float, int]:
    """Seconds for `generate` to produce every job's output in static batches, and the useful tokens
    it produced: a batch padded past the context stops there, short of its longest outputs."""
    import torch
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(threads)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    pad = model.generation_config.pad_token_id or 0
    started, useful = time.perf_counter(), 0
    for first in range(0, len(jobs), batch_size):
        batch = jobs[first : first + batch_size]
        width = max(len(j.prompt) for j in batch)
        ids = torch.tensor([[pad] * (width - len(j.prompt)) + j.prompt for j in batch])
        mask = torch.tensor([[0] * (width - len(j.prompt)) + [1] * len(j.prompt) for j in batch])
        longest = min(max(j.output_len for j in batch), max_model_len - width)
        useful += sum(min(j.output_len, longest) for j in batch)
        with torch.no_grad():
            model.generate(
                input_ids=ids,
                attention_mask=mask,
                max_new_tokens=longest,
                min_new_tokens=longest,
                do_sample=False,
                pad_token_id=pad,
            )
    return time.perf_counter() - started, useful


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workload", choices=["sharegpt", "alpaca"], default="sharegpt")
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--max-model-len", type=int, default=1024)
    parser.add_argument(
        "--threads",
        type=int,
        default=max(1, (os.cpu_count() or 2) - 1),
        help="torch threads for generate; pagedserve's CPU worker takes cores - 1 by default",
    )
    parser.add_argument("--model", default=SHIPPED_MODEL)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out-dir", default=str(ROOT / "benchmarks" / "results"))
    args = parser.parse_args()
    jobs = WORKLOADS[args.workload](args.num_prompts + 2, seed=args.seed, max_model_len=args.max_model_len)
    useful = sum(j.output_len for j in jobs[2:])
    flags = ["--max-model-len", str(args.max_model_len), "--dtype", "float32", "--cpu-threads", str(args.threads)]
    with pagedserve(*flags, model=args.model) as (api, metrics):
        served = run_at_rate(api, metrics, jobs, float("inf"), seed=args.seed)
    seconds, hf_useful = hf_generate(args.model, jobs[2:], args.batch_size, args.threads, args.max_model_len)
    ours, theirs = served["output_throughput"], hf_useful / seconds
    print(f"pagedserve (continuous batching): {ours:8.1f} output tok/s  ({served['duration']:.1f} s)")
    print(f"HF generate (static, batch {args.batch_size}): {theirs:8.1f} output tok/s  ({seconds:.1f} s)")
    print(f"pagedserve / HF generate: {ours / theirs:.2f}x")
    write_json(
        Path(args.out_dir) / "hf_static_batching.json",
        {
            "workload": args.workload,
            "trace": describe(jobs[2:]),
            "args": vars(args),
            "commit": commit(),
            **machine(),
            "pagedserve_output_tok_s": ours,
            "hf_generate_output_tok_s": theirs,
            "ratio": ours / theirs,
            "pagedserve": served,
            "hf_generate_seconds": seconds,
            "useful_tokens": useful,
            "hf_generate_useful_tokens": hf_useful,
        },
    )


if __name__ == "__main__":
    main()
