"""Fixtures: tiny models saved to disk, and pagedserve running as three real processes."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable

import httpx
import pytest
import torch

if not torch.cuda.is_available():
    # Triton kernels run on the CPU through Triton's interpreter; set before any kernel is defined.
    os.environ.setdefault("TRITON_INTERPRET", "1")

from tests.tiny_models import build_model

XDIST_RUN = os.environ.get("PYTEST_XDIST_TESTRUNUID")  # set in each worker of `pytest -n` (make check)
if os.environ.get("PYTEST_XDIST_WORKER"):
    # The workers share the cores: each with torch's default of one thread per core, their threads
    # wait on one another's cores (make check took twice as long as one process did).
    torch.set_num_threads(1)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


# Groups whose few tests take minutes (Docker builds and compose runs, benchmark scripts, the paper's
# figures, the wheel, TP ranks): handed out first, so none is left for the end with the other worker idle.
SLOW_GROUPS = (
    "test_docker_compose",
    "fixed-ports",
    "test_paper_benchmarks",
    "test_install",
    "test_tensor_parallel",
    "test_prometheus",
)


@pytest.hookimpl(tryfirst=True)  # before xdist's, which reads the groups into the tests' ids
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Under `pytest -n --dist loadgroup` (make test), a file's tests run in one worker, so a server its
    fixtures start once serves them all; files marked `xdist_group` share a worker with the others of
    that group (those that listen on fixed ports take turns). Groups go to the workers in the order
    collected (make test passes --no-loadscope-reorder): SLOW_GROUPS first, then the rest by their
    number of tests, most first, as xdist would order them."""
    for item in items:
        if item.get_closest_marker("xdist_group") is None:
            item.add_marker(pytest.mark.xdist_group(item.module.__name__ if item.module else item.nodeid))
    groups: dict[str, list[pytest.Item]] = {}
    for item in items:
        groups.setdefault(item.get_closest_marker("xdist_group").args[0], []).append(item)

    def turn(name: str) -> tuple[int, int]:
        short = name.rsplit(".", 1)[-1]
        return (SLOW_GROUPS.index(short) if short in SLOW_GROUPS else len(SLOW_GROUPS), -len(groups[name]))

    items[:] = [item for name in sorted(groups, key=turn) for item in groups[name]]


class GroupsTaken:
    """Under --dist loadgroup xdist appends each test's group to its id and groups by that alone: with a
    pytest where it cannot, a file's tests would run on several workers at once (the Docker tests then
    race for the same keys), so the run stops as soon as a worker reports its collection."""

    def pytest_xdist_node_collection_finished(self, node, ids: list[str]) -> None:
        if node.config.getvalue("dist") == "loadgroup" and any("@" not in nodeid for nodeid in ids):
            pytest.exit(
                f"pytest-xdist could not put the tests' groups into their ids under pytest "
                f"{pytest.__version__}: --dist loadgroup would split them (see pyproject's test extra)",
                returncode=pytest.ExitCode.USAGE_ERROR,
            )


def pytest_configure(config: pytest.Config) -> None:
    if config.pluginmanager.hasplugin("xdist") and not config.pluginmanager.has_plugin("groups-taken"):
        config.pluginmanager.register(GroupsTaken(), "groups-taken")


@pytest.fixture(autouse=True)
def kernel_threads_as_they_were():
    """A model runner sets the compiled kernels' thread count for its process (ComputeThreads.use): put
    back after each test, so no test depends on which ran before it in the same worker."""
    from kernels import native

    before = native._threads
    yield
    native._threads = before


@pytest.fixture(scope="session")
def model_dirs(tmp_path_factory) -> dict[str, str]:
    return {family: build_model(str(tmp_path_factory.mktemp(family)), family) for family in ("llama", "qwen2")}


@pytest.fixture
def kernels_chosen():
    """Which kernels run (kernels/choice.py: a worker's --kernels, --cpu-kernels, --prompt-products), changed by
    the test's calls and restored after it."""
    from kernels import choice

    kept = choice.current()
    yield lambda **changes: choice.choose(dataclasses.replace(choice.current(), **changes))
    choice.choose(kept)


@pytest.fixture(scope="session")
def quantized(tmp_path_factory):
    """The tiny families' quantized checkpoints (tests/quantized_models.py), each written once a session."""
    from tests.quantized_models import QuantizedCheckpoints

    return QuantizedCheckpoints(str(tmp_path_factory.mktemp("quantized")))


@pytest.fixture(scope="session")
def llama_dir(model_dirs) -> str:
    return model_dirs["llama"]


