"""Attacks on a running server, as a hostile client would make them: each costs its own request a
4xx at most, while another client keeps streaming and the services' memory stays bounded.

Margins are generous (a loaded 2-core runner); what each bound would have been before the defence
is in the comments."""

from __future__ import annotations

import json
import threading
import time

import httpx
import pytest

from tests.conftest import children, memory_mib, serve, wait_until

pytestmark = pytest.mark.slow  # starts processes: not in `make check`

MAX_NUM_SEQS = 8


@pytest.fixture(scope="module")
def server(llama_dir, tmp_path_factory):
    with serve(llama_dir, str(tmp_path_factory.mktemp("attacks")), "--max-num-seqs", str(MAX_NUM_SEQS)) as running:
        yield running


def _completion(server, **fields) -> httpx.Response:
    body = {"model": server.model, "prompt": "import os", "max_tokens": 4} | fields
    return httpx.post(f"{server.base_url}/v1/completions", json=body, timeout=300)


def _time_to_first_token(server, max_tokens: int = 8) -> float:
    started = time.monotonic()
    body = {
        "model": server.model,
        "prompt": "def f(x):",
        "max_tokens": max_tokens,
        "stream": True,
        "ignore_eos": True,
        "temperature": 0,
    }
    with httpx.stream("POST", f"{server.base_url}/v1/completions", json=body, timeout=300) as response:
        assert response.status_code == 200
        for line in response.iter_lines():
            if line.startswith("data: {"):
                return time.monotonic() - started
    raise AssertionError("no token came")


# --- batches of prompts --------------------------------------------------------------------------


def test_a_batch_over_the_prompt_limit_is_refused_whole_before_anything_is_queued(server):
    response = _completion(server, prompt=["x"] * 2049)
    assert response.status_code == 400
    assert response.json()["error"]["code"] == "too_many_prompts"
    assert "2048" in response.json()["error"]["message"]
    assert server.is_idle()


def test_a_large_batch_takes_turns_with_another_clients_request(server):
    """2,048 prompts queued at once would put another client behind all of them (hundreds of steps);
    a batch keeps only what one step can run at the scheduler."""
    batch_done = threading.Event()
    batch_status: list[int] = []
    batch_chunks = [0]

    def batch():
        body = {"model": server.model, "prompt": ["x"] * 2048, "max_tokens": 16, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", f"{server.base_url}/v1/completions", json=body, timeout=300) as response:
            batch_status.append(response.status_code)
            for line in response.iter_lines():
                batch_chunks[0] += line.startswith("data: {")
                if batch_done.is_set():
                    break  # closing the stream aborts what is left of the batch

    api = children(server.process.pid)["api"]
    before = memory_mib(api)
    thread = threading.Thread(target=batch)
    thread.start()
    try:
        assert wait_until(lambda: batch_chunks[0] >= 8, 60)  # the batch is running
        waits = [_time_to_first_token(server) for _ in range(3)]
    finally:
        batch_done.set()
        thread.join(120)
    assert batch_status == [200]
    # Behind the whole batch: 2,048 x 16 tokens at 8 sequences a step, 4,096 steps.
    assert max(waits) < 5.0, waits
    assert wait_until(server.is_idle, 60)  # the aborted rest freed its blocks
    assert memory_mib(api) < before + 150, (before, memory_mib(api))


def test_another_client_is_answered_while_a_batch_is_refused_and_aborted_repeatedly(server):
    """Many large batches, each cut by its client: every abort reaches the scheduler, none is lost."""

    def cut_batch():
        body = {"model": server.model, "prompt": ["x"] * 2048, "max_tokens": 64, "stream": True}
        with httpx.stream("POST", f"{server.base_url}/v1/completions", json=body, timeout=300) as response:
            next(response.iter_lines())

    threads = [threading.Thread(target=cut_batch) for _ in range(6)]
    for thread in threads:
        thread.start()
    answered = _completion(server, max_tokens=4)
    for thread in threads:
        thread.join(120)
    assert answered.status_code == 200
    assert wait_until(server.is_idle, 60)


def test_a_batch_answers_every_prompt(server):
    response = _completion(server, prompt=[f"p{i}" for i in range(40)], max_tokens=2, ignore_eos=True)
    assert response.status_code == 200
    choices = response.json()["choices"]
    assert sorted(c["index"] for c in choices) == list(range(40))
    assert all(c["finish_reason"] == "length" for c in choices)
    assert json.loads(response.text)["usage"]["completion_tokens"] == 80


# --- requests that would hold the api's event loop --------------------------------------------------


class HealthProbe:
    """/health asked over and over on a thread: how long the api's loop kept it waiting."""

    def __init__(self, server):
        self.base = server.base_url
        self.latencies: list[float] = []
        self.done = threading.Event()
        self.thread = threading.Thread(target=self._probe)

    def _probe(self):
        with httpx.Client(timeout=60) as client:
            while not self.done.is_set():
                started = time.monotonic()
                assert client.get(f"{self.base}/health").status_code == 200
                self.latencies.append(time.monotonic() - started)
                self.done.wait(0.02)

    def __enter__(self):
        self.thread.start()
        assert wait_until(lambda: self.latencies, 30)
        return self

    def __exit__(self, *exc):
        self.done.set()
        self.thread.join(60)


def test_a_flood_of_stop_strings_is_refused_and_the_most_allowed_cost_the_loop_little(server):
    flood = _completion(server, stop=[f"s{i}" for i in range(100_000)], n=2)
    assert flood.status_code == 400 and flood.json()["error"]["param"] == "stop"
    # The most a request may send: 256 strings of 256 characters, that never match, on every choice.
    stops = [f"{i:03d}" + "\x07" * 253 for i in range(256)]
    with HealthProbe(server) as probe:
        body = {
            "model": server.model,
            "prompt": "import os",
            "max_tokens": 200,
            "n": MAX_NUM_SEQS,
            "stop": stops,
            "ignore_eos": True,
            "stream": True,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True},
        }
        events = 0
        with httpx.stream("POST", f"{server.base_url}/v1/completions", json=body, timeout=300) as response:
            assert response.status_code == 200
            for line in response.iter_lines():
                events += line.startswith("data: {")
    assert events >= MAX_NUM_SEQS * 200 // 4  # it streamed
    # 100,000 stop strings with n=16 held /health for 9.1 s; a loaded two-core machine alone delays it by 0.3 s.
    assert max(probe.latencies) < 1.0, max(probe.latencies)


def test_a_response_of_megabytes_keeps_health_answering_within_a_second(server):
    with HealthProbe(server) as probe:
        response = _completion(
            server,
            prompt=[f"p{i}" for i in range(16)],
            n=MAX_NUM_SEQS,
            max_tokens=240,
            logprobs=20,
            ignore_eos=True,
            temperature=1.0,
        )
    print(f"{len(response.content) / 1e6:.1f} MB; /health at worst {max(probe.latencies):.3f} s")
    assert response.status_code == 200 and len(response.content) > 10 << 20, len(response.content)
    # Built on the loop, a 5 MB one held /health for 2.7 s; encoded whole on a thread, a 35 MB one still held it
    # for about 1 s (one json.dumps call keeps the interpreter); in pieces, the loop waits for one piece at most
    # (tests/test_large_json.py: a 35 MB body's largest piece, a millisecond or two). The bound leaves room for
    # the 0.3 s a loaded two-core machine alone adds.
    assert max(probe.latencies) < 1.0, max(probe.latencies)
