"""The internal wire on tcp://127.0.0.1, as compose runs it: CURVE keys, roles, ranks, bounded frames."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import httpx
import msgpack
import pytest
import zmq
from zmq.utils.monitor import recv_monitor_message

from shared import sockets, wire_security
from shared.handshake_budget import HandshakeBudget, source_of
from shared.log_limits import RateLimit
from shared.protocol import AddRequest, Hello, Ping, Pong, Ready, SampledTokens, SchedulerInfo, Shutdown, StepResult
from shared.sampling import SamplingParams
from shared.wire_security import WireKeys, load_keys, make_keys
from tests.conftest import ROOT, free_port, memory_mib, wait_until
from tests.test_resilience import start, wait_healthy
from tests.tiny_models import hf_greedy

pytestmark = pytest.mark.slow  # starts processes: not in `make check`

PROMPT = [5, 17, 42, 9]
LONG = 160  # tokens: long enough that the attacks land while the stream runs


@pytest.fixture(scope="module")
def keys_dir(tmp_path_factory) -> str:
    directory = str(tmp_path_factory.mktemp("keys"))
    done = subprocess.run(
        [sys.executable, "-m", "services.launcher", "keys", directory],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    for role in ("scheduler", "api", "worker"):
        assert os.stat(os.path.join(directory, role, f"{role}.key_secret")).st_mode & 0o077 == 0
    assert not os.path.exists(os.path.join(directory, "api", "worker.key_secret"))  # each holds its own secret
    return directory


class Services:
    def __init__(self, base: str, scheduler_port: int, worker_port: int, logs: dict[str, str]):
        self.base, self.scheduler_port, self.worker_port, self.logs = base, scheduler_port, worker_port, logs

    def log(self, name: str) -> str:
        with open(self.logs[name]) as f:
            return f.read()


@contextlib.contextmanager
def tcp_services(model_dir: str, tmp_path, keys_dir: str, *scheduler_flags: str):
    scheduler_port, worker_port, http_port = free_port(), free_port(), free_port()
    scheduler_ep, worker_ep = f"tcp://127.0.0.1:{scheduler_port}", f"tcp://127.0.0.1:{worker_port}"
    logs = {name: str(tmp_path / f"{name}.log") for name in ("scheduler", "worker", "api")}
    processes = [
        start(
            "services.scheduler",
            "--scheduler-endpoint",
            scheduler_ep,
            "--worker-endpoint",
            worker_ep,
            "--keys-dir",
            f"{keys_dir}/scheduler",
            *scheduler_flags,
            log=logs["scheduler"],
        ),
        start(
            "services.worker",
            "--model",
            model_dir,
            "--worker-endpoint",
            worker_ep,
            "--device",
            "cpu",
            "--kv-cache-memory",
            "0.05",
            "--swap-space",
            "0.05",
            "--keys-dir",
            f"{keys_dir}/worker",
            log=logs["worker"],
        ),
        start(
            "services.api",
            "--model",
            model_dir,
            "--scheduler-endpoint",
            scheduler_ep,
            "--port",
            str(http_port),
            "--keys-dir",
            f"{keys_dir}/api",
            log=logs["api"],
        ),
    ]
    services = Services(f"http://127.0.0.1:{http_port}", scheduler_port, worker_port, logs)
    try:
        wait_healthy(f"{services.base}/health")
        yield services
        assert all(p.poll() is None for p in processes), "a service stopped"
    finally:
        for process in processes:
            process.terminate()
        for process in processes:
            process.wait(10)


def stream_in_background(services: Services, model: str, max_tokens: int = LONG):
    """Start a greedy stream; returns (started event, thread, result dict with its token ids)."""
    result: dict = {"token_ids": [], "error": None}
    started = threading.Event()

    def run():
        body = {
            "model": model,
            "prompt": PROMPT,
            "max_tokens": max_tokens,
            "temperature": 0,
            "ignore_eos": True,
            "stream": True,
            "return_token_ids": True,
        }
        with httpx.stream("POST", f"{services.base}/v1/completions", json=body, timeout=120) as response:
            for line in response.iter_lines():
                if line.startswith("data: {"):
                    chunk = json.loads(line[len("data: ") :])
                    if "error" in chunk:
                        result["error"] = chunk["error"]
                    else:
                        result["token_ids"] += chunk["choices"][0].get("token_ids", [])
                        started.set()
        started.set()

    thread = threading.Thread(target=run)
    thread.start()
    assert started.wait(60)
    return thread, result


def equals_hf_greedy(model_dir: str, token_ids: list[int]) -> bool:
    """HF stops at its first EOS; the stream (ignore_eos) goes on past it."""
    expected = hf_greedy(model_dir, PROMPT, LONG)
    return len(token_ids) == LONG and token_ids[: len(expected)] == expected


def zmq_peer(port: int, keys=None) -> tuple[zmq.Context, zmq.Socket]:
    context = zmq.Context()
    return context, sockets.connect(context, zmq.DEALER, f"tcp://127.0.0.1:{port}", keys=keys)


def test_an_unkeyed_peer_gets_nothing_through_and_disturbs_no_stream(llama_dir, tmp_path, keys_dir):
    model = os.path.basename(llama_dir)
    with tcp_services(llama_dir, tmp_path, keys_dir) as services:
        thread, result = stream_in_background(services, model)
        for port in (services.scheduler_port, services.worker_port):
            socket.create_connection(("127.0.0.1", port)).close()  # a bare connect and close
            with socket.create_connection(("127.0.0.1", port)) as raw:
                raw.sendall(os.urandom(4096))
            context, peer = zmq_peer(port)  # well-formed messages, but no key
            for message in (
                Ready(0, 1, 64, 0, 16, 128, [0], 1024, 1e9, 1e4),
                Shutdown(),
                AddRequest("rogue", [1, 2, 3], SamplingParams(max_tokens=4), time.time()),
                Hello("rogue"),
            ):
                sockets.try_send(peer, message)
            assert not peer.poll(1500), "an unkeyed peer received a message"
            context.destroy(linger=0)
        thread.join(120)
        assert result["error"] is None
        assert equals_hf_greedy(llama_dir, result["token_ids"])
        after = httpx.post(
            f"{services.base}/v1/completions",
            timeout=60,
            json={"model": model, "prompt": PROMPT, "max_tokens": 4, "temperature": 0},
        )
        assert after.status_code == 200  # nothing was stopped
        assert "refused a CURVE peer" not in services.log("scheduler")  # no key at all: no handshake to refuse


def test_a_keyed_rogue_api_cannot_act_as_a_worker_or_stop_anything_and_a_second_worker_cannot_take_a_rank(
    llama_dir, tmp_path, keys_dir
):
    model = os.path.basename(llama_dir)
    api_keys = load_keys(f"{keys_dir}/api", "api")
    worker_keys = load_keys(f"{keys_dir}/worker", "worker")
    with tcp_services(llama_dir, tmp_path, keys_dir) as services:
        thread, result = stream_in_background(services, model)
        # An api key does not open the worker socket.
        context, rogue = zmq_peer(services.worker_port, api_keys)
        sockets.try_send(rogue, Ready(0, 1, 64, 0, 16, 128, [0], 1024, 1e9, 1e4))
        assert not rogue.poll(1500)
        context.destroy(linger=0)
        # On the api socket, worker and operator messages are refused.
        context, rogue = zmq_peer(services.scheduler_port, api_keys)
        for message in (
            Ready(0, 1, 64, 0, 16, 128, [0], 1024, 1e9, 1e4),
            StepResult(0, [SampledTokens(0, [5], [-0.1], [], [])], 1.0, 1.0),
            Shutdown(),
        ):
            sockets.send(rogue, message)
        refused = ("refused a Shutdown", "no handler for Ready", "no handler for StepResult")
        assert wait_until(lambda: all(line in services.log("scheduler") for line in refused), 30)
        context.destroy(linger=0)
        # A second worker with a worker key claims rank 0, sees no step, and leaves: nothing changes.
        context, second = zmq_peer(services.worker_port, worker_keys)
        sockets.send(second, Ready(0, 1, 64, 0, 16, 128, [0], 1024, 1e9, 1e4))
        assert not second.poll(1500), "the second worker got a step"
        context.destroy(linger=0)
        thread.join(120)
        assert result["error"] is None and equals_hf_greedy(llama_dir, result["token_ids"])
        after = httpx.post(
            f"{services.base}/v1/completions",
            timeout=60,
            json={"model": model, "prompt": PROMPT, "max_tokens": 4, "temperature": 0},
        )
        assert after.status_code == 200
        log = services.log("scheduler")
        assert "refused a CURVE peer on the worker socket" in log
        assert "refused a Shutdown" in log and "no handler for Ready" in log and "no handler for StepResult" in log
        assert "refused Ready for rank 0" in log


def test_oversized_frames_and_frames_of_empty_containers_are_dropped_within_a_memory_bound(tmp_path, keys_dir):
    """The scheduler alone, a keyed fake worker making it ready; a keyed api sends the frames."""
    limit = 8 << 20
    scheduler, scheduler_port, worker_port = scheduler_on_tcp(tmp_path, keys_dir, "--max-message-bytes", str(limit))
    log_path = str(tmp_path / "scheduler.log")
    api_keys = load_keys(f"{keys_dir}/api", "api")
    contexts = []
    try:
        context, worker = zmq_peer(worker_port, load_keys(f"{keys_dir}/worker", "worker"))
        contexts.append(context)
        sockets.send(worker, Ready(0, 1, 64, 0, 16, 128, [0], 1024, 1e9, 1e4))

        def scheduler_answers() -> bool:
            context, api = zmq_peer(scheduler_port, api_keys)
            contexts.append(context)
            sockets.send(api, Hello("probe"))
            # a stopped scheduler never answers; a slow one (the suite's other tests share the cores) answers late
            return api.poll(30_000) and isinstance(sockets.receive(api)[1], SchedulerInfo)

        assert scheduler_answers()
        before = memory_mib(scheduler.pid, "VmHWM")
        empties = 4_000_000
        frame = msgpack.packb([1, "AddRequest", "r", [[] for _ in range(empties)], [], 0.0])
        assert len(frame) < limit
        context, attacker = zmq_peer(scheduler_port, api_keys)
        contexts.append(context)
        attacker.send(frame)
        attacker.send(b"\x00" * (limit + 1))  # over the limit: the connection is dropped
        assert wait_until(lambda: f"dropped a malformed frame of {len(frame)} bytes" in Path(log_path).read_text(), 60)
        assert scheduler_answers(), "the scheduler stopped answering"
        growth_bytes = (memory_mib(scheduler.pid, "VmHWM") - before) * 2**20
        # Python would build 64 bytes per empty array; decoding stops at the 16th, and what is
        # left is the frame, its copy and the outer array's preallocated slots: 8 bytes per element.
        bound = 12 * len(frame)
        print(
            f"scheduler peak memory grew {growth_bytes / 2**20:.1f} MiB for a {len(frame) / 2**20:.1f} MiB "
            f"frame of {empties:,} empty arrays (bound {bound / 2**20:.0f} MiB)"
        )
        assert growth_bytes < bound
        with open(log_path) as f:
            log = f.read()
        assert "more arrays and maps than this socket's messages ever hold" in log
        assert "sent a frame over --max-message-bytes" in log
        assert scheduler.poll() is None
    finally:
        for context in contexts:
            context.destroy(linger=0)
        scheduler.terminate()
        scheduler.wait(10)


def test_tcp_endpoints_without_keys_refuse_to_start_unless_the_wire_is_declared_insecure(tmp_path):
    endpoints = [
        "--scheduler-endpoint",
        f"tcp://127.0.0.1:{free_port()}",
        "--worker-endpoint",
        f"tcp://127.0.0.1:{free_port()}",
    ]
    env = {k: v for k, v in os.environ.items() if k != "PAGEDSERVE_KEYS_DIR"}
    done = subprocess.run(
        [sys.executable, "-m", "services.scheduler", *endpoints],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode != 0 and "pagedserve keys DIR" in done.stderr
    log = str(tmp_path / "insecure.log")
    scheduler = start("services.scheduler", *endpoints, "--insecure-wire", log=log)
    try:
        assert wait_until(lambda: "--insecure-wire" in Path(log).read_text() or scheduler.poll() is not None, 30)
        assert scheduler.poll() is None
    finally:
        scheduler.terminate()
        scheduler.wait(10)


def test_keys_are_private_from_their_first_byte_even_in_an_open_directory(tmp_path, monkeypatch):
    directory = tmp_path / "keys"
    directory.mkdir(mode=0o755)
    directory.chmod(0o755)
    seen = []
    create = wire_security.zmq.auth.create_certificates

    def create_and_look(folder, role):  # what another user could read the moment the secret exists
        public, secret = create(folder, role)
        seen.append((os.stat(secret).st_mode & 0o777, os.stat(folder).st_mode & 0o777))
        return public, secret

    monkeypatch.setattr(wire_security.zmq.auth, "create_certificates", create_and_look)
    previous = os.umask(0o022)
    try:
        secrets = make_keys(directory)
    finally:
        os.umask(previous)
    assert seen and all(modes == (0o600, 0o700) for modes in seen)
    assert all(secret.stat().st_mode & 0o777 == 0o600 for secret in secrets)
    assert all((directory / role).stat().st_mode & 0o777 == 0o700 for role in ("scheduler", "api", "worker"))
    assert load_keys(directory / "api", "api").scheduler_public  # still a usable set


GREETING = b"\xff" + b"\x00" * 8 + b"\x7f" + bytes([3, 0]) + b"CURVE".ljust(20, b"\x00") + b"\x00" * 32  # ZMTP 3.0
NOBODY = 65534


def as_another_user(attack: Callable[[], object]) -> object:
    """Run `attack` in a child process as the user nobody, as a co-located attacker would, and
    return what it returned (JSON through a pipe)."""
    "warm".encode("idna")  # the codec's module cannot be imported once this runs as nobody
    read_end, write_end = os.pipe()
    child = os.fork()
    if child == 0:
        result: object = None
        try:
            os.close(read_end)
            os.setgid(NOBODY)
            os.setuid(NOBODY)
            result = attack()
        finally:
            os.write(write_end, json.dumps(result).encode())
            os._exit(0)
    os.close(write_end)
    with os.fdopen(read_end) as pipe:
        text = pipe.read()
    os.waitpid(child, 0)
    return json.loads(text or "null")


needs_root = pytest.mark.skipif(os.getuid() != 0, reason="runs the attacker as another user")


def scheduler_on_tcp(tmp_path, keys_dir: str, *flags: str) -> tuple[subprocess.Popen, int, int]:
    """The scheduler alone on two tcp ports with its keys, logging to tmp_path/scheduler.log, once
    both ports accept: (process, api port, worker port)."""
    scheduler_port, worker_port = free_port(), free_port()
    scheduler = start(
        "services.scheduler",
        "--scheduler-endpoint",
        f"tcp://127.0.0.1:{scheduler_port}",
        "--worker-endpoint",
        f"tcp://127.0.0.1:{worker_port}",
        "--keys-dir",
        f"{keys_dir}/scheduler",
        *flags,
        log=str(tmp_path / "scheduler.log"),
    )
    assert wait_until(lambda: _accepts(scheduler_port) and _accepts(worker_port), 30)
    return scheduler, scheduler_port, worker_port


@needs_root
@pytest.mark.parametrize("port, frame_mib", [("worker", 60), ("api", 15)])
def test_keyless_peers_are_few_at_a_time_and_dropped_within_the_handshake_interval_and_their_memory_returns(
    tmp_path, keys_dir, port, frame_mib
):
    """Twice, 16 keyless peers of another user, from one address, each begin a frame just under the
    port's limit (64 MiB on the worker port, 16 on the api port) and push it as fast as they can:
    two at a time are let in (HandshakeBudget), the rest are cut at once, all are dropped within the
    handshake interval, and what they made the scheduler hold goes back once they are gone."""
    scheduler, api_port, worker_port = scheduler_on_tcp(tmp_path, keys_dir)
    target, frame = (worker_port if port == "worker" else api_port), frame_mib << 20

    def attack() -> list[tuple[str, float]]:
        chunk = os.urandom(1 << 20)
        outcomes: list[tuple[str, float]] = []

        def push() -> None:
            started = time.monotonic()
            with socket.create_connection(("127.0.0.1", target)) as raw:
                raw.settimeout(5)
                try:
                    raw.sendall(GREETING + b"\x06" + frame.to_bytes(8, "big"))
                    for _ in range(frame >> 20):
                        raw.sendall(chunk)
                    while raw.recv(4096):  # the server's greeting, then its close
                        pass
                    outcomes.append(("let in, then dropped", time.monotonic() - started))
                except OSError:  # reset, or a full window that nobody reads any more
                    outcomes.append(("cut", 0.0))

        peers = [threading.Thread(target=push) for _ in range(16)]
        for peer in peers:
            peer.start()
        for peer in peers:
            peer.join(60)
        return outcomes

    try:
        before, descriptors = memory_mib(scheduler.pid, "VmHWM"), len(os.listdir(f"/proc/{scheduler.pid}/fd"))
        resident = memory_mib(scheduler.pid, "VmRSS")
        outcomes = as_another_user(attack) + as_another_user(attack)
        grown = memory_mib(scheduler.pid, "VmHWM") - before
        returned = wait_until(lambda: memory_mib(scheduler.pid, "VmRSS") < resident + 16, 10)
        cut = [kind for kind, _ in outcomes].count("cut")
        let_in_for = max((seconds for kind, seconds in outcomes if kind != "cut"), default=0)
        print(
            f"2 x 16 keyless peers pushing {frame_mib} MiB frames to the {port} port: the scheduler's peak "
            f"memory grew {grown:.0f} MiB; {cut} cut at once, the others dropped after {let_in_for:.1f} s; "
            f"resident memory {resident:.0f} MiB before, {memory_mib(scheduler.pid, 'VmRSS'):.0f} MiB after"
        )
        assert len(outcomes) == 32 and cut >= 20  # a slot frees as soon as its peer is dropped
        assert let_in_for < sockets.HANDSHAKE_MS / 1000 + 2
        assert wait_until(lambda: len(os.listdir(f"/proc/{scheduler.pid}/fd")) <= descriptors, 5)  # none held
        assert grown < 2 * frame_mib + 40  # two let in at a time from one address, not sixteen
        assert returned  # and given back
        assert scheduler.poll() is None
    finally:
        scheduler.terminate()
        scheduler.wait(10)


@needs_root
def test_keyless_peers_reconnecting_flat_out_from_the_honest_peers_address_and_four_others_keep_nobody_out(
    tmp_path, keys_dir
):
    """Another user's peers hold every handshake slot they can get, from 127.0.0.1 (the honest
    peers' own address) and four more, reconnecting the moment they are cut. A new api and a
    restarted worker still connect within 2 s, each time, and the scheduler's memory stays put."""
    scheduler, scheduler_port, worker_port = scheduler_on_tcp(tmp_path, keys_dir)
    api_keys, worker_keys = load_keys(f"{keys_dir}/api", "api"), load_keys(f"{keys_dir}/worker", "worker")
    flood_seconds = 12.0

    def flood() -> int:
        attempts = [0]
        until = time.monotonic() + flood_seconds

        def hold_the_door(source: str, port: int) -> None:
            while time.monotonic() < until:
                try:
                    with socket.socket() as raw:
                        raw.bind((source, 0))
                        raw.settimeout(3)
                        raw.connect(("127.0.0.1", port))
                        raw.sendall(GREETING)
                        attempts[0] += 1
                        while raw.recv(4096):  # held until cut, or dropped at the handshake interval
                            pass
                except OSError:
                    pass

        sources = ["127.0.0.1", "127.0.0.2", "127.0.0.3", "127.0.0.4", "127.0.0.5"]
        threads = [
            threading.Thread(target=hold_the_door, args=(source, port))
            for source in sources
            for port in (scheduler_port, worker_port)
            for _ in range(3)
        ]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(flood_seconds + 10)
        return attempts[0]

    def new_api_answered_in() -> float:
        started = time.monotonic()
        context, api = zmq_peer(scheduler_port, api_keys)
        try:
            sockets.send(api, Ping(time.time()))
            answered = api.poll(10_000) and isinstance(sockets.receive(api)[1], Pong)
            return time.monotonic() - started if answered else float("inf")
        finally:
            context.destroy(linger=0)

    def restarted_worker_connected_in() -> float:
        started = time.monotonic()
        context = zmq.Context()
        worker = sockets.new_socket(context, zmq.DEALER)
        wire_security.connect_securely(worker, worker_keys)
        events = worker.get_monitor_socket(zmq.EVENT_HANDSHAKE_SUCCEEDED)
        worker.connect(f"tcp://127.0.0.1:{worker_port}")
        try:
            return time.monotonic() - started if events.poll(10_000) else float("inf")
        finally:
            worker.disable_monitor()
            events.close()
            context.destroy(linger=0)

    flooding = threading.Thread(target=lambda: results.append(as_another_user(flood)))
    results: list[object] = []
    try:
        before = memory_mib(scheduler.pid, "VmRSS")
        descriptors = len(os.listdir(f"/proc/{scheduler.pid}/fd"))
        flooding.start()
        assert wait_until(lambda: len(os.listdir(f"/proc/{scheduler.pid}/fd")) >= descriptors + 10, 10)  # it is on
        waits = []
        while flooding.is_alive() and len(waits) < 8:
            waits += [new_api_answered_in(), restarted_worker_connected_in()]
        flooding.join(flood_seconds + 20)
        attempts = results[0]
        grown = memory_mib(scheduler.pid, "VmRSS") - before
        print(
            f"{attempts} keyless connections in {flood_seconds:.0f} s; honest peers got in after "
            f"{', '.join(f'{w:.2f}' for w in waits)} s; scheduler RSS grew {grown:.0f} MiB"
        )
        assert isinstance(attempts, int) and attempts > 1000  # the attack ran
        assert len(waits) == 8 and max(waits) < 2
        assert grown < 64
        assert scheduler.poll() is None
    finally:
        scheduler.terminate()
        scheduler.wait(10)


