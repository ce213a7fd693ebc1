"""`pagedserve up` keeps serving when one of its processes dies after start-up: it starts the api
again alone, or the scheduler and the worker together, while requests in flight end with an error
that says why."""

import argparse
import os
import signal
import socket
import time
from urllib.parse import urlsplit

import httpx
import pytest

from services.launcher import engine_names, restart_parts
from services.restarts import Restarts
from tests.conftest import serve, wait_until
from tests.test_data_parallel import Stream, engine_process


def healthy(base_url: str) -> bool:
    try:
        return httpx.get(f"{base_url}/health", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


def answers(server) -> bool:
    body = {"model": server.model, "prompt": "import os", "max_tokens": 4, "temperature": 0}
    return httpx.post(f"{server.base_url}/v1/completions", json=body, timeout=60).status_code == 200


@pytest.mark.slow  # starts processes: not in `make check`
def test_a_crashed_worker_or_api_is_started_again_and_streams_in_flight_get_a_clear_error(llama_dir, tmp_path):
    with serve(llama_dir, str(tmp_path)) as server:
        launcher = server.process.pid
        stream = Stream(server.base_url, server.model, max_tokens=480)  # most of the 512-token context
        assert stream.first_token.wait(60)
        worker = engine_process(launcher, "services.worker", "workers.sock")
        os.kill(worker, signal.SIGSEGV)  # as a crash in native code would end it
        crashed = time.monotonic()
        stream.thread.join(60)
        print(f"the stream in flight ended with: {stream.error}")
        assert stream.outcome == "error" and ("worker" in stream.error or "went away" in stream.error), stream.error
        assert wait_until(
            lambda: "worker exited with code -11; restarting the scheduler and the worker" in server.log(), 10
        )
        assert wait_until(lambda: healthy(server.base_url) and answers(server), 120)
        print(f"serving again {time.monotonic() - crashed:.1f} s after the worker crashed")
        assert engine_process(launcher, "services.worker", "workers.sock") != worker

        api = engine_process(launcher, "services.api", "--scheduler-endpoint")
        os.kill(api, signal.SIGSEGV)
        crashed = time.monotonic()
        assert wait_until(lambda: "api exited with code -11; restarting the api" in server.log(), 10)
        assert wait_until(lambda: healthy(server.base_url) and answers(server), 120)
        print(f"serving again {time.monotonic() - crashed:.1f} s after the api crashed")
        assert server.process.poll() is None


class FakeProcess:
    def __init__(self, name: str):
        self.name, self.returncode = name, None

    def poll(self):
        return self.returncode

    def terminate(self):
        self.returncode = -15

    def wait(self, timeout=None):
        return self.returncode


def test_the_api_restarts_alone_an_engine_restarts_whole_and_a_part_dying_four_times_a_minute_does_not():
    args = argparse.Namespace(data_parallel_size=2)
    started: list[str] = []

    def start(name: str) -> FakeProcess:
        started.append(name)
        return FakeProcess(name)

    children = {name: FakeProcess(name) for name in ["api", *engine_names(args, 0), *engine_names(args, 1)]}
    restarts = Restarts(restart_parts(args), children, start)
    assert restarts.restart({"api": -11}) and started == ["api"]
    assert restarts.restart({"engine 1's worker": -9})
    assert started[1:] == ["engine 1's scheduler", "engine 1's worker"]  # the worker reports to a fresh scheduler
    assert restarts.restart({"api": -11}) and restarts.restart({"api": -11})
    assert not restarts.restart({"api": -11})  # the fourth death in a minute: the launcher stops
    assert restarts.restart({"engine 0's scheduler": 1})  # other parts keep their own count


def test_an_engine_is_gone_whole_before_any_of_its_processes_starts_again():
    """A fresh scheduler that met the old worker, still ending, would take it as its rank, say it is
    ready, and lose it a moment later: requests routed to it then would fail."""
    args = argparse.Namespace(data_parallel_size=2)
    events: list[str] = []

    class Recorded(FakeProcess):
        def terminate(self):
            events.append(f"terminate {self.name}")
            super().terminate()

        def wait(self, timeout=None):
            events.append(f"reap {self.name}")
            return super().wait(timeout)

    def start(name: str) -> Recorded:
        events.append(f"start {name}")
        return Recorded(name)

    children = {name: Recorded(name) for name in ["api", *engine_names(args, 0), *engine_names(args, 1)]}
    assert Restarts(restart_parts(args), children, start).restart({"engine 1's scheduler": -9})
    assert events == [
        "terminate engine 1's worker",
        "reap engine 1's scheduler",
        "reap engine 1's worker",
        "start engine 1's scheduler",
        "start engine 1's worker",
    ]


@pytest.mark.slow  # starts processes: not in `make check`
def test_a_restarted_worker_whose_metrics_port_is_briefly_held_is_started_again_not_the_server_stopped(
    llama_dir, tmp_path
):
    """After start-up the metrics port was the worker's own: another socket holding it for a moment
    (a client's ephemeral port, say) costs a retry, not the whole server."""
    with serve(llama_dir, str(tmp_path)) as server:
        launcher = server.process.pid
        worker = engine_process(launcher, "services.worker", "workers.sock")
        port = urlsplit(server.metrics_urls["worker"]).port
        os.kill(worker, signal.SIGKILL)
        assert wait_until(lambda: not os.path.exists(f"/proc/{worker}"), 10)
        with socket.socket() as holder:
            holder.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            holder.bind(("127.0.0.1", port))
            holder.listen()
            assert wait_until(lambda: "worker exited with code 3; restarting" in server.log(), 60), server.log()[-3000:]
        assert wait_until(lambda: healthy(server.base_url) and answers(server), 120)
        assert server.process.poll() is None
        assert "; stopping" not in server.log()  # the launcher never gave up
