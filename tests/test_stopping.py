"""Ctrl-C or SIGTERM stops pagedserve promptly, with no traceback and no temp directory left:
the launcher with a stream in flight, and each service run alone."""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

from tests.conftest import ROOT, children, free_port, metrics_port_flags, parse_metrics, wait_serving, wait_until
from tests.test_resilience import wait_healthy

pytestmark = pytest.mark.slow  # starts processes: not in `make check`

# A stop takes a fraction of a second; the bound is wide, so a loaded machine does not fail it, and
# still far below the 30 s after which the test would kill what hangs.
STOP_SECONDS = 10.0


def launcher_serving(model: str, port: int, *flags: str) -> list[str]:
    """`pagedserve serve MODEL` on `port`, small memory, free metrics ports."""
    return [
        *(sys.executable, "-m", "services.launcher", "serve", model, "--port", str(port), *metrics_port_flags()),
        *("--device", "cpu", "--kv-cache-memory", "0.05", "--swap-space", "0.05", *flags),
    ]


def start(cmd: list[str], log_path, tmp_dir) -> subprocess.Popen:
    env = dict(os.environ, PYTHONUNBUFFERED="1", TMPDIR=str(tmp_dir))
    with open(log_path, "w") as log:  # its own session: Ctrl-C reaches the whole group, as in a terminal
        return subprocess.Popen(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)


def asleep(pid: int) -> bool:
    """Whether the process's main thread is asleep (in a poll, say), not running."""
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0] == "S"


def stop_and_time(process: subprocess.Popen, signum: int, whole_group: bool) -> float:
    started = time.monotonic()
    if whole_group:
        os.killpg(process.pid, signum)
    else:
        process.send_signal(signum)
    try:
        process.wait(30)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        process.wait()
    return time.monotonic() - started


