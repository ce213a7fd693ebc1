"""A Responses API conversation continued by `previous_response_id` against the same conversation sent whole
each turn (its history as input items, `store` off): time to the first output text, turn by turn.

One server, with --enable-prefix-caching (both ways then find the history's blocks); the two ways alternate
conversation by conversation, so a slow minute of the machine falls on both. Each turn adds a user message of
`--words` words; the model answers up to `--answer` tokens.

    python benchmarks/responses_bench.py --model /path/to/model --out benchmarks/results/responses_bench.json
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from benchmarks.provenance import commit, cpu_model  # noqa: E402

WORDS = ("the", "a", "of", "to", "in", "is", "for", "on", "with", "as", "by", "at", "from", "that", "this", "it")


def first_text(client: httpx.Client, base_url: str, body: dict) -> tuple[float, str, str]:
    """(seconds to the first output text, the response id, the output text) of one streamed response."""
    started, ttft, text, response_id = time.perf_counter(), None, "", ""
    with client.stream("POST", f"{base_url}/v1/responses", json={**body, "stream": True}) as response:
        if response.status_code != 200:
            raise RuntimeError(f"{response.status_code}: {response.read()[:300]!r}")
        for line in response.iter_lines():
            if not line.startswith("data: "):
                continue
            event = json.loads(line[6:])
            if event["type"] == "response.output_text.delta":
                ttft = ttft if ttft is not None else time.perf_counter() - started
                text += event["delta"]
            elif event["type"] in ("response.completed", "response.incomplete"):
                response_id = event["response"]["id"]
    return (ttft if ttft is not None else time.perf_counter() - started), response_id, text


def conversation(client: httpx.Client, base_url: str, args, seed: int, continued: bool) -> list[float]:
    rng = random.Random(seed)
    history: list[dict] = []
    previous, ttfts = None, []
    for _ in range(args.turns):
        question = " ".join(rng.choice(WORDS) for _ in range(args.words))
        body: dict = {"model": "bench", "max_output_tokens": args.answer, "temperature": 0}
        if continued:
            body |= {"input": question, "previous_response_id": previous} if previous else {"input": question}
        else:
            body |= {"input": [*history, {"role": "user", "content": question}], "store": False}
        ttft, previous, answer = first_text(client, base_url, body)
        history += [{"role": "user", "content": question}, {"role": "assistant", "content": answer}]
        ttfts.append(ttft)
    return ttfts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--port", type=int, default=8390)
    parser.add_argument("--conversations", type=int, default=6, help="per way, alternating")
    parser.add_argument("--turns", type=int, default=6)
    parser.add_argument("--words", type=int, default=150)
    parser.add_argument("--answer", type=int, default=32)
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "responses_bench.json"))
    args = parser.parse_args()
    base_url = f"http://127.0.0.1:{args.port}"
    command = [
        sys.executable, "-m", "services.launcher", "serve", args.model, "--port", str(args.port),
        "--served-model-name", "bench", "--enable-prefix-caching",
        "--scheduler-metrics-port", str(args.port + 1), "--worker-metrics-port", str(args.port + 2),
    ]  # fmt: skip
    with tempfile.TemporaryFile("w+") as log:
        server = subprocess.Popen(command, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
        try:
            with httpx.Client(timeout=600) as client:
                deadline = time.monotonic() + 300
                while True:
                    try:
                        if client.get(f"{base_url}/health").status_code == 200:
                            break
                    except httpx.HTTPError:
                        pass
                    if time.monotonic() > deadline or server.poll() is not None:
                        log.seek(0)
                        sys.exit(f"the server did not start:\n{log.read()[-2000:]}")
                    time.sleep(0.5)
                conversation(client, base_url, args, seed=-1, continued=True)  # warm-up
                ways: dict[str, list[list[float]]] = {"continued": [], "whole": []}
                for seed in range(args.conversations):
                    for way in ("continued", "whole") if seed % 2 == 0 else ("whole", "continued"):
                        # Each way its own questions: neither finds the other's blocks in the prefix cache.
                        own_seed = seed if way == "continued" else seed + 1000
                        ways[way].append(conversation(client, base_url, args, own_seed, way == "continued"))
        finally:
            server.terminate()
            server.wait(60)
    turns = [
        {
            "turn": turn + 1,
            **{f"{way}_ms": round(1e3 * statistics.median(c[turn] for c in runs), 1) for way, runs in ways.items()},
        }
        for turn in range(args.turns)
    ]
    print(f"{'turn':>5} {'continued (ms)':>15} {'whole (ms)':>11}")
    for row in turns:
        print(f"{row['turn']:>5} {row['continued_ms']:>15.1f} {row['whole_ms']:>11.1f}")
    result = {
        "machine": cpu_model(),
        "commit": commit(),
        "date": time.strftime("%Y-%m-%d"),
        "model": Path(args.model).name,
        "settings": {k: v for k, v in vars(args).items() if k not in ("out", "port")},
        "median_ttft_by_turn": turns,
    }
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