def test_the_handshake_budget_cuts_connections_past_two_from_an_address_within_their_handshake_interval():
    now = [0.0]
    budget = HandshakeBudget("api", per_address=2, own_uid=-1, interval=2.0, clock=lambda: now[0])  # all counted
    with socket.create_server(("127.0.0.1", 0)) as server:

        def connect() -> tuple[socket.socket, socket.socket]:
            client = socket.create_connection(server.getsockname())
            accepted = server.accept()[0]
            budget.on_event(zmq.EVENT_ACCEPTED, accepted.fileno())
            return client, accepted

        pairs = [connect() for _ in range(4)]
        assert sorted(budget.pending) == sorted(accepted.fileno() for _, accepted in pairs[:2])
        for client, _ in pairs[2:]:  # the two past the budget see the end of their stream
            client.settimeout(5)
            assert client.recv(1) == b""
        now[0] = 1.0
        budget.on_event(zmq.EVENT_DISCONNECTED, pairs[0][1].fileno())  # gone: no longer counted
        pairs.append(connect())
        assert pairs[-1][1].fileno() in budget.pending
        now[0] = 1.9  # the other two still within their intervals
        pairs.append(connect())
        assert pairs[-1][1].fileno() not in budget.pending
        now[0] = 2.5  # the second's interval is over: libzmq has authenticated or dropped it
        pairs.append(connect())
        assert pairs[-1][1].fileno() in budget.pending and budget.from_source["127.0.0.1"] == 2
        for each in pairs:
            for end in each:
                end.close()


