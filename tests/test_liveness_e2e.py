"""Liveness through the three processes: rejections before a stream starts, a hung worker, a hung
scheduler, a huge prompt, and an api peer that stops reading."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import threading
import time

import httpx
import msgpack
import pytest
import zmq

from services.scheduler.quarantine import MAX_FAILURES
from services.scheduler.server import SchedulerServer
from shared import sockets
from shared.config import Endpoints, SchedulerConfig
from shared.log_limits import RateLimit
from shared.protocol import (
    PROTOCOL_VERSION,
    AddRequest,
    Hello,
    Ping,
    Ready,
    RequestOutputs,
    SampledTokens,
    SchedulerInfo,
    Shutdown,
    Step,
    StepResult,
)
from shared.sampling import SamplingParams
from tests.conftest import children, memory_mib, serve, wait_until
from tests.scheduler_harness import StandInWorker

pytestmark = pytest.mark.slow  # starts processes: not in `make check`
# The longest pause a stream may show while a large body is handled: its tokens come every few tens of
# milliseconds, and work held on the api's loop (parsing megabytes) would stall it for seconds.
MAX_GAP = 1.0


@pytest.fixture(scope="module")
def small_server(llama_dir, tmp_path_factory):
    flags = (
        "--num-gpu-blocks-override",
        "40",
        "--step-timeout",
        "3",
        "--scheduler-timeout",
        "2",
        "--request-header-timeout",
        "2",
        "--request-body-timeout",
        "3",
    )
    with serve(llama_dir, str(tmp_path_factory.mktemp("logs")), *flags) as server:
        yield server


def _health(base: str) -> int:
    try:
        return httpx.get(f"{base}/health", timeout=2).status_code
    except httpx.HTTPError:
        return 0


def test_a_request_the_scheduler_rejects_gets_a_4xx_before_its_stream_starts(small_server):
    body = {"model": small_server.model, "prompt": "import os", "n": 2, "max_tokens": 400, "stream": True}
    response = httpx.post(f"{small_server.base_url}/v1/completions", json=body, timeout=60)
    assert response.status_code == 400
    assert "KV blocks" in response.json()["error"]["message"]


def _stream_gaps(server, until: threading.Event, max_tokens: int) -> tuple[threading.Thread, list[float]]:
    """A greedy stream on a thread, and the gaps between its chunks until `until` is set."""
    gaps: list[float] = []

    def stream():  # one stream after another, so the gaps cover everything until `until`
        body = {
            "model": server.model,
            "prompt": "import os",
            "max_tokens": max_tokens,
            "ignore_eos": True,
            "temperature": 0,
            "stream": True,
        }
        while not until.is_set():
            last = None
            with httpx.stream("POST", f"{server.base_url}/v1/completions", json=body, timeout=120) as response:
                for line in response.iter_lines():
                    if line.startswith("data: {"):
                        now = time.monotonic()
                        if last is not None and not until.is_set():
                            gaps.append(now - last)
                        last = now

    streamer = threading.Thread(target=stream)
    streamer.start()
    assert wait_until(lambda: len(gaps) >= 2, 60), "the stream never started"
    return streamer, gaps


def test_a_huge_prompt_is_refused_untokenized_and_neither_stalls_streams_nor_health(small_server):
    base = small_server.base_url
    health_latencies: list[float] = []
    huge_done = threading.Event()

    def huge():
        prompt = "def f(x):\n    return x + 1\n" * 190_000  # about 5 MB
        response = httpx.post(
            f"{base}/v1/completions", timeout=300, json={"model": small_server.model, "prompt": prompt, "max_tokens": 1}
        )
        huge_done.set()
        assert response.status_code == 400 and response.json()["error"]["code"] == "context_length_exceeded"

    streamer, gaps = _stream_gaps(small_server, huge_done, 300)
    poster = threading.Thread(target=huge)
    poster.start()
    while not health_latencies or poster.is_alive():
        started = time.monotonic()
        assert _health(base) == 200
        health_latencies.append(time.monotonic() - started)
        poster.join(0.2)
    poster.join()
    streamer.join(120)
    assert huge_done.is_set() and health_latencies
    assert max(health_latencies) < 1.0
    assert gaps and max(gaps) < 1.0, f"the stream stalled for {max(gaps):.2f} s"


def _stop_mid_stream(server, service: str) -> tuple[str, float]:
    """SIGSTOP one of the server's processes while a stream runs (the caller sends SIGCONT): the
    stream's error message, and how long after the stop the stream ended."""
    body = {"model": server.model, "prompt": "import os", "max_tokens": 300, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", f"{server.base_url}/v1/completions", json=body, timeout=60) as response:
        lines = response.iter_lines()
        next(line for line in lines if line.startswith("data: {"))
        os.kill(children(server.process.pid)[service], signal.SIGSTOP)
        stopped = time.monotonic()
        rest = [line for line in lines if line.startswith("data:")]
        ended_after = time.monotonic() - stopped
    return json.loads(rest[-2][len("data: ") :])["error"]["message"], ended_after


def _serves_again(server, timeout: float) -> None:
    assert wait_until(lambda: _health(server.base_url) == 200, timeout)
    again = httpx.post(
        f"{server.base_url}/v1/completions",
        timeout=60,
        json={"model": server.model, "prompt": "import os", "max_tokens": 4},
    )
    assert again.status_code == 200 and again.json()["usage"]["completion_tokens"] == 4
    assert wait_until(server.is_idle, 5)  # the failed request's blocks came back


def test_a_hung_worker_fails_its_requests_within_the_step_timeout_and_recovery_follows(small_server):
    worker = children(small_server.process.pid)["worker"]
    try:
        error, ended_after = _stop_mid_stream(small_server, "worker")
        assert ended_after < 3 + 5 and "did not finish a step" in error
        assert _health(small_server.base_url) == 503
        refused = httpx.post(
            f"{small_server.base_url}/v1/completions", timeout=10, json={"model": small_server.model, "prompt": "x"}
        )
        assert refused.status_code == 503 and refused.json()["error"]["code"] == "not_ready"
    finally:
        os.kill(worker, signal.SIGCONT)
    _serves_again(small_server, 30)


def test_a_hung_scheduler_shows_on_health_and_fails_streams_within_its_timeout_then_service_resumes(small_server):
    scheduler = children(small_server.process.pid)["scheduler"]
    try:
        error, ended_after = _stop_mid_stream(small_server, "scheduler")
        print(
            f"a SIGSTOPped scheduler failed the stream and turned /health 503 after {ended_after:.2f} s "
            f"(--scheduler-timeout 2)"
        )
        assert ended_after < 2 + 1.5, f"the stream failed {ended_after:.1f} s after the scheduler stopped"
        assert "stopped answering" in error
        assert _health(small_server.base_url) == 503
    finally:
        os.kill(scheduler, signal.SIGCONT)
    _serves_again(small_server, 10)


@contextlib.contextmanager
def scheduler_in_process(
    tmp_path, config: SchedulerConfig, next_token=lambda seq_id, position: 100 + position, stand_in=None
):
    """A real scheduler loop on a thread, rank 0 a stand-in worker on another that answers every
    step at once (`stand_in`, or one sampling `next_token`), and keeps every other message it gets in
    `stand_in.received`: (server, endpoints, a zmq context for the test's own peers)."""
    stand_in = stand_in or StandInWorker(next_token)
    stand_in.received = []
    endpoints = Endpoints.local(str(tmp_path))
    server = SchedulerServer(config, endpoints)
    loop = threading.Thread(target=server.run, daemon=True)
    loop.start()
    context = zmq.Context()
    stop = threading.Event()

    def worker_loop():
        sock = sockets.connect(context, zmq.DEALER, endpoints.workers, identity=b"worker-0")
        sockets.send(sock, Ready(0, 1, 4096, 0, 4, config.max_model_len, [0], 1024, 1e9, 1e4, 1000))
        while not stop.is_set():
            if sock.poll(100):
                message = sockets.receive(sock)[1]
                if isinstance(message, Step):
                    sockets.send(sock, stand_in.run(message))
                else:
                    stand_in.received.append(message)
        sock.close()

    threading.Thread(target=worker_loop, daemon=True).start()
    try:
        yield server, endpoints, context
    finally:
        stop.set()
        server.stop()
        loop.join(timeout=5)
        context.destroy(linger=0)


def ready_api(context, endpoints, name: str) -> zmq.Socket:
    api = sockets.connect(context, zmq.DEALER, endpoints.scheduler, identity=name.encode())
    sockets.send(api, Hello(name))
    assert api.poll(10_000) and isinstance(sockets.receive(api)[1], SchedulerInfo)
    return api


def stream_of(api: zmq.Socket, timeout: float = 60) -> tuple[list[int], list[str | None], bool]:
    """One request's tokens, the errors of its outputs, and whether it finished."""
    tokens, errors, finished = [], [], False
    deadline = time.monotonic() + timeout
    while not finished and time.monotonic() < deadline:
        if api.poll(1000):
            message = sockets.receive(api)[1]
            if isinstance(message, RequestOutputs):
                for output in message.outputs:
                    errors.append(output.error)
                    tokens += output.sequences[0].token_ids if output.sequences else []
                    finished = output.finished
    return tokens, errors, finished


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)


