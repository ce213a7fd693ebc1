"""Services run alone (as deployed) and survive a worker that dies: requests fail, not hang."""

import json
import os
import subprocess
import sys
import threading
import time

import httpx
import pytest
import zmq

from services.scheduler.server import SchedulerServer
from shared import sockets
from shared.cli import EXIT_AT_FAULT
from shared.config import Endpoints, SchedulerConfig
from shared.protocol import AddRequest, Hello, Ready, SampledTokens, SchedulerInfo, Shutdown, Step, StepResult
from shared.sampling import SamplingParams
from tests.conftest import ROOT, free_port, wait_until

pytestmark = pytest.mark.slow  # starts processes: not in `make check`


def start(*args: str, log: str) -> subprocess.Popen:
    """A service as `python -m`; a scheduler or worker without a --metrics-port serves none, so that
    one left over from another test cannot hold the default port and stop this one starting."""
    command = [sys.executable, "-m", *args]
    if args[0] in ("services.scheduler", "services.worker") and "--metrics-port" not in args:
        command += ["--metrics-port", "0"]
    with open(log, "w") as out:
        return subprocess.Popen(command, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT)


def healthy(url: str) -> bool:
    try:
        return httpx.get(url, timeout=1).status_code == 200
    except httpx.HTTPError:
        return False


def wait_healthy(url: str, timeout: float = 120) -> None:
    assert wait_until(lambda: healthy(url), timeout, 0.3), f"{url} not healthy in time"


def test_a_dead_worker_fails_requests_and_a_restarted_one_serves_again(llama_dir, tmp_path, socket_dir):
    sockets = socket_dir
    scheduler_ep, worker_ep = f"ipc://{sockets}/scheduler.sock", f"ipc://{sockets}/workers.sock"
    port = free_port()
    worker_args = (
        "services.worker",
        "--model",
        llama_dir,
        "--worker-endpoint",
        worker_ep,
        "--device",
        "cpu",
        "--kv-cache-memory",
        "0.05",
        "--swap-space",
        "0.05",
    )
    processes = [
        start(
            "services.scheduler",
            "--scheduler-endpoint",
            scheduler_ep,
            "--worker-endpoint",
            worker_ep,
            log=str(tmp_path / "scheduler.log"),
        ),
        start(*worker_args, log=str(tmp_path / "worker1.log")),
        start(
            "services.api",
            "--model",
            llama_dir,
            "--scheduler-endpoint",
            scheduler_ep,
            "--port",
            str(port),
            log=str(tmp_path / "api.log"),
        ),
    ]
    base = f"http://127.0.0.1:{port}"
    model = os.path.basename(llama_dir)
    long_request = {
        "model": model,
        "prompt": "import os",
        "max_tokens": 500,
        "ignore_eos": True,
        "temperature": 0,
        "stream": True,
    }
    try:
        wait_healthy(f"{base}/health")
        started = time.monotonic()
        with httpx.stream("POST", f"{base}/v1/completions", json=long_request, timeout=60) as response:
            lines = response.iter_lines()
            first = next(line for line in lines if line.startswith("data: {"))
            processes[1].kill()  # the worker dies mid-request
            rest = [line for line in lines if line.startswith("data:")]
        assert time.monotonic() - started < 30, "the request hung after its worker died"
        assert rest[-1] == "data: [DONE]"
        error = json.loads(rest[-2][len("data: ") :])["error"]
        assert "worker" in error["message"] and error["type"] == "server_error"
        assert len(rest) + 1 < 500  # it ended early, with an error rather than all its tokens
        assert first
        lost_health = httpx.get(f"{base}/health", timeout=5)
        assert (
            lost_health.status_code == 503 and lost_health.json()["status"] == "unavailable"
        )  # until a worker is back
        lost = httpx.post(f"{base}/v1/completions", timeout=10, json={"model": model, "prompt": "x"})
        assert lost.status_code == 503 and lost.json()["error"]["code"] == "not_ready"

        processes.append(start(*worker_args, log=str(tmp_path / "worker2.log")))
        answers: list[httpx.Response] = []

        def served_again() -> bool:
            answers.append(
                httpx.post(
                    f"{base}/v1/completions", timeout=60, json={"model": model, "prompt": "import os", "max_tokens": 4}
                )
            )
            return answers[-1].status_code == 200

        assert wait_until(served_again, 60, 0.5), answers[-1].text
        assert answers[-1].json()["usage"]["completion_tokens"] >= 1
        # Its OpenMP threads sleep when idle rather than spin on the kernel threads' cores.
        assert "OMP_WAIT_POLICY=PASSIVE" in (tmp_path / "worker2.log").read_text()
    finally:
        for process in processes:
            process.kill()
            process.wait()