def test_authenticated_peers_of_one_address_stop_counting_once_their_handshake_interval_ends():
    """On real libzmq events: its report of a finished handshake names no connection (its value is 0),
    so what frees an honest peer's slot is the end of its interval, not the report."""
    context = zmq.Context()
    server = WireKeys(*zmq.curve_keypair())
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    try:
        router = sockets.bind(context, zmq.ROUTER, endpoint, server, "api")  # no authenticator: any key is let in
        monitor = router.get_monitor_socket(zmq.EVENT_ACCEPTED | zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_DISCONNECTED)
        now = [0.0]
        budget = HandshakeBudget("api", per_address=2, own_uid=-1, clock=lambda: now[0])  # every peer counted

        def authenticated_peer() -> zmq.Socket:
            keys = WireKeys(*zmq.curve_keypair(), scheduler_public=server.public)
            dealer = sockets.connect(context, zmq.DEALER, endpoint, keys=keys)
            dealer.send(b"in")
            assert router.poll(5000) and router.recv_multipart()[1] == b"in"  # its handshake is done
            quiet_by = time.monotonic() + 1.0  # a peer that is cut reconnects, and is cut, again and again
            while time.monotonic() < quiet_by and monitor.poll(300):
                event = recv_monitor_message(monitor)
                budget.on_event(event["event"], event["value"])
            return dealer  # connected while the test runs

        peers = [authenticated_peer(), authenticated_peer()]
        assert budget.from_source["127.0.0.1"] == 2  # each within its first interval
        now[0] += sockets.HANDSHAKE_MS / 1000 + 0.1
        peers.append(authenticated_peer())  # counted, not cut: the first two no longer are
        assert budget.from_source["127.0.0.1"] == 1 and len(budget.pending) == 1
    finally:
        context.destroy(linger=0)


