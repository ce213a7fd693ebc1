"""Greedy output through all three processes equals HF transformers' `generate`."""

from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from transformers import AutoTokenizer

from tests.conftest import serve, wait_until
from tests.tiny_models import hf_greedy

pytestmark = pytest.mark.slow  # starts processes: not in `make check`

TEXTS = [
    "import os",
    "def main():\n    return 0",
    "class Handler(object):\n    def __init__(self, name):\n        self.name = name\n",
    "x",
    "for i in range(10):\n    print(i)\n",
    "# Copyright",
    '"""A module docstring that goes on for a little while, to make a longer prompt."""\n',
    "while True:\n    break\n" * 3,
]
MAX_TOKENS = 16


def prompts(model_dir):
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    ids = [tokenizer.encode(t) for t in TEXTS]
    assert len({len(p) for p in ids}) >= 6  # prompts of different lengths
    return ids


def complete_all(server, prompt_ids, max_tokens=MAX_TOKENS):
    """Send every prompt at once; returns the generated token ids of each."""

    def one(prompt):
        body = {
            "model": server.model,
            "prompt": prompt,
            "max_tokens": max_tokens,
            "temperature": 0,
            "return_token_ids": True,
        }
        response = httpx.post(f"{server.base_url}/v1/completions", json=body, timeout=120)
        response.raise_for_status()
        return response.json()["choices"][0]["token_ids"]

    with ThreadPoolExecutor(len(prompt_ids)) as pool:
        return list(pool.map(one, prompt_ids))


@pytest.mark.parametrize("family,flags", [("llama", []), ("qwen2", []), ("llama", ["--no-async-scheduling"])])
def test_concurrent_greedy_completions_equal_hf_generate(model_dirs, family, flags, tmp_path):
    model_dir = model_dirs[family]
    prompt_ids = prompts(model_dir)
    with serve(model_dir, str(tmp_path), *flags) as server:
        got = complete_all(server, prompt_ids)
    assert got == [hf_greedy(model_dir, p, MAX_TOKENS) for p in prompt_ids]


def test_preempted_and_recomputed_sequences_give_the_same_tokens(llama_dir, tmp_path):
    prompt_ids = prompts(llama_dir)
    # 20 blocks of 4 tokens hold 80 tokens; the 8 requests reach 287 tokens together.
    flags = ["--block-size", "4", "--num-gpu-blocks-override", "20", "--preemption-mode", "recompute"]
    with serve(llama_dir, str(tmp_path), *flags) as server:
        # One batch request: all eight arrive at once, however fast the server answers each.
        body = {
            "model": server.model,
            "prompt": prompt_ids,
            "max_tokens": MAX_TOKENS,
            "temperature": 0,
            "return_token_ids": True,
        }
        response = httpx.post(f"{server.base_url}/v1/completions", json=body, timeout=120)
        response.raise_for_status()
        got = [c["token_ids"] for c in sorted(response.json()["choices"], key=lambda c: c["index"])]
        assert wait_until(server.is_idle, 5)
        assert server.metrics()['pagedserve_preemptions_total{mode="recompute"}'] > 0
        # Only --preemption-mode auto weighs swapping against recomputing: the worker measured neither rate.
        assert "swap and prefill rates not measured (--preemption-mode recompute)" in server.log()
    assert got == [hf_greedy(llama_dir, p, MAX_TOKENS) for p in prompt_ids]