def stream_until_the_end(base_url: str, model: str, max_tokens: int, streaming: threading.Event, seen: dict) -> None:
    """A stream's tokens (its usage) and finish reason; `seen["cut"]` if the connection broke instead."""
    body = {
        "model": model,
        "prompt": "import os",
        "max_tokens": max_tokens,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    seen.update(tokens=None, finish_reason=None, cut=False)
    try:
        with httpx.stream("POST", f"{base_url}/v1/completions", json=body, timeout=30) as response:
            for line in response.iter_lines():
                if line.startswith("data: {"):
                    chunk = json.loads(line.removeprefix("data: "))
                    if chunk.get("usage"):
                        seen["tokens"] = chunk["usage"]["completion_tokens"]
                    for choice in chunk["choices"]:
                        seen["finish_reason"] = choice["finish_reason"] or seen["finish_reason"]
                    streaming.set()
    except httpx.HTTPError:
        seen["cut"] = True


@pytest.mark.parametrize(
    "signum, whole_group", [(signal.SIGINT, True), (signal.SIGTERM, False)], ids=["ctrl-c", "sigterm-to-the-launcher"]
)
@pytest.mark.parametrize(
    "max_tokens, shutdown_timeout, finish_reason",
    [(200, "5", "length"), (480, "0.1", "abort")],
    ids=["the-stream-finishes-first", "the-stream-ends-at-the-timeout"],
)
def test_a_stop_lets_streams_finish_within_the_shutdown_timeout_and_ends_the_rest_cleanly(
    llama_dir, tmp_path, socket_dir, signum, whole_group, max_tokens, shutdown_timeout, finish_reason
):
    port, temp = free_port(), Path(socket_dir)
    process = start(
        launcher_serving(llama_dir, port, "--shutdown-timeout", shutdown_timeout),
        tmp_path / "launcher.log",
        temp,
    )
    wait_serving(f"http://127.0.0.1:{port}", process, (tmp_path / "launcher.log").read_text, 120)
    # Its ipc sockets live in a directory of its own, closed to other users.
    assert [(p.name[:11], p.stat().st_mode & 0o777) for p in temp.iterdir()] == [("pagedserve-", 0o700)]
    # `serve` takes the model as its first argument.
    models = httpx.get(f"http://127.0.0.1:{port}/v1/models", timeout=10).json()
    assert models["data"][0]["id"] == os.path.basename(llama_dir)
    streaming, seen = threading.Event(), {}
    client = threading.Thread(
        target=stream_until_the_end,
        args=(f"http://127.0.0.1:{port}", os.path.basename(llama_dir), max_tokens, streaming, seen),
    )
    # A stream that must still run at the timeout, however fast this machine computes its tokens: its worker is
    # held from before the first one until after the stop (the scheduler has it running meanwhile).
    worker, resume = children(process.pid)["worker"], None
    if finish_reason == "abort":
        os.kill(worker, signal.SIGSTOP)
    client.start()
    if finish_reason == "abort":
        metrics = f"http://127.0.0.1:{port}/metrics"
        running = 'pagedserve_engine_requests_running{engine="0"}'
        assert wait_until(lambda: parse_metrics(httpx.get(metrics, timeout=5).text).get(running, 0) >= 1, 30)
        resume = threading.Timer(1.0, os.kill, (worker, signal.SIGCONT))
        resume.start()
    else:
        assert streaming.wait(60), "the stream never started"
    took = stop_and_time(process, signum, whole_group)
    client.join(30)
    if resume is not None:
        resume.join()
    output = (tmp_path / "launcher.log").read_text()
    assert took < STOP_SECONDS, f"took {took:.1f} s:\n{output}"
    assert process.returncode == 0, output
    assert "Traceback" not in output and " ERROR " not in output and "Error" not in output.split("ready at")[-1]
    assert not seen["cut"] and seen["finish_reason"] == finish_reason, (seen, output)
    assert (seen["tokens"] == max_tokens) == (finish_reason == "length"), seen
    assert re.search(rf"completions: {finish_reason}", output), output
    assert list(temp.iterdir()) == []


def test_an_idle_launcher_stopped_by_ctrl_c_logs_no_error_and_no_line_about_waiting(llama_dir, tmp_path, socket_dir):
    port, temp = free_port(), Path(socket_dir)
    process = start(
        launcher_serving(llama_dir, port),
        tmp_path / "launcher.log",
        temp,
    )
    wait_serving(f"http://127.0.0.1:{port}", process, (tmp_path / "launcher.log").read_text, 120)
    stop_and_time(process, signal.SIGINT, whole_group=True)
    output = (tmp_path / "launcher.log").read_text()
    assert process.returncode == 0, output
    assert " ERROR " not in output and "waiting for it" not in output and "Traceback" not in output, output


def service_commands(llama_dir: str, sockets: str) -> dict[str, list[str]]:
    scheduler, workers = f"ipc://{sockets}/scheduler.sock", f"ipc://{sockets}/workers.sock"
    python = [sys.executable, "-m"]
    return {
        "scheduler": python
        + [
            "services.scheduler",
            "--scheduler-endpoint",
            scheduler,
            "--worker-endpoint",
            workers,
            "--metrics-port",
            str(free_port()),
        ],
        "worker": python
        + [
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
            str(free_port()),
        ],
        "api": python
        + ["services.api", "--model", llama_dir, "--scheduler-endpoint", scheduler, "--port", str(free_port())],
    }


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM], ids=["ctrl-c", "sigterm"])
def test_each_service_alone_stops_promptly(llama_dir, tmp_path, socket_dir, signum):
    # The three at once, each with sockets of its own: none has a peer, and none waits for another's start.
    ready_line = {"scheduler": "waiting for 1 worker rank", "worker": "measured:", "api": "once the scheduler is ready"}
    processes, logs = {}, {}
    for service in ready_line:
        sockets = Path(socket_dir) / service
        sockets.mkdir()
        logs[service] = tmp_path / f"{service}.log"
        processes[service] = start(service_commands(llama_dir, str(sockets))[service], logs[service], sockets)
    try:
        for service, process in processes.items():
            assert wait_until(
                lambda service=service, process=process: (
                    ready_line[service] in logs[service].read_text() or process.poll() is not None
                ),
                60,
            ), logs[service].read_text()
            assert process.poll() is None, logs[service].read_text()
            if "--metrics-port" in process.args:  # its metrics port answers /metrics and /health, and 404 else
                base = f"http://127.0.0.1:{process.args[process.args.index('--metrics-port') + 1]}"
                wait_healthy(f"{base}/health", 30)
                assert httpx.get(f"{base}/metrics", timeout=5).status_code == 200
                assert httpx.get(f"{base}/nothing", timeout=5).status_code == 404
        for service, process in processes.items():
            took = stop_and_time(process, signum, whole_group=False)
            output = logs[service].read_text()
            assert took < STOP_SECONDS, f"{service} took {took:.1f} s:\n{output}"
            assert process.returncode in (0, -signum, 128 + signum) and "Traceback" not in output, output
    finally:
        for process in processes.values():
            if process.poll() is None:
                os.killpg(process.pid, signal.SIGKILL)


TGKILL = {"x86_64": 234, "aarch64": 131}.get(os.uname().machine)  # the syscall's number