def stuck_api(server, endpoints, context) -> zmq.Socket:
    """An api that will stop reading: its queues are as small as they go. Connected once the worker
    is ready, so that its requests run rather than being refused."""
    assert wait_until(lambda: server.scheduler is not None, 10)
    stuck = context.socket(zmq.DEALER)
    stuck.setsockopt(zmq.IDENTITY, b"api-stuck")
    stuck.setsockopt(zmq.RCVHWM, 1)
    stuck.setsockopt(zmq.RCVBUF, 4096)
    stuck.connect(endpoints.scheduler)
    return stuck


def test_an_api_that_stops_reading_loses_its_requests_and_nobody_else_notices(tmp_path):
    config = SchedulerConfig(block_size=4, max_model_len=100_000, api_send_queue=4)
    with scheduler_in_process(tmp_path, config, lambda seq_id, position: 100 + position % 800) as (
        server,
        endpoints,
        context,
    ):
        stuck = stuck_api(server, endpoints, context)
        good = ready_api(context, endpoints, "api-good")
        for i in range(4):
            sockets.send(stuck, AddRequest(f"stuck-{i}", [1, 2, 3], greedy(50_000), time.time()))

        def admitted() -> int:  # running, or already aborted for the api's not reading: a fast worker cuts it off
            running = {r for r in list(server.scheduler.requests) if r.startswith("stuck")}
            return len(running | set(server.cut_off.get(b"api-stuck", [])))

        assert wait_until(lambda: admitted() == 4, 30, 0.01)
        sockets.send(good, AddRequest("good", [1, 2, 3], greedy(300), time.time()))
        tokens, errors, finished = stream_of(good)
        assert finished and not any(errors) and tokens == [100 + p for p in range(3, 303)]
        assert wait_until(lambda: not any(r.startswith("stuck") for r in server.scheduler.requests), 30)
        assert server.scheduler.kv_cache.device_pool.num_referenced == 0


