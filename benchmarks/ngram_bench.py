"""What the n-gram proposer costs the worker: microseconds per sequence per step, for a batch of
sequences that each gain one to k+1 tokens a step, as they do while speculating.

Sequences start from prompts cut from Python sources (this repository's), so their n-grams recur
as code's do. Each step extends every sequence by what a verification might keep, then asks for
proposals; the first step, which indexes whole prompts, is reported apart.

    python benchmarks/ngram_bench.py --sequences 256 --steps 200
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from services.worker.ngram import NgramProposer  # noqa: E402


def source_tokens(rng: random.Random, length: int, files: list[Path]) -> list[int]:
    """A window of a source file as byte values: enough of code's repetition for the lookup."""
    data = rng.choice(files).read_bytes()
    start = rng.randrange(0, max(1, len(data) - length))
    return list(data[start : start + length]) or [0]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sequences", type=int, default=256)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--prompt-len", type=int, default=512)
    parser.add_argument("-k", type=int, default=4, help="num_speculative_tokens")
    parser.add_argument("--min-n", type=int, default=2)
    parser.add_argument("--max-n", type=int, default=4)
    parser.add_argument("--out", default=None, help="write the figures as JSON here")
    args = parser.parse_args()
    rng = random.Random(0)
    files = sorted((ROOT / "services").rglob("*.py")) + sorted((ROOT / "shared").glob("*.py"))
    proposer = NgramProposer(args.min_n, args.max_n)
    seqs = [source_tokens(rng, args.prompt_len, files) for _ in range(args.sequences)]
    indexes = [proposer.new_index() for _ in seqs]
    started = time.perf_counter()
    for tokens, index in zip(seqs, indexes):
        proposer.propose(tokens, index, args.k)
    first = (time.perf_counter() - started) / len(seqs) * 1e6
    per_step = []
    proposed = 0
    for _ in range(args.steps):
        for tokens in seqs:  # what a verification kept: the accepted proposals and one more token
            tokens += [rng.randrange(32, 127) for _ in range(rng.randint(1, args.k + 1))]
        started = time.perf_counter()
        for tokens, index in zip(seqs, indexes):
            proposed += len(proposer.propose(tokens, index, args.k))
        per_step.append((time.perf_counter() - started) / len(seqs) * 1e6)
    result = {
        "sequences": args.sequences,
        "steps": args.steps,
        "prompt_len": args.prompt_len,
        "k": args.k,
        "prompt_lookup": [args.min_n, args.max_n],
        "first_call_us_per_sequence": round(first, 1),
        "us_per_sequence_per_step": {
            "median": round(statistics.median(per_step), 2),
            "p99": round(sorted(per_step)[int(0.99 * len(per_step))], 2),
            "max": round(max(per_step), 2),
        },
        "proposals_per_call": round(proposed / (args.steps * args.sequences), 2),
    }
    print(
        f"{args.sequences} sequences, prompts of {args.prompt_len} tokens, k={args.k}, "
        f"n in [{args.min_n}, {args.max_n}]"
    )
    print(f"first call (indexes the prompt): {first:.1f} us per sequence")
    print(
        f"later steps: median {result['us_per_sequence_per_step']['median']} us, p99 "
        f"{result['us_per_sequence_per_step']['p99']} us per sequence per step "
        f"({result['proposals_per_call']} tokens proposed per call)"
    )
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
