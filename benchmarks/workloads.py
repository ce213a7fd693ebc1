"""Synthetic request traces for the benchmarks: what to send, never how.

Prompts are random token ids (the model's output does not matter, `ignore_eos` runs every request
to its length). Lengths follow the PagedAttention paper's datasets in distribution shape and mean:
ShareGPT (long conversations, long-tailed) and Alpaca (short instructions), drawn log-normally with
the paper's means and capped to the server's context, so the means a capped trace really has are
reported by `describe`. The shared-prefix traces put one fixed few-shot prefix before every prompt,
as the paper's translation workload does (80 tokens one-shot, 341 five-shot).
"""

from __future__ import annotations

import functools
import math
import random
import statistics
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath


@dataclass(slots=True)
class Job:
    prompt: list[int] | str  # token ids, or text (the code workload)
    output_len: int
    params: dict = field(default_factory=dict)  # extra request fields: n, best_of, use_beam_search


SHAREGPT_MEANS = (161.31, 337.99)  # input, output tokens
ALPACA_MEANS = (19.31, 58.45)
PREFIX_LENGTHS = {1: 80, 5: 341}  # few-shot prefix tokens, by shots


def _lognormal(rng: random.Random, mean: float, sigma: float) -> float:
    return rng.lognormvariate(math.log(mean) - sigma**2 / 2, sigma)  # this mean before capping


def _tokens(rng: random.Random, count: int, vocab_size: int) -> list[int]:
    return [rng.randrange(1, vocab_size) for _ in range(count)]