def test_an_api_cut_off_for_not_reading_learns_how_each_of_its_requests_ended_once_it_reads_again(tmp_path):
    config = SchedulerConfig(block_size=4, max_model_len=100_000, api_send_queue=4)
    with scheduler_in_process(tmp_path, config, lambda seq_id, position: 100 + position % 800) as (
        server,
        endpoints,
        context,
    ):
        stuck = stuck_api(server, endpoints, context)
        ids = [f"stuck-{i}" for i in range(4)] + ["short"]
        for request_id in ids[:4]:
            sockets.send(stuck, AddRequest(request_id, [1, 2, 3], greedy(50_000), time.time()))
        sockets.send(stuck, AddRequest("short", [1, 2, 3], greedy(2), time.time()))  # ends while it is cut off
        assert wait_until(lambda: b"api-stuck" in server.cut_off, 30)
        assert wait_until(lambda: not server.scheduler.requests, 30)

        ended: dict[str, str | None] = {}  # it reads again and pings, as the api's heartbeat does
        deadline = time.monotonic() + 30
        while set(ended) != set(ids) and time.monotonic() < deadline:
            sockets.send(stuck, Ping(time.time()))
            while stuck.poll(200):
                message = sockets.receive(stuck)[1]
                if isinstance(message, RequestOutputs):
                    ended.update({o.request_id: o.error for o in message.outputs if o.finished})
        assert set(ended) == set(ids)  # every request's final answer, none lost to the full queue
        assert all(error is None or "stopped reading" in error for error in ended.values())
        assert b"api-stuck" not in server.cut_off and b"api-stuck" in server.apis


def test_a_scheduler_busy_past_the_step_timeout_does_not_blame_a_worker_that_answered(tmp_path):
    """The loop stalls (as on a huge request) while a step is in flight; the worker's result came
    meanwhile, so the step counts as done in time and the stream goes on."""
    config = SchedulerConfig(block_size=4, max_model_len=10_000, step_timeout=1.0)
    with scheduler_in_process(tmp_path, config) as (server, endpoints, context):
        api = ready_api(context, endpoints, "api")
        sockets.send(api, AddRequest("r", [1, 2, 3], greedy(400), time.time()))
        assert api.poll(10_000)
        answer_hello = server.api_handlers[Hello]
        server.api_handlers[Hello] = lambda sender, message: time.sleep(2.5)  # the loop's own stall
        sockets.send(api, Hello("api"))
        tokens, errors, finished = stream_of(api)
        server.api_handlers[Hello] = answer_hello
        assert finished and not any(errors), errors
        assert len(tokens) == 400


