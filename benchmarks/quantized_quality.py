"""What each quantization costs in quality: the shipped model's perplexity on held-out Python source (the
standard library's own tests, which its training left out: ops/train_tiny_model.py), served by pagedserve as
it is (bfloat16) and quantized by ops/quantize.py in each scheme. Each checkpoint is served through the three
processes and scored from the log-probabilities of its prompt tokens (`echo` with `logprobs`).

The shipped model's MLP is 704 wide, which groups of 128 do not divide: its 4-bit schemes use groups of 64.

    python benchmarks/quantized_quality.py                 # 24 files, their first 512 tokens
    python benchmarks/quantized_quality.py --files 4       # shorter

Writes benchmarks/results/quantized_quality.json.
"""

from __future__ import annotations

import argparse
import glob
import json
import math
import os
import socket
import subprocess
import sys
import sysconfig
import tempfile
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from benchmarks.provenance import commit, cpu_model  # noqa: E402

SHIPPED = ROOT / "ops" / "models" / "tiny-python"
# name: (ops/quantize.py scheme, group size); None: the checkpoint as shipped
SCHEMES = {
    "bf16 (as shipped)": None,
    "W8A8 int8": ("W8A8", None),
    "W8A16 int8": ("W8A16", 64),
    "W4A16 (groups of 64)": ("W4A16", 64),
    "W4A16 asymmetric (groups of 64)": ("W4A16_ASYM", 64),
    "W4A16 per channel": ("W4A16-channel", None),
    "FP8 W8A16 (per channel)": ("FP8_DYNAMIC", None),
}


def held_out(files: int, tokens: int, tokenizer) -> list[list[int]]:
    """The first `tokens` tokens of the first `files` test modules of the standard library with that many."""
    paths = sorted(glob.glob(os.path.join(sysconfig.get_paths()["stdlib"], "test", "test_*.py")))
    texts = []
    for path in paths:
        with open(path, encoding="utf-8", errors="ignore") as f:
            ids = tokenizer.encode(f.read())
        if len(ids) >= tokens:
            texts.append(ids[:tokens])
        if len(texts) == files:
            break
    return texts


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def perplexity(model_dir: str, texts: list[list[int]], scratch: str) -> float:
    port = free_port()
    log = open(os.path.join(scratch, f"server-{port}.log"), "w")  # noqa: SIM115 (the child keeps it open)
    server = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "services.launcher",
            "serve",
            model_dir,
            "--port",
            str(port),
            "--device",
            "cpu",
            "--scheduler-metrics-port",
            "0",
            "--worker-metrics-port",
            "0",
        ],
        cwd=ROOT,
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    try:
        deadline = time.monotonic() + 300
        while True:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as response:
                    if response.status == 200:
                        break
            except OSError:
                pass
            if server.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"the server of {model_dir} did not start: see {log.name}")
            time.sleep(0.5)
        total, count = 0.0, 0
        for ids in texts:
            body = json.dumps(
                {
                    "model": os.path.basename(model_dir.rstrip("/")),
                    "prompt": ids,
                    "max_tokens": 1,
                    "echo": True,
                    "logprobs": 0,
                    "temperature": 0,
                }
            ).encode()
            request = urllib.request.Request(
                f"http://127.0.0.1:{port}/v1/completions", body, {"content-type": "application/json"}
            )
            with urllib.request.urlopen(request, timeout=300) as response:
                logprobs = json.load(response)["choices"][0]["logprobs"]["token_logprobs"]
            prompt = logprobs[1 : len(ids)]  # the first token has none
            total -= sum(prompt)
            count += len(prompt)
        return math.exp(total / count)
    finally:
        server.terminate()
        server.wait(30)
        log.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--files", type=int, default=24)
    parser.add_argument("--tokens", type=int, default=512)
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "quantized_quality.json"))
    args = parser.parse_args()
    from transformers import AutoTokenizer

    from ops.quantize import write_compressed_tensors

    texts = held_out(args.files, args.tokens, AutoTokenizer.from_pretrained(str(SHIPPED)))
    results = {}
    with tempfile.TemporaryDirectory(prefix="quantized-quality-") as scratch:
        for name, scheme in SCHEMES.items():
            directory = str(SHIPPED)
            if scheme is not None:
                directory = write_compressed_tensors(
                    str(SHIPPED), scheme[0], os.path.join(scratch, scheme[0]), group_size=scheme[1]
                )
            results[name] = round(perplexity(directory, texts, scratch), 3)
            print(f"{name:<34} perplexity {results[name]:.3f}", flush=True)
    base = results["bf16 (as shipped)"]
    print("\n| checkpoint | perplexity | against bf16 |\n| --- | --- | --- |")
    for name, value in results.items():
        print(f"| {name} | {value:.3f} | {value / base - 1:+.1%} |")
    record = {
        "cpu": cpu_model(),
        "commit": commit(),
        "date": time.strftime("%Y-%m-%d"),
        "files": len(texts),
        "tokens_per_file": args.tokens,
        "perplexity": results,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(record, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