def test_the_handshake_budget_has_no_slot_for_all_addresses_that_many_addresses_could_fill():
    budget = HandshakeBudget("worker", per_address=2, own_uid=-1)
    with socket.create_server(("127.0.0.1", 0)) as server:
        connections = []
        for last in range(2, 23):  # 21 addresses, two handshakes each, then one more address
            for _ in range(2 if last < 22 else 1):
                client = socket.socket()
                client.bind((f"127.0.0.{last}", 0))
                client.connect(server.getsockname())
                connections += [client, server.accept()[0]]
                budget.on_event(zmq.EVENT_ACCEPTED, connections[-1].fileno())
        assert len(budget.pending) == 41 and budget.from_source["127.0.0.22"] == 1
        for each in connections:
            each.close()


def test_a_peer_running_as_this_services_user_is_not_counted_and_one_of_another_user_is():
    budget = HandshakeBudget("api", per_address=1)
    with socket.create_server(("127.0.0.1", 0)) as server:
        own = [socket.create_connection(server.getsockname()) for _ in range(3)]
        accepted = [server.accept()[0] for _ in own]
        for connection in accepted:
            budget.on_event(zmq.EVENT_ACCEPTED, connection.fileno())
        assert budget.pending == {}  # it can read this service's keys: a budget would not stop it
        for each in [*own, *accepted]:
            each.close()
    assert HandshakeBudget("api").own_uid == os.getuid()


def test_a_source_is_an_address_or_an_ipv6_64():
    assert source_of("10.0.0.7") == "10.0.0.7"
    assert source_of("::ffff:10.0.0.7") == "10.0.0.7"
    assert source_of("2001:db8:1:2:aaaa::1") == source_of("2001:db8:1:2:bbbb::9") == "2001:db8:1:2::/64"


def _accepts(port: int) -> bool:
    try:
        socket.create_connection(("127.0.0.1", port), timeout=1).close()
        return True
    except OSError:
        return False


def test_a_rate_limited_log_says_how_many_lines_it_dropped():
    now = [0.0]
    limit = RateLimit(burst=2, window=60.0, clock=lambda: now[0])
    records = [logging.LogRecord("x", logging.WARNING, __file__, 1, "refused %s", (i,), None) for i in range(5)]
    assert [limit.filter(r) for r in records] == [True, True, False, False, False]
    now[0] = 61.0
    late = logging.LogRecord("x", logging.WARNING, __file__, 1, "refused %s", (9,), None)
    assert limit.filter(late) and late.getMessage() == "refused 9 (3 more like this were not logged)"