def helper_thread_taking(pid: int, signum: int) -> int:
    """A thread of `pid` other than its main one that does not block `signum` (the metrics
    server's, zmq's authenticator's): one the kernel may hand a process's signal to."""
    for tid in sorted(int(t) for t in os.listdir(f"/proc/{pid}/task")):
        with open(f"/proc/{pid}/task/{tid}/status") as f:
            blocked = int(next(line for line in f if line.startswith("SigBlk:")).split()[1], 16)
        if tid != pid and not blocked & (1 << (signum - 1)):
            return tid
    raise AssertionError(f"no thread of {pid} but the main one takes signal {signum}")


@pytest.mark.skipif(TGKILL is None, reason="tgkill's number is known here for x86_64 and aarch64 only")
def test_a_signal_taken_by_a_helper_thread_still_stops_the_scheduler_and_the_worker(llama_dir, tmp_path, socket_dir):
    """Python runs a signal's handler in the main thread, the next time it runs; the loops wait in
    zmq polls without a timeout, so the signal must wake them."""
    import ctypes

    syscall = ctypes.CDLL(None, use_errno=True).syscall
    ready_line = {"scheduler": "waiting for 1 worker rank", "worker": "measured:"}
    for service, line in ready_line.items():
        sockets = Path(socket_dir) / service
        sockets.mkdir()
        log = tmp_path / f"{service}.log"
        process = start(service_commands(llama_dir, str(sockets))[service], log, sockets)
        try:
            assert wait_until(
                lambda line=line, log=log, process=process: line in log.read_text() or process.poll() is not None, 60
            ), log.read_text()
            assert wait_until(lambda process=process: asleep(process.pid), 10)  # idle in its poll
            started = time.monotonic()
            assert (
                syscall(TGKILL, process.pid, helper_thread_taking(process.pid, signal.SIGTERM), signal.SIGTERM) == 0
            ), ctypes.get_errno()
            with contextlib.suppress(subprocess.TimeoutExpired):
                process.wait(10)
            took = time.monotonic() - started
            assert process.poll() is not None and took < STOP_SECONDS, f"{service} still ran after {took:.1f} s"
            assert "Traceback" not in log.read_text(), log.read_text()
        finally:
            if process.poll() is None:
                os.killpg(process.pid, signal.SIGKILL)


LOST_INTERRUPT = """
import os, signal, zmq
from shared.cli import drain_wakeups, stop_on_signals

signals = stop_on_signals()

class SignalledWhileDestroyed:
    def __del__(self):
        os.kill(os.getpid(), signal.SIGTERM)
        for _ in range(10_000):  # the handler runs here, and Python drops its KeyboardInterrupt
            pass

SignalledWhileDestroyed()
print("survived the lost interrupt", flush=True)
poller = zmq.Poller()
poller.register(signals, zmq.POLLIN)
try:
    for polled, _ in poller.poll(5000):
        assert polled == signals.fileno(), polled
        drain_wakeups()
    print("still running")
except KeyboardInterrupt:
    print("stopped")
"""


def test_a_signal_whose_interrupt_is_lost_in_a_destructor_still_stops_the_loop():
    """zmq frees its message frames in destructors; a signal handled there raises a KeyboardInterrupt
    that Python drops. The signal's wake-up must stop the loop instead, with nothing in the log."""
    done = subprocess.run([sys.executable, "-c", LOST_INTERRUPT], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert done.stderr == ""
    assert done.stdout.split() == ["survived", "the", "lost", "interrupt", "stopped"], done.stdout + done.stderr


def test_a_sigkilled_launcher_leaves_no_service_and_no_socket_directory_behind(llama_dir, tmp_path, socket_dir):
    port, temp = free_port(), Path(socket_dir)
    process = start(
        launcher_serving(llama_dir, port),
        tmp_path / "launcher.log",
        temp,
    )
    try:
        wait_serving(f"http://127.0.0.1:{port}", process, (tmp_path / "launcher.log").read_text, 120)
        children = subprocess.run(["pgrep", "-P", str(process.pid)], capture_output=True, text=True).stdout.split()
        assert len(children) == 3 and os.listdir(temp)
        process.kill()  # SIGKILL: the launcher's own cleanup never runs
        process.wait()
        assert wait_until(lambda: not any(_running(pid) for pid in children), 15), "a service outlived its launcher"
        assert wait_until(lambda: not os.listdir(temp), 5), f"left behind: {os.listdir(temp)}"
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)


def _running(pid: str) -> bool:
    """Alive and not a zombie (whoever adopted it may not have reaped it yet)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False
