"""Data parallelism: several engines behind one api (`--data-parallel-size`), each request routed
to one of them; an engine that dies fails only its own requests, and serves again once back."""

import json
import os
import signal
import threading

import httpx
import pytest
from transformers import AutoTokenizer

from tests.conftest import free_port, parse_metrics, serve, wait_until
from tests.test_end_to_end import MAX_TOKENS, prompts
from tests.test_resilience import start, wait_healthy
from tests.tiny_models import hf_greedy

pytestmark = pytest.mark.slow  # starts processes: not in `make check`

ENGINES = 2


@pytest.fixture(scope="module")
def two_engines(llama_dir, tmp_path_factory):
    """`pagedserve up --data-parallel-size 2` with prefix caching; engine i's scheduler serves its
    metrics on the base port + 10 i."""
    port = free_port(span=12)  # the scheduler's and worker's metrics ports of engines 0 and 1: +0, +1, +10, +11
    flags = [
        "--data-parallel-size",
        str(ENGINES),
        "--enable-prefix-caching",
        "--scheduler-metrics-port",
        str(port),
        "--worker-metrics-port",
        str(port + 1),
    ]
    with serve(llama_dir, str(tmp_path_factory.mktemp("dp")), *flags) as server:
        # serve() returns once /health answers 200, which it does while either engine serves
        assert wait_until(lambda: httpx.get(f"{server.base_url}/health").json()["status"] == "ok", 60)
        server.scheduler_metrics = [f"http://127.0.0.1:{port + 10 * engine}/metrics" for engine in range(ENGINES)]
        yield server


def routed(server) -> list[float]:
    metrics = server.metrics("api")
    return [metrics[f'pagedserve_engine_routed_requests_total{{engine="{engine}"}}'] for engine in range(ENGINES)]


def load(server) -> dict[str, float]:
    """The api's view of each engine's load, as the router weighs it."""
    metrics = server.metrics("api")
    return {
        f"{kind} {engine}": metrics[f'pagedserve_engine_requests_{kind}{{engine="{engine}"}}']
        for kind in ("in_flight", "running", "waiting")
        for engine in range(ENGINES)
    }


def prefix_hits(server, engine: int) -> float:
    return parse_metrics(httpx.get(server.scheduler_metrics[engine], timeout=10).text)[
        "pagedserve_prefix_cache_hits_total"
    ]


def test_greedy_output_through_two_engines_equals_hf_generate(two_engines, llama_dir):
    prompt_ids = prompts(llama_dir)
    before = routed(two_engines)
    # One batch request: all eight are in flight at once, so the short ones spread by load.
    body = {
        "model": two_engines.model,
        "prompt": prompt_ids,
        "max_tokens": MAX_TOKENS,
        "temperature": 0,
        "return_token_ids": True,
    }
    response = httpx.post(f"{two_engines.base_url}/v1/completions", json=body, timeout=120)
    response.raise_for_status()
    got = [c["token_ids"] for c in sorted(response.json()["choices"], key=lambda c: c["index"])]
    assert got == [hf_greedy(llama_dir, p, MAX_TOKENS) for p in prompt_ids]
    sent = [after - first for after, first in zip(routed(two_engines), before)]
    assert sum(sent) == len(prompt_ids) and min(sent) >= 1, f"both engines should have served: {sent}"


def test_health_counts_the_engines_up(two_engines):
    assert httpx.get(f"{two_engines.base_url}/health").json() == {"status": "ok", "engines_up": 2, "engines": 2}


