"""Tensor parallelism over attention heads on gloo, through the three processes: the same greedy
tokens at TP 2 and 4 as HF transformers' generate, with preemption, prefix caching and beam search
on; one scheduler, N ranks, one block table."""

from __future__ import annotations

import os
import signal
import time

import httpx
import pytest
import torch

from tests.conftest import serve, wait_until
from tests.tiny_models import build_model, hf_beam_search, hf_greedy

pytestmark = pytest.mark.slow  # starts processes: not in `make check`

PROMPTS = [[5, 9, 13, 200, 17, 44], [7, 7, 8, 300, 12], [100, 101, 102, 103, 5, 6, 7], [5, 9, 13, 200, 17, 44, 60]]
MAX_TOKENS = 24
# 20 blocks of 4 tokens hold 80 tokens; the 4 requests reach 121 together, so some are preempted.
SMALL_KV = ["--block-size", "4", "--num-gpu-blocks-override", "20", "--enable-prefix-caching"]


def greedy(server, prompt: list[int]) -> list[int]:
    body = {
        "model": server.model,
        "prompt": prompt,
        "max_tokens": MAX_TOKENS,
        "temperature": 0,
        "return_token_ids": True,
    }
    response = httpx.post(f"{server.base_url}/v1/completions", json=body, timeout=120)
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]["token_ids"]


@pytest.fixture(scope="module")
def family_dirs(tmp_path_factory, llama_dir) -> dict[str, str]:
    dirs = {"llama": llama_dir}
    for family in ("qwen2", "opt", "gpt2"):
        dirs[family] = build_model(str(tmp_path_factory.mktemp(family)), family)
    return dirs


# Every family at TP 2, and the two with grouped KV heads at TP 4 as well (4 ranks over 2 KV heads:
# ranks share them, the one layout TP 2 does not reach); each preemption mode at each size, so that
# swap and recompute on sharded caches are both checked with one launch per case.
CASES = [
    ("llama", 2, "swap"),
    ("qwen2", 2, "recompute"),
    ("opt", 2, "swap"),
    ("gpt2", 2, "recompute"),
    ("llama", 4, "recompute"),
    ("qwen2", 4, "swap"),
]


@pytest.mark.parametrize("family, size, mode", CASES)
def test_greedy_and_beam_search_at_tp_n_equal_hf_under_preemption_and_prefix_caching(
    family_dirs, tmp_path, family, size, mode
):
    model_dir = family_dirs[family]
    with serve(
        model_dir, str(tmp_path), "--tensor-parallel-size", str(size), "--preemption-mode", mode, *SMALL_KV
    ) as server:
        got = greedy_batch(server, PROMPTS)  # all at once, so some are preempted whatever the timing
        # Alone, twice: the second finds the first's blocks in the prefix cache, whatever the
        # preempting batch evicted.
        got += [greedy(server, PROMPTS[3]), greedy(server, PROMPTS[3])]
        assert wait_until(server.is_idle, 10)
        preempted = server.metrics("scheduler")[f'pagedserve_preemptions_total{{mode="{mode}"}}']
        cached = server.metrics("scheduler")["pagedserve_prefix_cache_hits_total"]
        beams = beam_search(server, PROMPTS[0]) if size == 2 else None
    assert got == [hf_greedy(model_dir, p, MAX_TOKENS) for p in PROMPTS + PROMPTS[3:] * 2]
    assert preempted > 0 and cached > 0
    if beams is not None:
        assert beams == hf_beam_search(model_dir, PROMPTS[0], 2, 8)[:2]


def greedy_batch(server, prompts: list[list[int]]) -> list[list[int]]:
    body = {
        "model": server.model,
        "prompt": prompts,
        "max_tokens": MAX_TOKENS,
        "temperature": 0,
        "return_token_ids": True,
    }
    response = httpx.post(f"{server.base_url}/v1/completions", json=body, timeout=120)
    assert response.status_code == 200, response.text
    return [c["token_ids"] for c in sorted(response.json()["choices"], key=lambda c: c["index"])]


def beam_search(server, prompt: list[int]) -> list[list[int]]:
    body = {
        "model": server.model,
        "prompt": prompt,
        "max_tokens": 8,
        "n": 2,
        "best_of": 2,
        "use_beam_search": True,
        "temperature": 0,
        "return_token_ids": True,
    }
    choices = httpx.post(f"{server.base_url}/v1/completions", json=body, timeout=120).json()["choices"]
    return [c["token_ids"] for c in choices]