def _traced(
    count: int, means: tuple[float, float], sigma: float, seed: int, max_model_len: int, vocab_size: int
) -> list[Job]:
    rng = random.Random(seed)
    jobs = []
    for _ in range(count):
        num_in = max(1, min(round(_lognormal(rng, means[0], sigma)), max_model_len // 2))
        num_out = max(1, min(round(_lognormal(rng, means[1], sigma)), max_model_len - num_in))
        jobs.append(Job(_tokens(rng, num_in, vocab_size), num_out))
    return jobs


def fixed(
    count: int,
    input_len: int = 128,
    output_len: int = 128,
    seed: int = 0,
    vocab_size: int = 4096,
    max_model_len: int = 1 << 30,
) -> list[Job]:
    rng = random.Random(seed)
    return [Job(_tokens(rng, input_len, vocab_size), output_len) for _ in range(count)]


def sharegpt(count: int, seed: int = 0, max_model_len: int = 1024, vocab_size: int = 4096) -> list[Job]:
    return _traced(count, SHAREGPT_MEANS, 1.0, seed, max_model_len, vocab_size)


def alpaca(count: int, seed: int = 0, max_model_len: int = 1024, vocab_size: int = 4096) -> list[Job]:
    return _traced(count, ALPACA_MEANS, 0.8, seed, max_model_len, vocab_size)


def shared_prefix(
    count: int, shots: int = 1, seed: int = 0, max_model_len: int = 1024, vocab_size: int = 4096
) -> list[Job]:
    rng = random.Random(seed)
    prefix = _tokens(rng, PREFIX_LENGTHS[shots], vocab_size)
    jobs = []
    for _ in range(count):
        room = max_model_len - len(prefix)
        num_in = max(1, min(round(_lognormal(rng, 30, 0.5)), room // 2))
        num_out = max(1, min(round(_lognormal(rng, 30, 0.5)), room - num_in))
        jobs.append(Job(prefix + _tokens(rng, num_in, vocab_size), num_out))
    return jobs


def system_prompts(
    count: int = 16, length_range: tuple[int, int] = (400, 800), seed: int = 0, vocab_size: int = 4096
) -> list[list[int]]:
    rng = random.Random(seed)
    return [_tokens(rng, rng.randint(*length_range), vocab_size) for _ in range(count)]


def tenants(
    count: int,
    prefixes: list[list[int]],
    suffix_range: tuple[int, int] = (16, 48),
    output_len: int = 16,
    seed: int = 0,
    vocab_size: int = 4096,
) -> list[Job]:
    """Multi-tenant traffic: system prompts (`system_prompts`), each shared by many requests
    (chosen uniformly), each request with a short suffix of its own."""
    rng = random.Random(seed)
    return [
        Job(rng.choice(prefixes) + _tokens(rng, rng.randint(*suffix_range), vocab_size), output_len)
        for _ in range(count)
    ]


def parallel_samples(
    count: int, n: int = 2, seed: int = 0, max_model_len: int = 1024, vocab_size: int = 4096
) -> list[Job]:
    jobs = alpaca(count, seed, max_model_len, vocab_size)
    for job in jobs:
        job.params = {"n": n, "temperature": 1.0, "seed": seed}
    return jobs


def beams(count: int, width: int = 2, seed: int = 0, max_model_len: int = 1024, vocab_size: int = 4096) -> list[Job]:
    jobs = alpaca(count, seed, max_model_len, vocab_size)
    for job in jobs:
        job.params = {"n": width, "use_beam_search": True, "temperature": 0.0}
    return jobs


# The commit whose sources the code workload cuts its prompts from: later edits to the tree change
# no prompt, so sittings on different commits send the same requests.
CODE_REVISION = "5f4a3adb45114538345e2fb866928ef82a2f8b07"
CODE_FOLDERS = ("services", "shared", "kernels")
ROOT = Path(__file__).resolve().parent.parent


@functools.cache
def code_sources(revision: str = CODE_REVISION, root: Path = ROOT) -> tuple[str, ...]:
    """The text of every Python file under CODE_FOLDERS at `revision`, in path order, read with git;
    the working tree's, with a warning, where git or that commit is not at hand (the prompts then
    differ from other commits')."""
    try:
        git = ["git", "-C", str(root)]
        listed = subprocess.run(
            [*git, "ls-tree", "-r", "--name-only", revision, "--", *CODE_FOLDERS],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.split()
        paths = sorted((path for path in listed if path.endswith(".py")), key=PurePosixPath)
        batch = subprocess.run(
            [*git, "cat-file", "--batch"],
            input="".join(f"{revision}:{p}\n" for p in paths).encode(),
            capture_output=True,
            check=True,
        ).stdout
    except (OSError, subprocess.CalledProcessError) as exc:
        print(
            f"code workload: {revision[:12]} not readable with git ({exc}); cutting prompts from the working tree",
            file=sys.stderr,
        )
        return tuple(p.read_text() for p in sorted(p for folder in CODE_FOLDERS for p in (root / folder).rglob("*.py")))
    texts, at = [], 0
    for _ in paths:  # each: "<id> blob <size>\n" then the bytes and a newline
        header_end = batch.index(b"\n", at)
        size = int(batch[at:header_end].split()[2])
        texts.append(batch[header_end + 1 : header_end + 1 + size].decode())
        at = header_end + 2 + size
    return tuple(texts)


def code(
    count: int,
    seed: int = 0,
    max_model_len: int = 1024,
    vocab_size: int = 4096,
    output_len: int = 128,
    prompt_chars: int = 1100,
    sources: tuple[str, ...] | None = None,
) -> list[Job]:
    """Prompts cut from Python source files (this repository's at CODE_REVISION, which the shipped
    model never saw), each a run of whole lines of at most `prompt_chars` characters (about 350 of
    the shipped model's tokens), greedy: the workload of code completion, where n-gram speculation pays."""
    sources = code_sources() if sources is None else sources
    rng = random.Random(seed)
    jobs = []
    while len(jobs) < count:
        lines = rng.choice(sources).splitlines(keepends=True)
        if len(lines) < 40:
            continue
        start, text = rng.randrange(len(lines) - 30), ""
        for line in lines[start:]:
            if len(text) + len(line) > prompt_chars:
                break
            text += line
        if len(text) > prompt_chars // 3:
            jobs.append(Job(text, output_len, {"temperature": 0.0}))
    return jobs


WORKLOADS = {
    "code": code,
    "fixed": fixed,
    "sharegpt": sharegpt,
    "alpaca": alpaca,
    "prefix1": lambda count, **kw: shared_prefix(count, shots=1, **kw),
    "prefix5": lambda count, **kw: shared_prefix(count, shots=5, **kw),
    "parallel4": lambda count, **kw: parallel_samples(count, n=4, **kw),
    "beam4": lambda count, **kw: beams(count, width=4, **kw),
}


def describe(jobs: list[Job]) -> dict:
    """Lengths in tokens (in characters for text prompts)."""
    inputs, outputs = [len(j.prompt) for j in jobs], [j.output_len for j in jobs]
    return {
        "requests": len(jobs),
        "mean_input": statistics.mean(inputs),
        "mean_output": statistics.mean(outputs),
        "max_input": max(inputs),
        "max_output": max(outputs),
    }