@pytest.fixture
def socket_dir():
    """A short private directory for ipc:// sockets and, as TMPDIR, for the launcher's socket directory:
    tmp_path can exceed a socket path's 107 bytes (under `pytest -n` it is deeper still)."""
    directory = tempfile.mkdtemp(prefix="pagedserve-test-")
    yield directory
    shutil.rmtree(directory, ignore_errors=True)


def wait_until(predicate, timeout: float, interval: float = 0.2) -> bool:
    """Poll `predicate` until it holds (True) or `timeout` seconds pass (False)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval)
    return False


async def wait_until_async(predicate, timeout: float, interval: float = 0.05) -> bool:
    """wait_until for a coroutine: `predicate` runs on a thread, so it may block."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if await asyncio.to_thread(predicate):
            return True
        await asyncio.sleep(interval)
    return False


_handed_out: set[int] = set()


def memory_mib(pid: int, field: str = "VmRSS") -> float:
    """A process's memory from /proc: VmRSS now, VmHWM its peak."""
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(field)) / 1024


def children(pid: int) -> dict[str, int]:
    """The launcher's children by service name."""
    found = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                parent = int(f.read().rsplit(")", 1)[1].split()[1])
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                cmdline = f.read().split(b"\0")
        except OSError:
            continue
        if parent == pid and b"-m" in cmdline:
            found[cmdline[cmdline.index(b"-m") + 1].decode().split(".")[-1]] = int(entry)
    return found


def free_port(span: int = 1) -> int:
    """A port that is free now, with the `span - 1` ports above it, and never handed out before.

    The kernel may give a just-closed port again, so two calls could otherwise return the same one
    and two services of one launch would fight over it.
    """
    while True:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        wanted = range(port, port + span)
        if not _handed_out.intersection(wanted) and all(_bindable(p) for p in wanted[1:]):
            _handed_out.update(wanted)
            if _claimed_across_workers(wanted):
                return port


def _claims_folder() -> str:
    return os.path.join(tempfile.gettempdir(), f"pagedserve-test-ports-{XDIST_RUN}")


def _claimed_across_workers(ports: range) -> bool:
    """Under `pytest -n`, each port handed out is a file the other workers see, so two workers never
    get the same one; False where another worker has one of `ports`."""
    if XDIST_RUN is None:
        return True
    folder = _claims_folder()
    os.makedirs(folder, exist_ok=True)
    for port in ports:
        try:
            claim = os.open(os.path.join(folder, str(port)), os.O_CREAT | os.O_EXCL | os.O_WRONLY)
        except FileExistsError:
            return False
        os.write(claim, os.environ.get("PYTEST_XDIST_WORKER", "").encode())  # whose it is, for its removal
        os.close(claim)
    return True


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    """A worker's port claims go with it; the last worker out removes their folder."""
    if XDIST_RUN is None:
        return
    folder, worker = _claims_folder(), os.environ.get("PYTEST_XDIST_WORKER", "").encode()
    for name in os.listdir(folder) if os.path.isdir(folder) else []:
        with contextlib.suppress(OSError), open(os.path.join(folder, name), "rb") as claim:
            if claim.read() == worker:
                os.remove(claim.name)
    with contextlib.suppress(OSError):
        os.rmdir(folder)  # fails while another worker still holds a claim