class BrokenWorker(StandInWorker):
    """Fails every step and blames no request: a fault of its own, as a lost device would be."""

    def run(self, step):
        self.steps.append(step)
        return StepResult(step.step_id, [], 0.0, 0.0, error="RuntimeError: the device is lost")


def test_a_worker_failing_every_step_is_told_to_restart_and_every_request_ends_saying_why(tmp_path):
    """The halving search for a culprit is bounded: past MAX_FAILURES failed steps in a row the fault is the
    worker's, the requests left end saying it restarts, and the worker is told to exit for its supervisor to start
    it again (its exit status, EXIT_AT_FAULT, is tested with the worker)."""
    stand_in = BrokenWorker()
    with scheduler_in_process(tmp_path, SchedulerConfig(block_size=4, max_model_len=10_000), stand_in=stand_in) as (
        server,
        endpoints,
        context,
    ):
        api = ready_api(context, endpoints, "api")
        ids = [f"r{i}" for i in range(16)]
        for request_id in ids:
            sockets.send(api, AddRequest(request_id, [1, 2, 3], greedy(20), time.time()))
        ended: dict[str, str | None] = {}
        deadline = time.monotonic() + 30
        while set(ended) != set(ids) and time.monotonic() < deadline:
            if api.poll(200):
                message = sockets.receive(api)[1]
                if isinstance(message, RequestOutputs):
                    ended.update({o.request_id: o.error for o in message.outputs if o.finished})
        assert set(ended) == set(ids) and all(ended.values()), ended
        restarted = [rid for rid, error in ended.items() if "steps in a row and restarts" in (error or "")]
        assert len(restarted) > len(ids) // 2, ended  # the search stopped at its bound, not at the last request
        assert wait_until(lambda: Shutdown(restart=True) in stand_in.received, 10)
        assert len(stand_in.steps) <= 2 * (MAX_FAILURES + 1)  # bounded; with two in flight, one planned ahead
        assert wait_until(lambda: server.scheduler is None, 10)  # waiting for the ranks to report again


def test_a_large_frame_from_a_worker_peer_that_is_not_rank_0_is_dropped_unread(tmp_path, caplog, monkeypatch):
    monkeypatch.setattr(sockets.peer_log, "filters", [RateLimit()])  # earlier tests' lines do not count
    with scheduler_in_process(tmp_path, SchedulerConfig(block_size=4, max_model_len=10_000)) as (
        server,
        endpoints,
        context,
    ):
        assert wait_until(lambda: server.workers.get(0) is not None, 10)
        rogue = sockets.connect(context, zmq.DEALER, endpoints.workers, identity=b"rogue")
        sampled = [SampledTokens(i, [1] * 64, [0.0] * 64, [], []) for i in range(2_000)]
        sockets.send(rogue, StepResult(1, sampled, 0.0, 0.0))
        assert wait_until(lambda: "unread" in caplog.text, 10)
        assert "ignored a result" not in caplog.text  # never decoded, so never handled


