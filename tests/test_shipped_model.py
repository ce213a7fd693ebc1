"""The model that ships in ops/models/tiny-python: HF-loadable, served by default, writes Python."""

import json
import os
import re
import subprocess
import sys

import httpx
import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from tests.conftest import ROOT, serve
from tests.engine_harness import Engine
from tests.tiny_models import hf_greedy

MODEL_DIR = os.path.join(ROOT, "ops", "models", "tiny-python")
PROMPTS = ["import os\nimport sys\n\n\ndef main(", "class Parser:\n    def __init__(self", "    for item in "]
KEYWORDS = {"def", "return", "self", "if", "None", "import", "for", "in", "not", "class", "is", "raise",
            "else", "elif", "try", "except", "with", "as", "and", "or", "True", "False", "lambda"}


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(MODEL_DIR)


def test_it_ships_in_plain_hf_format_within_20_mb():
    names = set(os.listdir(MODEL_DIR))
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
            "generation_config.json", "loss.png"} <= names
    assert sum(os.path.getsize(os.path.join(MODEL_DIR, n)) for n in names) <= 20 * 2**20
    with open(os.path.join(MODEL_DIR, "tokenizer_config.json")) as f:
        assert "im_start" in json.load(f)["chat_template"]
    assert AutoConfig.from_pretrained(MODEL_DIR).architectures == ["LlamaForCausalLM"]


def test_hf_transformers_and_pagedserve_agree_on_greedy_output(tokenizer):
    prompts = [tokenizer.encode(p) for p in PROMPTS]
    got = Engine(MODEL_DIR, block_size=16).generate(prompts, max_tokens=24)
    assert got == [hf_greedy(MODEL_DIR, p, 24) for p in prompts]


def _keywords(text: str) -> set[str]:
    return set(re.findall(r"[A-Za-z_]+", text)) & KEYWORDS


def test_prompted_with_python_it_continues_with_python(tokenizer):
    trained = AutoModelForCausalLM.from_pretrained(MODEL_DIR).eval()
    torch.manual_seed(0)
    untrained = AutoModelForCausalLM.from_config(trained.config).eval()

    def continuations(model):
        texts = []
        for prompt in PROMPTS:
            ids = tokenizer(prompt, return_tensors="pt").input_ids
            with torch.no_grad():
                out = model.generate(ids, max_new_tokens=48, do_sample=False)
            texts.append(tokenizer.decode(out[0, ids.shape[1]:]))
        return texts

    written = continuations(trained)
    assert len(set().union(*map(_keywords, written))) >= 5, written
    assert sum("\n    " in text for text in written) >= 2  # indented blocks
    noise = continuations(untrained)
    assert len(set().union(*map(_keywords, noise))) < len(set().union(*map(_keywords, written)))


def test_pagedserve_up_without_a_model_serves_it(tmp_path):
    with serve(None, str(tmp_path)) as server:
        models = httpx.get(f"{server.base_url}/v1/models").json()
        body = {"model": "tiny-python", "prompt": "def add(a, b):\n", "max_tokens": 16, "temperature": 0}
        completion = httpx.post(f"{server.base_url}/v1/completions", json=body, timeout=60).json()
    assert [m["id"] for m in models["data"]] == ["tiny-python"]
    assert completion["usage"]["completion_tokens"] >= 1 and completion["choices"][0]["text"]


def test_training_is_seeded_and_reproducible(tmp_path):
    script = os.path.join(ROOT, "ops", "train_tiny_model.py")
    outs = []
    for run in ("a", "b"):
        out = tmp_path / run
        args = [sys.executable, script, "--out", str(out), "--steps", "3", "--files", "15", "--vocab-size", "400",
                "--batch-size", "2", "--seq-len", "32", "--threads", "1", "--no-plot"]
        done = subprocess.run(args, capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stderr[-2000:]
        outs.append(load_file(out / "model.safetensors"))
    assert outs[0].keys() == outs[1].keys()
    assert all(torch.equal(outs[0][k], outs[1][k]) for k in outs[0])