def test_a_bf16_checkpoint_at_tp_2_is_close_to_hf_in_bf16(tmp_path):
    """At `auto` the ranks keep their shards in bf16 and all-reduce float32 partial sums."""
    from transformers import AutoTokenizer

    from tests.tiny_models import check_logprobs_close, hf_greedy_with_logprobs

    model_dir = build_model(str(tmp_path / "model"), "llama", dtype=torch.bfloat16)
    decode = AutoTokenizer.from_pretrained(model_dir).decode
    with serve(model_dir, str(tmp_path), "--tensor-parallel-size", "2", *SMALL_KV) as server:
        body = {
            "model": server.model,
            "prompt": PROMPTS,
            "max_tokens": MAX_TOKENS,
            "temperature": 0,
            "logprobs": 5,
            "return_token_ids": True,
        }
        response = httpx.post(f"{server.base_url}/v1/completions", json=body, timeout=120)
        assert response.status_code == 200, response.text
        worker = server.metrics("worker")
    assert any('weights="bfloat16"' in name for name in worker), [n for n in worker if "compute" in n]
    choices = sorted(response.json()["choices"], key=lambda c: c["index"])
    # The api gives alternatives by their text: compare texts on both sides.
    ours = [([decode([t]) for t in c["token_ids"]], c["logprobs"]["top_logprobs"]) for c in choices]
    reference = []
    for prompt in PROMPTS:
        tokens, tops = hf_greedy_with_logprobs(model_dir, prompt, MAX_TOKENS, torch.bfloat16)
        reference.append(([decode([t]) for t in tokens], [{decode([t]): lp for t, lp in top.items()} for top in tops]))
    check_logprobs_close(ours, reference)


def test_a_model_whose_heads_do_not_divide_stops_with_one_clear_error(llama_dir, tmp_path):
    import subprocess
    import sys

    from tests.conftest import ROOT, free_port, metrics_port_flags

    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "services.launcher",
            "serve",
            llama_dir,
            "--port",
            str(free_port()),
            *metrics_port_flags(),
            "--device",
            "cpu",
            "--tensor-parallel-size",
            "3",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode != 0
    assert "not divisible by the tensor-parallel size (3)" in done.stdout + done.stderr


def descendants(pid: int) -> dict[int, str]:
    """Every process under `pid`, with its command line."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    parent = int(f.read().rsplit(")", 1)[1].split()[1])
            except OSError:
                continue
            children.setdefault(parent, []).append(int(entry))
    found, stack = {}, [pid]
    while stack:
        for child in children.get(stack.pop(), []):
            try:
                with open(f"/proc/{child}/cmdline") as f:
                    found[child] = f.read().replace("\0", " ")
            except OSError:
                continue
            stack.append(child)
    return found


def test_a_rank_killed_mid_stream_fails_the_requests_and_the_group_serves_again(llama_dir, tmp_path):
    with serve(llama_dir, str(tmp_path), "--tensor-parallel-size", "2") as server:
        body = {"model": server.model, "prompt": PROMPTS[0], "max_tokens": 400, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", f"{server.base_url}/v1/completions", json=body, timeout=60) as response:
            lines = response.iter_lines()
            assert next(line for line in lines if line.startswith("data:"))
            [rank_1] = [pid for pid, command in descendants(server.process.pid).items() if "--rank 1 " in command]
            killed = time.monotonic()
            os.kill(rank_1, signal.SIGKILL)
            rest = [line for line in lines if line.startswith("data:")]
        assert time.monotonic() - killed < 10
        assert rest and "error" in rest[-2] and rest[-1] == "data: [DONE]", rest[-3:]
        assert wait_until(lambda: httpx.get(f"{server.base_url}/health", timeout=2).status_code == 200, 60)
        assert greedy(server, PROMPTS[1]) == hf_greedy(llama_dir, PROMPTS[1], MAX_TOKENS)
        assert wait_until(server.is_idle, 10)
        assert "restarting all 2 ranks" in server.log()


@pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs two GPUs: TP 2 over NCCL"
)
def test_tp_2_on_nccl_gives_the_tokens_of_tp_1(llama_dir, tmp_path):
    results = []
    for size in (1, 2):
        with serve(
            llama_dir, str(tmp_path), "--device", "cuda", "--dtype", "float32", "--tensor-parallel-size", str(size)
        ) as server:
            results.append([greedy(server, p) for p in PROMPTS])
    assert results[0] == results[1]
