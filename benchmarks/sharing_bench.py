"""KV blocks saved by sharing, on a synthetic trace with Alpaca-like lengths.

Runs the real scheduler and block manager against a stand-in worker (no model): it returns
random tokens for sampling and random top-2k log-probabilities for beam search. Prompt and
output lengths are drawn from log-normal distributions with the Alpaca means the PagedAttention
paper reports (input 19.31, output 58.45 tokens). At every step it counts, over the running
requests, the logical blocks (what each sequence would hold alone) and the physical blocks
(distinct blocks actually held); the saving is 1 - physical / logical over the whole run, as in
the paper's Figure 15. Prints a table and writes benchmarks/results/sharing_bench.json and
docs/fig15_sharing.png.
"""

from __future__ import annotations

import json
import math
import os
import platform
import random
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from services.scheduler.kv_cache_manager import KVCacheManager  # noqa: E402
from services.scheduler.scheduler import Budgets, Scheduler  # noqa: E402
from shared.protocol import AddRequest, SampledTokens, StepResult  # noqa: E402
from shared.sampling import SamplingParams  # noqa: E402

MEAN_INPUT, MEAN_OUTPUT = 19.31, 58.45
NUM_REQUESTS = 400
BLOCK_SIZE = 16
VOCAB = 32000
EOS = 2


SIGMA = 0.8  # spread of the log-normal lengths; savings depend on it (see --sigma)


def lognormal_length(rng: random.Random, mean: float) -> int:
    sigma = SIGMA
    mu = math.log(mean) - sigma**2 / 2
    return max(1, round(rng.lognormvariate(mu, sigma)))


class StandInWorker:
    """Samples random tokens, ending each sampled sequence at its own drawn length."""

    def __init__(self, rng: random.Random, scheduler: Scheduler):
        self.rng, self.scheduler = rng, scheduler
        self.length_of: dict[int, int] = {}

    def run(self, step) -> StepResult:
        sampled = []
        for entry in step.scheduled:
            seq = self.scheduler.sequences[entry.seq_id]
            if entry.start + entry.num_tokens < seq.num_tokens:
                continue  # a prompt chunk: nothing to sample yet
            sampling = seq.request.sampling
            if sampling.use_beam_search:
                k = sampling.num_top_logprobs
                ids = self.rng.sample(range(3, VOCAB), k)
                logprobs = sorted((-abs(self.rng.gauss(2.0, 1.5)) for _ in ids), reverse=True)
                sampled.append(SampledTokens(entry.seq_id, [ids[0]], [logprobs[0]], [ids], [logprobs]))
                continue
            draws = sampling.num_samples if not seq.output_token_ids and len(seq.request.seqs) == 1 else 1
            for _ in range(draws):
                sampled.append(SampledTokens(entry.seq_id, [self.rng.randrange(3, VOCAB)], [-1.0], [], []))
        return StepResult(step.step_id, sampled, 0.0, 0.0)


def end_with_eos(result: StepResult, scheduler: Scheduler, rng: random.Random, lengths: dict) -> None:
    """Give each sampled sequence an Alpaca-like length by turning its last token into EOS."""
    for i, token in enumerate(result.sampled):
        seq = scheduler.sequences.get(token.seq_id)
        if seq is None or seq.request.sampling.use_beam_search:
            continue
        key = (seq.request.request_id, seq.index, i if not seq.output_token_ids else 0)
        length = lengths.setdefault(key, lognormal_length(rng, MEAN_OUTPUT))
        if len(seq.output_token_ids) + 1 >= length:
            token.token_ids = [EOS]


