"""Speculative decoding through all three processes, with async scheduling, on the shipped model
(whose greedy code repeats itself enough for n-gram proposals to be accepted)."""

from __future__ import annotations

import json
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
import torch
from transformers import AutoTokenizer

from services.launcher import SHIPPED_MODEL
from tests.conftest import ROOT, metrics_port_flags, serve, wait_until
from tests.tiny_models import _hf_model, hf_greedy

pytestmark = pytest.mark.slow  # starts processes: not in `make check`

OPENINGS = [
    "def fibonacci(n):\n    if n < 2:\n        return n\n",
    "import os\nimport sys\n\n\ndef main():\n",
    "class Node:\n    def __init__(self, value):\n        self.value = value\n",
    "for i in range(10):\n    print(i)\n",
]


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(SHIPPED_MODEL)


@pytest.fixture(scope="module")
def ngram_server(shipped_ngram_server):
    return shipped_ngram_server


def complete(server, prompt, **fields) -> dict:
    body = {"model": server.model, "prompt": prompt, "temperature": 0, "return_token_ids": True, **fields}
    response = httpx.post(f"{server.base_url}/v1/completions", json=body, timeout=120)
    response.raise_for_status()
    return response.json()


def test_concurrent_greedy_completions_equal_hf_and_proposals_are_accepted(ngram_server, tokenizer):
    prompts = [tokenizer.encode(text) for text in OPENINGS]
    with ThreadPoolExecutor(len(prompts)) as pool:
        got = list(pool.map(lambda p: complete(ngram_server, p, max_tokens=64)["choices"][0]["token_ids"], prompts))
    assert got == [hf_greedy(SHIPPED_MODEL, p, 64) for p in prompts]
    metrics = ngram_server.metrics("scheduler")
    accepted = metrics["pagedserve_spec_decode_num_accepted_tokens_total"]
    assert 0 < accepted <= metrics["pagedserve_spec_decode_num_draft_tokens_total"]
    assert metrics['pagedserve_spec_decode_num_accepted_tokens_per_pos_total{position="0"}'] > 0
    assert wait_until(ngram_server.is_idle, 5)


def test_logprobs_come_for_every_emitted_token(ngram_server, tokenizer):
    prompt = tokenizer.encode(OPENINGS[0])
    choice = complete(ngram_server, prompt, max_tokens=48, logprobs=1)["choices"][0]
    tokens = choice["token_ids"]
    assert len(choice["logprobs"]["token_logprobs"]) == len(tokens) == 48
    model = _hf_model(SHIPPED_MODEL)
    with torch.no_grad():
        logits = model(torch.tensor([prompt + tokens])).logits[0, len(prompt) - 1 : -1].log_softmax(-1)
    want = logits[torch.arange(len(tokens)), torch.tensor(tokens)].tolist()
    assert choice["logprobs"]["token_logprobs"] == pytest.approx(want, abs=1e-3)


def stream(server, prompt, **fields) -> list[dict]:
    body = {
        "model": server.model,
        "prompt": prompt,
        "temperature": 0,
        "stream": True,
        "return_token_ids": True,
        "stream_options": {"include_usage": True},
        **fields,
    }
    response = httpx.post(f"{server.base_url}/v1/completions", json=body, timeout=120)
    return [
        json.loads(line[6:])
        for line in response.text.splitlines()
        if line.startswith("data: ") and line != "data: [DONE]"
    ]


def test_a_stop_string_inside_an_accepted_run_ends_the_text_and_the_count_there(ngram_server, tokenizer):
    prompt = tokenizer.encode(OPENINGS[0])
    chunks = [c for e in stream(ngram_server, prompt, max_tokens=96) for c in e["choices"]]  # one per step
    full_text, tokens = "".join(c["text"] for c in chunks), [t for c in chunks for t in c["token_ids"]]
    before, run = next(
        (sum(len(c["token_ids"]) for c in chunks[:i]), c["token_ids"])
        for i, c in enumerate(chunks)
        if len(c["token_ids"]) >= 3
    )  # a step that kept two proposals or more
    taken = before + 2  # the stop string ends with the run's second token
    prefix = tokenizer.decode(tokens[:taken])
    assert full_text.startswith(prefix) and run
    length = next(n for n in range(2, len(prefix) + 1) if full_text.find(prefix[-n:]) == len(prefix) - n)
    stop = prefix[-length:]  # ends there, and nowhere before
    for streamed in (False, True):
        if streamed:
            events = stream(ngram_server, prompt, max_tokens=96, stop=[stop])
            text = "".join(c["text"] for e in events for c in e["choices"])
            token_ids = [t for e in events for c in e["choices"] for t in c["token_ids"]]
            usage, reason = events[-1]["usage"], [c["finish_reason"] for e in events for c in e["choices"]][-1]
        else:
            result = complete(ngram_server, prompt, max_tokens=96, stop=[stop])
            text, token_ids = result["choices"][0]["text"], result["choices"][0]["token_ids"]
            usage, reason = result["usage"], result["choices"][0]["finish_reason"]
        assert text == full_text[: len(prefix) - length] and reason == "stop"
        assert token_ids == tokens[:taken] and usage["completion_tokens"] == taken  # nothing after the stop
    assert wait_until(ngram_server.is_idle, 5)


def test_a_client_that_leaves_mid_stream_frees_every_block(ngram_server, tokenizer):
    body = {"model": ngram_server.model, "prompt": OPENINGS[1], "temperature": 0, "max_tokens": 400, "stream": True}
    with httpx.stream("POST", f"{ngram_server.base_url}/v1/completions", json=body, timeout=60) as response:
        for i, _ in enumerate(response.iter_lines()):
            if i > 10:
                break
    assert wait_until(ngram_server.is_idle, 10)


def test_tp_2_with_a_draft_model_gives_hf_greedy_tokens(tmp_path, tokenizer):
    draft = json.dumps({"method": "draft_model", "model": SHIPPED_MODEL, "num_speculative_tokens": 3})
    prompts = [tokenizer.encode(text) for text in OPENINGS[:2]]
    with serve(
        None, str(tmp_path), "--dtype", "float32", "--tensor-parallel-size", "2", "--speculative-config", draft
    ) as server:
        with ThreadPoolExecutor(len(prompts)) as pool:
            got = list(pool.map(lambda p: complete(server, p, max_tokens=40)["choices"][0]["token_ids"], prompts))
        metrics = server.metrics("scheduler")
        assert metrics["pagedserve_spec_decode_num_accepted_tokens_total"] > 0
    assert got == [hf_greedy(SHIPPED_MODEL, p, 40) for p in prompts]


def test_a_bad_speculative_config_is_one_clear_error_before_anything_loads():
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "services.launcher",
            "up",
            "--port",
            "1",
            *metrics_port_flags(),
            "--speculative-config",
            '{"method": "ngram", "num_speculative_tokens": 0}',
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 2
    assert "num_speculative_tokens must be an integer" in done.stderr