def test_a_dead_scheduler_fails_requests_and_a_restarted_one_is_found_again(llama_dir, tmp_path, socket_dir):
    sockets = socket_dir
    scheduler_ep, worker_ep = f"ipc://{sockets}/scheduler.sock", f"ipc://{sockets}/workers.sock"
    port = free_port()
    scheduler_args = ("services.scheduler", "--scheduler-endpoint", scheduler_ep, "--worker-endpoint", worker_ep)
    processes = [
        start(*scheduler_args, log=str(tmp_path / "scheduler1.log")),
        start(
            "services.worker",
            "--model",
            llama_dir,
            "--worker-endpoint",
            worker_ep,
            "--device",
            "cpu",
            "--kv-cache-memory",
            "0.05",
            "--swap-space",
            "0.05",
            log=str(tmp_path / "worker.log"),
        ),
        start(
            "services.api",
            "--model",
            llama_dir,
            "--scheduler-endpoint",
            scheduler_ep,
            "--port",
            str(port),
            log=str(tmp_path / "api.log"),
        ),
    ]
    base = f"http://127.0.0.1:{port}"
    model = os.path.basename(llama_dir)
    try:
        wait_healthy(f"{base}/health")
        body = {"model": model, "prompt": "import os", "max_tokens": 500, "ignore_eos": True, "stream": True}
        started = time.monotonic()
        with httpx.stream("POST", f"{base}/v1/completions", json=body, timeout=60) as response:
            lines = response.iter_lines()
            next(line for line in lines if line.startswith("data: {"))
            processes[0].kill()  # the scheduler dies mid-request
            rest = [line for line in lines if line.startswith("data:")]
        assert time.monotonic() - started < 30
        assert "scheduler" in json.loads(rest[-2][len("data: ") :])["error"]["message"]
        assert httpx.get(f"{base}/health").status_code == 503
        meanwhile = httpx.post(f"{base}/v1/completions", timeout=10, json={"model": model, "prompt": "x"})
        assert meanwhile.status_code == 503 and meanwhile.json()["error"]["code"] == "not_ready"

        processes.append(start(*scheduler_args, log=str(tmp_path / "scheduler2.log")))
        wait_healthy(f"{base}/health", timeout=60)  # the worker and the api found it again
        again = httpx.post(f"{base}/v1/completions", timeout=60, json={"model": model, "prompt": "x", "max_tokens": 3})
        assert again.status_code == 200 and again.json()["usage"]["completion_tokens"] >= 1
    finally:
        for process in processes:
            process.kill()
            process.wait()


def test_a_result_left_over_from_a_previous_scheduler_is_ignored(tmp_path):
    """A worker's socket keeps what it queued for a scheduler that died and hands it to the next."""
    endpoints = Endpoints.local(str(tmp_path))
    server = SchedulerServer(SchedulerConfig(block_size=4), endpoints)
    loop = threading.Thread(target=server.run, daemon=True)
    loop.start()
    context = zmq.Context()
    worker = sockets.connect(context, zmq.DEALER, endpoints.workers, identity=b"worker-0")
    api = sockets.connect(context, zmq.DEALER, endpoints.scheduler, identity=b"api-test")
    try:
        sockets.send(worker, StepResult(0, [SampledTokens(0, [5], [-0.1], [], [])], 1.0, 1.0))
        sockets.send(worker, Ready(0, 1, 64, 0, 4, 128, [0], 1024, 1e9, 1e4))
        sockets.send(api, Hello("api-test"))
        assert api.poll(5000), "the scheduler did not survive the stale result"
        assert isinstance(sockets.receive(api)[1], SchedulerInfo)

        sockets.send(api, AddRequest("r", [1, 2, 3], SamplingParams(max_tokens=1), time.time()))
        assert worker.poll(5000)
        step = sockets.receive(worker)[1]
        assert isinstance(step, Step) and [s.seq_id for s in step.scheduled] == [0]
    finally:
        server.stop()
        loop.join(timeout=5)
        context.destroy(linger=0)


def test_a_worker_the_scheduler_finds_at_fault_exits_for_its_supervisor_to_restart_it(llama_dir, tmp_path, socket_dir):
    endpoint = f"ipc://{socket_dir}/workers.sock"
    context = zmq.Context()
    scheduler = sockets.bind(context, zmq.ROUTER, endpoint)
    worker = start(
        "services.worker",
        "--model",
        llama_dir,
        "--worker-endpoint",
        endpoint,
        "--device",
        "cpu",
        "--kv-cache-memory",
        "0.05",
        "--swap-space",
        "0.05",
        log=str(tmp_path / "worker.log"),
    )
    try:
        assert scheduler.poll(120_000), "the worker never reported"
        identity, ready = sockets.receive(scheduler, routed=True)
        assert isinstance(ready, Ready)
        sockets.send(scheduler, Shutdown(restart=True), to=identity)
        assert worker.wait(30) == EXIT_AT_FAULT
        assert "found this rank at fault" in (tmp_path / "worker.log").read_text()
    finally:
        if worker.poll() is None:
            worker.kill()
        context.destroy(linger=0)