def run(mode: str, width: int, seed: int = 0) -> dict:
    rng = random.Random(seed)
    manager = KVCacheManager(num_gpu_blocks=200_000, block_size=BLOCK_SIZE)
    scheduler = Scheduler(manager, Budgets(256, 8192, 4096), eos_token_ids=[EOS])
    worker = StandInWorker(rng, scheduler)
    beam = mode == "beam"
    arrivals = [rng.expovariate(1.0) for _ in range(NUM_REQUESTS)]  # ~1 request per step
    clock, pending = 0.0, 0
    for i in range(NUM_REQUESTS):
        prompt = [rng.randrange(3, VOCAB) for _ in range(lognormal_length(rng, MEAN_INPUT))]
        output = lognormal_length(rng, MEAN_OUTPUT)
        clock += arrivals[i]
        sampling = SamplingParams(
            n=width,
            best_of=width,
            temperature=0.0 if beam else 1.0,
            use_beam_search=beam,
            max_tokens=output if beam else 4096,
            ignore_eos=beam,
        )
        arrivals[i] = (clock, AddRequest(f"r{i}", prompt, sampling, clock))
    logical = physical = 0
    lengths: dict = {}
    now = 0.0
    while pending < NUM_REQUESTS or scheduler.has_work():
        while pending < NUM_REQUESTS and arrivals[pending][0] <= now:
            scheduler.add(arrivals[pending][1])
            pending += 1
        now += 1.0
        step = scheduler.schedule()
        if step is None:
            continue
        result = worker.run(step)
        end_with_eos(result, scheduler, rng, lengths)
        scheduler.update(result)
        for request in scheduler.running:
            logical += sum(len(seq.kv.block_table) for seq in request.seqs)
            physical += len({b for seq in request.seqs for b in seq.kv.block_table})
    return {
        "mode": mode,
        "width": width,
        "saving_percent": 100.0 * (1 - physical / logical),
        "logical_block_steps": logical,
        "physical_block_steps": physical,
    }


def main() -> None:
    global SIGMA
    if "--sigma" in sys.argv:
        SIGMA = float(sys.argv[sys.argv.index("--sigma") + 1])
    print(f"lengths: log-normal, sigma {SIGMA}; block size {BLOCK_SIZE}; {NUM_REQUESTS} requests")
    rows = [run("parallel", n) for n in (2, 4, 6)] + [run("beam", k) for k in (2, 4, 6)]
    paper = {("parallel", 2): 6.1, ("parallel", 6): 9.8, ("beam", 2): 37.6, ("beam", 6): 55.2}
    print(f"{'sharing':<20}{'width':>6}{'saved %':>10}{'paper %':>10}")
    for row in rows:
        reference = paper.get((row["mode"], row["width"]))
        print(
            f"{row['mode'] + ' sampling' if row['mode'] == 'parallel' else 'beam search':<20}"
            f"{row['width']:>6}{row['saving_percent']:>10.1f}{reference if reference else '':>10}"
        )
    out = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "sharing_bench.json"), "w") as f:
        json.dump(
            {
                "date": time.strftime("%Y-%m-%d"),
                "machine": platform.machine(),
                "sigma": SIGMA,
                "block_size": BLOCK_SIZE,
                "requests": NUM_REQUESTS,
                "rows": rows,
            },
            f,
            indent=2,
        )
    plot(rows, os.path.join(os.path.dirname(out), "..", "docs", "fig15_sharing.png"))


def plot(rows: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(1, 2, figsize=(8, 3.5), sharey=True)
    for axis, mode, title in ((axes[0], "parallel", "parallel sampling"), (axes[1], "beam", "beam search")):
        picked = [r for r in rows if r["mode"] == mode]
        axis.bar([str(r["width"]) for r in picked], [r["saving_percent"] for r in picked])
        axis.set_title(title)
        axis.set_xlabel("samples" if mode == "parallel" else "beam width")
    axes[0].set_ylabel("KV blocks saved by sharing (%)")
    figure.suptitle(f"Alpaca-like trace, {NUM_REQUESTS} requests, block size {BLOCK_SIZE}")
    figure.tight_layout()
    figure.savefig(os.path.normpath(path), dpi=100)


if __name__ == "__main__":
    main()