def test_requests_sharing_a_prefix_go_to_the_engine_that_caches_it(two_engines, llama_dir):
    tokenizer = AutoTokenizer.from_pretrained(llama_dir)
    system = tokenizer.encode("You are a careful assistant who answers in Python. " * 12)
    assert len(system) >= 8 * 16  # the routing key covers the first eight blocks
    before, hits = routed(two_engines), [prefix_hits(two_engines, engine) for engine in range(ENGINES)]
    for suffix in range(6):
        body = {
            "model": two_engines.model,
            "prompt": system + tokenizer.encode(f" question {suffix}:"),
            "max_tokens": 2,
            "temperature": 0,
        }
        httpx.post(f"{two_engines.base_url}/v1/completions", json=body, timeout=60).raise_for_status()
    sent = [after - first for after, first in zip(routed(two_engines), before)]
    holder = sent.index(max(sent))
    assert sorted(sent) == [0, 6], f"all six should go to one engine: {sent}"
    gained = [prefix_hits(two_engines, engine) - hits[engine] for engine in range(ENGINES)]
    assert gained[holder] >= 5 * (len(system) // 16) * 16  # every request after the first found the prefix cached
    assert gained[1 - holder] == 0


def test_the_launcher_starts_a_dead_engine_again_while_the_other_serves(two_engines):
    scheduler = engine_process(two_engines.process.pid, "services.scheduler", "scheduler-1.sock")
    os.kill(scheduler, signal.SIGKILL)
    # the api learns of the loss from its socket, a moment later; a request sent before that would be engine 1's
    wait_until(lambda: two_engines.metrics("api")['pagedserve_engine_up{engine="1"}'] == 0, 5, 0.05)
    body = {"model": two_engines.model, "prompt": "import os", "max_tokens": 4, "temperature": 0}
    meanwhile = httpx.post(f"{two_engines.base_url}/v1/completions", json=body, timeout=60)
    assert meanwhile.status_code == 200  # engine 0 took it
    assert wait_until(lambda: "restarting engine 1" in two_engines.log(), 10)
    assert wait_until(lambda: httpx.get(f"{two_engines.base_url}/health").json()["engines_up"] == 2, 60)
    assert engine_process(two_engines.process.pid, "services.scheduler", "scheduler-1.sock") != scheduler
    # Both idle as the api sees them (nothing of its own in flight, nothing in either engine's last report), a
    # prompt no engine holds goes by the rendezvous order of its first block: of distinct prompts sent one after
    # another, each goes to engine 1 half the time.
    assert wait_until(lambda: not any(load(two_engines).values()), 30), load(two_engines)
    before = routed(two_engines)
    for attempt in range(24):
        fresh = {**body, "prompt": " ".join(f"w{attempt}x{word}" for word in range(24))}
        answer = httpx.post(f"{two_engines.base_url}/v1/completions", json=fresh, timeout=60)
        assert answer.status_code == 200
        if routed(two_engines)[1] > before[1]:
            break
    assert routed(two_engines)[1] > before[1], (load(two_engines), two_engines.log()[-3000:])


def engine_process(launcher: int, module: str, endpoint_part: str) -> int:
    """The pid of the launcher's child running `module` whose command line names `endpoint_part`."""
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmdline = f.read().decode().split("\0")
            with open(f"/proc/{pid}/stat") as f:
                parent = int(f.read().rsplit(")", 1)[1].split()[1])
        except OSError:
            continue
        if parent == launcher and module in cmdline and any(endpoint_part in arg for arg in cmdline):
            return int(pid)
    raise AssertionError(f"no {module} with {endpoint_part} under the launcher")


def test_a_killed_engine_fails_only_its_own_requests_and_a_restarted_one_serves_again(llama_dir, tmp_path, socket_dir):
    """The services run alone, as deployed across hosts: nothing restarts the killed engine but the test."""
    endpoints = [
        (f"ipc://{socket_dir}/scheduler-{i}.sock", f"ipc://{socket_dir}/workers-{i}.sock") for i in range(ENGINES)
    ]

    def engine(i: int, attempt: int) -> list:
        scheduler, workers = endpoints[i]
        return [
            start(
                "services.scheduler",
                "--scheduler-endpoint",
                scheduler,
                "--worker-endpoint",
                workers,
                "--metrics-port",
                "0",
                log=str(tmp_path / f"scheduler{i}-{attempt}.log"),
            ),
            start(
                "services.worker",
                "--model",
                llama_dir,
                "--worker-endpoint",
                workers,
                "--device",
                "cpu",
                "--kv-cache-memory",
                "0.05",
                "--swap-space",
                "0.05",
                "--metrics-port",
                "0",
                log=str(tmp_path / f"worker{i}-{attempt}.log"),
            ),
        ]

    port = free_port()
    engines = [engine(i, 0) for i in range(ENGINES)]
    api = start(
        "services.api",
        "--model",
        llama_dir,
        "--port",
        str(port),
        "--routing",
        "least_load",
        "--scheduler-endpoint",
        ",".join(scheduler for scheduler, _ in endpoints),
        log=str(tmp_path / "api.log"),
    )
    base, model = f"http://127.0.0.1:{port}", os.path.basename(llama_dir)
    try:
        wait_healthy(f"{base}/health")
        assert wait_until(lambda: httpx.get(f"{base}/health").json()["status"] == "ok", 60)
        on_engine: list[float] = []
        for _ in range(3):  # on a loaded machine one engine may end its streams before the other's first token
            streams = [Stream(base, model) for _ in range(4)]
            assert wait_until(lambda streams=streams: all(s.first_token.is_set() for s in streams), 60)
            in_flight = parse_metrics(httpx.get(f"{base}/metrics").text)
            on_engine = [in_flight[f'pagedserve_engine_requests_in_flight{{engine="{i}"}}'] for i in range(ENGINES)]
            if on_engine == [2, 2]:
                break
            for stream in streams:
                stream.thread.join(60)
        assert on_engine == [2, 2]  # least_load spreads them
        for process in engines[1]:
            process.kill()
        for stream in streams:
            stream.thread.join(60)
        outcomes = sorted(s.outcome for s in streams)
        assert outcomes == ["error", "error", "length", "length"], outcomes
        assert all("went away" in s.error for s in streams if s.outcome == "error")

        health = httpx.get(f"{base}/health")
        assert health.status_code == 200 and health.json() == {"status": "degraded", "engines_up": 1, "engines": 2}
        body = {"model": model, "prompt": "import os", "max_tokens": 3}
        assert [httpx.post(f"{base}/v1/completions", json=body, timeout=60).status_code for _ in range(3)] == [
            200
        ] * 3  # the other engine takes every new request

        engines.append(engine(1, 1))
        assert wait_until(lambda: httpx.get(f"{base}/health").json()["status"] == "ok", 60)
        routed_to: dict[str, float] = {}
        for _ in range(3):  # as above: on a loaded machine a stream can end before the next one is routed
            again = [Stream(base, model, max_tokens=64) for _ in range(4)]
            for stream in again:
                stream.thread.join(60)
            assert [s.outcome for s in again] == ["length"] * 4
            routed_to = parse_metrics(httpx.get(f"{base}/metrics").text)
            if routed_to['pagedserve_engine_routed_requests_total{engine="1"}'] >= 3:
                break
        # 2 before, some after
        assert routed_to['pagedserve_engine_routed_requests_total{engine="1"}'] >= 3, (
            routed_to,
            (tmp_path / "api.log").read_text()[-3000:],
        )
    finally:
        for process in [api, *(p for pair in engines for p in pair)]:
            process.kill()
            process.wait()


class Stream:
    """A streamed completion in a thread of its own: its first token, and how it ended."""

    def __init__(self, base: str, model: str, max_tokens: int = 400):
        self.body = {
            "model": model,
            "prompt": "def f(x):",
            "max_tokens": max_tokens,
            "ignore_eos": True,
            "temperature": 0,
            "stream": True,
        }
        self.base, self.first_token = base, threading.Event()
        self.outcome, self.error = None, ""
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        with httpx.stream("POST", f"{self.base}/v1/completions", json=self.body, timeout=120) as response:
            for line in response.iter_lines():
                if not line.startswith("data: {"):
                    continue
                event = json.loads(line[len("data: ") :])
                if "error" in event:
                    self.outcome, self.error = "error", event["error"]["message"]
                    return
                self.first_token.set()
                reason = event["choices"][0]["finish_reason"]
                if reason:
                    self.outcome = reason
