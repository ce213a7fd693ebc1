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

pytestmark = pytest.mark.slow  # starts processes: not in `make check`

MODEL_DIR = os.path.join(ROOT, "ops", "models", "tiny-python")
PROMPTS = ["import os\nimport sys\n\n\ndef main(", "class Parser:\n    def __init__(self", "    for item in "]
KEYWORDS = {
    "def",
    "return",
    "self",
    "if",
    "None",
    "import",
    "for",
    "in",
    "not",
    "class",
    "is",
    "raise",
    "else",
    "elif",
    "try",
    "except",
    "with",
    "as",
    "and",
    "or",
    "True",
    "False",
    "lambda",
}


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(MODEL_DIR)


def test_it_ships_in_plain_hf_format_within_20_mb():
    names = set(os.listdir(MODEL_DIR))
    assert {
        "config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
        "generation_config.json",
        "loss.png",
    } <= names
    assert sum(os.path.getsize(os.path.join(MODEL_DIR, n)) for n in names) <= 20 * 2**20
    with open(os.path.join(MODEL_DIR, "tokenizer_config.json")) as f:
        assert "im_start" in json.load(f)["chat_template"]
    assert AutoConfig.from_pretrained(MODEL_DIR).architectures == ["LlamaForCausalLM"]


def test_hf_transformers_and_pagedserve_agree_on_greedy_output(tokenizer):
    prompts = [tokenizer.encode(p) for p in PROMPTS]
    got = Engine(MODEL_DIR, block_size=16).generate(prompts, max_tokens=24)
    assert got == [hf_greedy(MODEL_DIR, p, 24) for p in prompts]


OPENINGS = [
    "def fibonacci(n):\n",
    "import os\n",
    "class Stack:\n",
    "def main():\n",
    "for i in range(10):\n",
    "import sys\n\n\ndef parse_args(argv):\n",
    "with open(path) as f:\n",
    "def __init__(self, name):\n",
    "try:\n",
    'if __name__ == "__main__":\n',
    "def read_file(path):\n",
    "class Node:\n    def __init__(self, value):\n",
    "import json\n\n",
    "def sort_list(items):\n",
    "while True:\n",
    "def add(a, b):\n",
    "from collections import defaultdict\n\n",
    "def is_prime(n):\n",
    "class Config(object):\n",
    'def parse(text):\n    """',
    "async def fetch(url):\n",
    "def __repr__(self):\n",
    "import re\n\nPATTERN = ",
    "def test_add():\n",
]


def test_greedy_continuations_of_python_openings_never_repeat_a_line_more_than_three_times(tokenizer):
    prompts = [tokenizer.encode(opening) for opening in OPENINGS]
    continuations = Engine(MODEL_DIR, block_size=16).generate(prompts, max_tokens=64)
    for opening, tokens in zip(OPENINGS, continuations):
        lines = [line for line in tokenizer.decode(tokens).split("\n") if line.strip()]
        line, count = max(((line, lines.count(line)) for line in lines), key=lambda pair: pair[1], default=("", 0))
        assert count <= 3, f"{opening!r} goes on with {line!r} {count} times"


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
            texts.append(tokenizer.decode(out[0, ids.shape[1] :]))
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


TRAIN_SMALL = [
    "--files",
    "15",
    "--vocab-size",
    "400",
    "--batch-size",
    "2",
    "--seq-len",
    "32",
    "--threads",
    "1",
    "--no-plot",
]


def train(*runs: list[str]) -> None:
    """One training run per list of arguments, side by side (each takes one thread)."""
    script = os.path.join(ROOT, "ops", "train_tiny_model.py")
    started = [
        subprocess.Popen(
            [sys.executable, script, *args, *TRAIN_SMALL], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True
        )
        for args in runs
    ]
    for process in started:
        _, errors = process.communicate(timeout=300)
        assert process.returncode == 0, errors[-2000:]


@pytest.fixture(scope="module")
def trained_twice(tmp_path_factory):
    """Two training runs with the same arguments."""
    root = tmp_path_factory.mktemp("trained")
    train(*(["--out", str(root / run), "--steps", "3"] for run in ("a", "b")))
    return root / "a", root / "b"


def test_training_is_seeded_and_reproducible(trained_twice):
    a, b = (load_file(run / "model.safetensors") for run in trained_twice)
    assert a.keys() == b.keys()
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_unlikelihood_fine_tuning_starts_from_a_saved_model_and_records_the_chain(trained_twice, tmp_path):
    base_dir = trained_twice[0]
    train(["--out", str(tmp_path / "tuned"), "--init-from", str(base_dir), "--steps", "0", "--unlikelihood-steps", "2"])
    record = json.loads((tmp_path / "tuned" / "training.json").read_text())
    assert record["init_from"]["steps"] == 3 and [s["step"] for s in record["unlikelihood"]] == [0, 1]
    base, tuned = load_file(base_dir / "model.safetensors"), load_file(tmp_path / "tuned" / "model.safetensors")
    assert not all(torch.equal(base[k], tuned[k]) for k in base)


def test_only_a_line_seen_twice_before_is_marked_and_only_its_visible_tokens():
    sys.path.insert(0, os.path.join(ROOT, "ops"))
    from train_tiny_model import repeated_line_positions

    pieces = ["x = 1", "\n", "    ", "y", "else:"]
    # lines: "x = 1", "else:", "x = 1", "    x = 1" (third time), "y", "else:" (second time)
    sequence = [0, 1, 4, 1, 0, 1, 2, 0, 1, 3, 1, 4, 1]
    assert repeated_line_positions(sequence, start=0, pieces=pieces) == [7]
    assert repeated_line_positions(sequence, start=8, pieces=pieces) == []