def _bindable(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
        return True


SWAP_BLOCKS_USED = 'pagedserve_kv_blocks{device="cpu",pool="swap",state="used"}'


def device_blocks_used(metrics: dict[str, float]) -> float:
    """KV blocks in use in the device pool, whatever device the worker runs on."""
    return sum(
        value
        for key, value in metrics.items()
        if key.startswith("pagedserve_kv_blocks{") and 'pool="device"' in key and 'state="used"' in key
    )


def metrics_port_flags() -> list[str]:
    """Free ports for the scheduler's and the workers' /metrics (one per rank, up to 4), for a launcher under test."""
    return ["--scheduler-metrics-port", str(free_port()), "--worker-metrics-port", str(free_port(span=4))]


class Server:
    def __init__(
        self, process: subprocess.Popen, base_url: str, model: str, log_path: str, metrics_ports: dict[str, int]
    ):
        self.process, self.base_url, self.model, self.log_path = process, base_url, model, log_path
        self.metrics_urls = {"api": f"{base_url}/metrics"} | {
            service: f"http://127.0.0.1:{port}/metrics" for service, port in metrics_ports.items()
        }

    def metrics(self, service: str | None = None) -> dict[str, float]:
        """Samples by name with labels, from one service's /metrics or from all three's."""
        values = {}
        for name, url in self.metrics_urls.items():
            if service in (None, name):
                values |= parse_metrics(httpx.get(url, timeout=10).text)
        return values

    def is_idle(self) -> bool:
        """No request running and no KV block in use, on the device or in swap, as the scheduler's
        metrics say."""
        metrics = self.metrics("scheduler")
        return (
            device_blocks_used(metrics) == 0
            and metrics[SWAP_BLOCKS_USED] == 0
            and metrics["pagedserve_num_requests_running"] == 0
        )

    def log(self) -> str:
        with open(self.log_path) as f:
            return f.read()


def parse_metrics(text: str) -> dict[str, float]:
    values = {}
    for line in text.splitlines():
        if line.startswith("pagedserve_"):
            name, value = line.rsplit(" ", 1)
            values[name] = float(value)
    return values


def metric_total(metrics: dict[str, float], name: str) -> float:
    """A metric summed over its labels."""
    return sum(value for key, value in metrics.items() if key == name or key.startswith(name + "{"))


def wait_serving(base_url: str, process: subprocess.Popen, log: Callable[[], str], timeout: float) -> None:
    """Until `base_url`'s /health answers 200; an error with the log's end if the server exits or is late."""
    deadline = time.monotonic() + timeout
    while True:
        if process.poll() is not None:
            raise RuntimeError(f"the server exited with {process.returncode}:\n{log()[-3000:]}")
        try:
            if httpx.get(f"{base_url}/health", timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline:
            raise RuntimeError(f"{base_url} not ready in {timeout:g} s:\n{log()[-3000:]}")
        time.sleep(0.3)


@contextlib.contextmanager
def serve(model_dir: str | None, log_dir: str, *flags: str, env: dict[str, str] | None = None):
    """Run `pagedserve up` on a free port until the block exits; no model_dir: the default model."""
    port = free_port()
    log_path = os.path.join(log_dir, f"server-{port}.log")
    model = ["--model", model_dir] if model_dir else []
    ports = metrics_port_flags()
    cmd = [
        sys.executable,
        "-m",
        "services.launcher",
        "up",
        *model,
        "--port",
        str(port),
        *ports,
        "--device",
        "cpu",
        "--kv-cache-memory",
        "0.05",
        "--swap-space",
        "0.05",
        *flags,
    ]
    env = dict(os.environ, PYTHONUNBUFFERED="1", **(env or {}))
    with open(log_path, "w") as log:
        process = subprocess.Popen(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, env=env)
    base_url = f"http://127.0.0.1:{port}"
    server = Server(
        process,
        base_url,
        os.path.basename(os.path.normpath(model_dir or "tiny-python")),
        log_path,
        {"scheduler": int(ports[1]), "worker": int(ports[3])},
    )
    try:
        wait_serving(base_url, process, server.log, 120)
        # The api answers /health before the launcher has seen it ready; a child that dies before then
        # is a failed start to the launcher, which stops rather than restarts it.
        if (
            not wait_until(lambda: "pagedserve: ready at" in server.log() or process.poll() is not None, 60)
            or process.poll() is not None
        ):
            raise RuntimeError(f"the launcher did not say it was ready:\n{server.log()[-3000:]}")
        yield server
    except BaseException:
        # pytest shows a failed test's captured output: the launcher's last words say why.
        print(f"--- the launcher's log, last lines ({log_path}) ---\n{server.log()[-6000:]}")
        raise
    finally:
        process.send_signal(signal.SIGINT)
        try:
            process.wait(30)
        except subprocess.TimeoutExpired:
            process.kill()


# Proposals in every step, so that a request's steps are the same each time it is sent alone.
NGRAM = (
    '{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 2, '
    '"adaptive": false}'
)


@pytest.fixture(scope="session")
def shipped_ngram_server(tmp_path_factory):
    """The shipped model with n-gram speculation, async scheduling and tool_choice "auto" (tests of
    speculation, structured outputs and tool calls through all three processes), in float32: the
    path whose greedy tokens are HF's exactly."""
    with serve(
        None,
        str(tmp_path_factory.mktemp("spec")),
        "--dtype",
        "float32",
        "--speculative-config",
        NGRAM,
        "--enable-auto-tool-choice",
        "--tool-call-parser",
        "hermes",
    ) as server:
        yield server


@pytest.fixture(scope="session")
def llama_server(llama_dir, tmp_path_factory):
    # A short stats interval, so that tests/test_openai_api.py sees the periodic log line.
    with serve(llama_dir, str(tmp_path_factory.mktemp("logs")), "--log-stats-interval", "0.5") as server:
        yield server