def test_a_body_of_millions_of_empty_lists_is_refused_before_parsing_and_streams_go_on(small_server):
    base = small_server.base_url
    refused = threading.Event()
    streamer, gaps = _stream_gaps(small_server, refused, 200)
    bomb = b"[" + b"[]," * (7 * 2**20 // 3 - 1) + b"[]]"  # 7 MiB, 2.4 million arrays
    for path in ("/tokenize", "/v1/completions"):
        started = time.monotonic()
        response = httpx.post(f"{base}{path}", content=bomb, headers={"content-type": "application/json"}, timeout=60)
        assert response.status_code == 400 and response.json()["error"]["code"] == "too_many_containers", path
        assert time.monotonic() - started < 1.0
    refused.set()
    streamer.join(120)
    assert gaps and max(gaps) < MAX_GAP, f"the stream stalled for {max(gaps):.2f} s"


def test_large_json_bodies_are_parsed_and_checked_off_the_loop_so_streams_go_on(small_server):
    base = small_server.base_url
    done = threading.Event()
    ids = list(range(500)) * 3000  # 1.5 million token ids, 7.2 MB of JSON
    text = "def f(x):\n    return x + 1\n" * 260_000  # 7.0 MB
    bodies = [
        ("/v1/completions", {"model": small_server.model, "prompt": ids, "max_tokens": 1}, 400),
        ("/detokenize", {"tokens": ids}, 400),  # more than any context: refused, not decoded
        ("/detokenize", {"tokens": ids[:1000]}, 200),
        ("/tokenize", {"prompt": text}, 400),
    ]  # longer than any prompt that fits: refused untokenized
    api = children(small_server.process.pid)["api"]
    before = memory_mib(api)
    encoded = [(path, json.dumps(body).encode(), status) for path, body, status in bodies]  # not while streaming
    streamer, gaps = _stream_gaps(small_server, done, 300)
    for _ in range(3):
        for path, body, status in encoded:
            response = httpx.post(
                f"{base}{path}", content=body, headers={"content-type": "application/json"}, timeout=120
            )
            assert response.status_code == status, (path, response.text[:300])
    done.set()
    streamer.join(120)
    after, peak = memory_mib(api), memory_mib(api, "VmHWM")
    print(
        f"longest stream gap while 8 MB bodies were parsed: {max(gaps):.3f} s; api memory {before:.0f} MiB "
        f"before, {peak:.0f} at its peak, {after:.0f} after"
    )
    assert gaps and max(gaps) < MAX_GAP, f"the stream stalled for {max(gaps):.2f} s"
    assert after - before < 64  # what nine large bodies took is mostly given back, not kept per request


def _closed_within(sock: socket.socket, seconds: float, drip: bytes) -> float | None:
    """Send `drip` a byte every 0.2 s; when the server closes the connection, how long it took."""
    started = time.monotonic()
    sock.settimeout(0.2)
    while time.monotonic() - started < seconds:
        try:
            if sock.recv(4096) == b"":
                return time.monotonic() - started
        except TimeoutError:
            pass
        except ConnectionError:
            return time.monotonic() - started
        try:
            sock.sendall(drip[:1] or b"x")
            drip = drip[1:]
        except OSError:
            return time.monotonic() - started
    return None


def test_a_client_dripping_its_headers_or_its_body_is_cut_off_and_streams_go_on(small_server):
    host, port = small_server.base_url.removeprefix("http://").split(":")
    done = threading.Event()
    streamer, gaps = _stream_gaps(small_server, done, 200)
    slowloris = [socket.create_connection((host, int(port))) for _ in range(8)]
    for sock in slowloris:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")
    closed = [_closed_within(sock, 10, b"X-Slow: " + b"a" * 100) for sock in slowloris]
    assert all(c is not None and c < 2 + 1.5 for c in closed), closed  # --request-header-timeout 2
    with socket.create_connection((host, int(port))) as slow_body:
        slow_body.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b'Content-Length: 400\r\n\r\n{"prompt": "'
        )
        slow_body.settimeout(10)
        started, answer = time.monotonic(), b""
        while b"\r\n\r\n" not in answer:
            answer += slow_body.recv(4096)
        assert answer.startswith(b"HTTP/1.1 408"), answer[:200]
        assert time.monotonic() - started < 3 + 1.5  # --request-body-timeout 3
    done.set()
    streamer.join(120)
    assert gaps and max(gaps) < MAX_GAP, f"the stream stalled for {max(gaps):.2f} s"
    assert httpx.get(f"{small_server.base_url}/health", timeout=5).status_code == 200


def test_lines_about_bad_frames_are_rate_limited_and_the_scheduler_keeps_answering(tmp_path, caplog, monkeypatch):
    monkeypatch.setattr(sockets.peer_log, "filters", [RateLimit(burst=10, window=60)])
    with scheduler_in_process(tmp_path, SchedulerConfig(block_size=4, max_model_len=1_000)) as (
        server,
        endpoints,
        context,
    ):
        assert wait_until(lambda: server.workers.get(0) is not None, 10)
        api = sockets.connect(context, zmq.DEALER, endpoints.scheduler, identity=b"noisy-api")
        for i in range(500):
            api.send(msgpack.packb([PROTOCOL_VERSION, "Abort", ["r", i]]))  # an id that is no string
        sockets.send(api, Hello("noisy-api"))
        assert api.poll(10_000) and isinstance(sockets.receive(api)[1], SchedulerInfo)
        lines = [r for r in caplog.records if r.name == "pagedserve.peers"]
        print(f"500 malformed frames: {len(lines)} log lines")
        assert 1 <= len(lines) <= 10
        api.close()
