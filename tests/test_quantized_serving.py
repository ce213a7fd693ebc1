"""Quantized checkpoints through the three processes: served close to their oracles, alone and split over two
tensor-parallel ranks (scales split with their weights, groups of inputs by rank), the method and its kernel
named in the log and in /metrics, and a --quantization that contradicts the checkpoint refused at start."""

from __future__ import annotations

import subprocess
import sys

import httpx
import pytest
import torch

from tests.conftest import ROOT, free_port, metrics_port_flags, serve
from tests.tiny_models import check_logprobs_close

pytestmark = pytest.mark.slow  # starts processes: not in `make check`

PROMPTS = [[5, 9, 13, 200, 17, 44, 60, 71], [7, 7, 8, 300, 12], [100, 101, 102, 103, 5, 6, 7, 8, 9, 10, 11]]
MAX_TOKENS = 16


def served_with_logprobs(server) -> list[tuple[list[int], list[dict[int, float]]]]:
    """Each prompt's greedy tokens and top-5 log-probabilities, by token id (the tiny tokenizer's texts map back
    to one id each through the server's own token ids)."""
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
    return [
        (c["token_ids"], c["logprobs"]["top_logprobs"])
        for c in sorted(response.json()["choices"], key=lambda c: c["index"])
    ]


def by_text(outputs, decode):
    return [([decode([t]) for t in tokens], tops) for tokens, tops in outputs]


def oracle(quantized, fmt: str, decode):
    reference = [quantized.greedy_with_logprobs("llama", fmt, p, MAX_TOKENS, torch.bfloat16) for p in PROMPTS]
    return [
        ([decode([t]) for t in tokens], [{decode([t]): lp for t, lp in top.items()} for top in tops])
        for tokens, tops in reference
    ]


@pytest.mark.parametrize("fmt, size", [("ct-w8a8", 1), ("ct-w4a16", 2), ("gptq", 2), ("ct-fp8-block", 2)])
def test_a_quantized_checkpoint_serves_close_to_its_oracle(quantized, tmp_path, fmt, size):
    from transformers import AutoTokenizer

    directory = quantized.get("llama", fmt)
    decode = AutoTokenizer.from_pretrained(directory).decode
    with serve(directory, str(tmp_path), "--tensor-parallel-size", str(size)) as server:
        ours = served_with_logprobs(server)
        worker = server.metrics("worker")
        log = server.log()
    compute = [name for name in worker if name.startswith("pagedserve_worker_compute_info")]
    method = {"ct-w8a8": "W8A8-int8", "ct-w4a16": "W4A16", "gptq": "W4A16", "ct-fp8-block": "FP8-W8A16"}[fmt]
    assert any(f'quantization="{method}' in name for name in compute), compute
    assert f"quantized layers: {method}" in log
    check_logprobs_close(by_text(ours, decode), oracle(quantized, fmt, decode))


def test_a_quantization_flag_that_contradicts_the_checkpoint_stops_the_server_with_the_reason(quantized):
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "services.launcher",
            "serve",
            quantized.get("llama", "awq"),
            "--port",
            str(free_port()),
            *metrics_port_flags(),
            "--device",
            "cpu",
            "--quantization",
            "gptq",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode != 0
    assert "--quantization gptq does not match the checkpoint's quantization_config.quant_method 'awq'" in (
        done.stdout + done.stderr
    )
