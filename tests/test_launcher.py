"""`pagedserve up` supervises its three processes."""

import importlib.metadata
import os
import shutil
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from tests.conftest import ROOT, free_port, metrics_port_flags, serve

pytestmark = pytest.mark.slow  # starts processes: not in `make check`


def test_the_launcher_exits_non_zero_when_a_child_dies_and_leaves_no_socket_directory(llama_dir, tmp_path, socket_dir):
    broken, temp = tmp_path / "broken", Path(socket_dir)
    broken.mkdir()
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):  # all but the weights
        shutil.copy(os.path.join(llama_dir, name), broken)
    cmd = [
        sys.executable,
        "-m",
        "services.launcher",
        "up",
        "--model",
        str(broken),
        "--port",
        str(free_port()),
        *metrics_port_flags(),
        "--device",
        "cpu",
        "--ready-timeout",
        "60",
    ]
    done = subprocess.run(
        cmd, cwd=ROOT, capture_output=True, text=True, timeout=90, env=dict(os.environ, TMPDIR=str(temp))
    )
    assert done.returncode != 0
    assert "cannot load the model" in done.stderr and "model.safetensors is missing" in done.stderr
    assert "worker exited with code 2" in done.stderr
    assert list(temp.iterdir()) == []  # the ipc sockets' directory went with the services


def test_start_up_refuses_budgets_that_could_never_run_a_full_length_request(llama_dir):
    cmd = [
        sys.executable,
        "-m",
        "services.launcher",
        "up",
        "--model",
        llama_dir,
        "--port",
        str(free_port()),
        *metrics_port_flags(),
        "--device",
        "cpu",
        "--kv-cache-memory",
        "0.05",
        "--swap-space",
        "0.05",
        "--ready-timeout",
        "60",
        "--no-enable-chunked-prefill",
        "--max-num-batched-tokens",
        "64",
    ]
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=90)
    assert done.returncode != 0
    assert "max_num_batched_tokens (64) is below the context (512)" in done.stderr
    assert "scheduler exited with code 2" in done.stderr


def test_a_dummy_weight_model_serves_requests_with_a_tokenizer_from_elsewhere(llama_dir, tmp_path):
    shutil.copy(os.path.join(llama_dir, "config.json"), tmp_path)  # a config alone, as in ops/configs/
    with serve(str(tmp_path), str(tmp_path), "--load-format", "dummy", "--tokenizer", llama_dir) as server:
        response = httpx.post(
            f"{server.base_url}/v1/completions",
            timeout=60,
            json={"model": server.model, "prompt": "def f():", "max_tokens": 5, "ignore_eos": True},
        )
    assert response.status_code == 200 and response.json()["usage"]["completion_tokens"] == 5
    # A clean stop is quiet: the services' shutdown is logged at INFO, and the api says where it listened.
    log = server.log()
    assert server.process.returncode == 0
    assert [line for line in log.splitlines() if " ERROR " in line] == [], log
    assert f"listening on {server.base_url}" in log


def test_version_is_the_installed_packages():
    done = subprocess.run(
        [sys.executable, "-m", "services.launcher", "--version"], cwd=ROOT, capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0 and done.stdout.strip() == f"pagedserve {importlib.metadata.version('pagedserve')}"


def _parsers():
    import argparse

    from services.api.__main__ import build_parser as api_parser
    from services.launcher import build_parser as launcher_parser
    from services.scheduler.__main__ import build_parser as scheduler_parser
    from services.worker.__main__ import build_parser as worker_parser

    launcher = launcher_parser()
    commands = next(a for a in launcher._actions if isinstance(a, argparse._SubParsersAction))
    return {
        "pagedserve up": commands.choices["up"],
        "pagedserve serve": commands.choices["serve"],
        "pagedserve keys": commands.choices["keys"],
        "services.api": api_parser(),
        "services.scheduler": scheduler_parser(),
        "services.worker": worker_parser(),
    }


@pytest.mark.parametrize(
    "name",
    ["pagedserve up", "pagedserve serve", "pagedserve keys", "services.api", "services.scheduler", "services.worker"],
)
def test_every_flag_has_help_and_shows_its_default(name):
    parser = _parsers()[name]
    text = parser.format_help()
    for action in parser._actions:
        if action.dest == "help":
            continue
        assert action.help, f"{name}: {action.option_strings or action.dest} has no help"
        shown = parser.formatter_class(prog=name)._get_help_string(action)
        if action.option_strings and not action.required:
            assert "(default:" in shown, f"{name}: {action.option_strings} shows no default"
    assert "never shown" in text or name in ("pagedserve keys", "services.scheduler", "services.worker")


@pytest.mark.parametrize("flag, service", [("--port", "the api"), ("--worker-metrics-port", "worker rank 0's metrics")])
def test_a_busy_port_fails_at_once_with_one_line_naming_its_service_and_flag(llama_dir, flag, service):
    import socket

    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        ports = {
            "--port": str(free_port()),
            "--scheduler-metrics-port": str(free_port()),
            "--worker-metrics-port": str(free_port()),
            flag: str(port),
        }
        done = subprocess.run(
            [
                sys.executable,
                "-m",
                "services.launcher",
                "serve",
                llama_dir,
                "--device",
                "cpu",
                *[item for pair in ports.items() for item in pair],
            ],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=60,
        )
    # At once: the one line is all it wrote, before any service started or any model loaded.
    assert done.returncode == 2
    lines = (done.stdout + done.stderr).strip().splitlines()
    assert len(lines) == 1 and f"cannot listen on 127.0.0.1:{port} for {service}" in lines[0], lines
    assert f"(choose another with {flag})" in lines[0]


@pytest.mark.parametrize("case", ["empty model directory", "no cuda", "hub id"])
def test_startup_failures_are_one_line_and_a_non_zero_exit(tmp_path, llama_dir, case):
    import torch

    if case == "no cuda" and torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    model, expected = {
        "empty model directory": (str(tmp_path), "has no config.json"),
        "no cuda": (llama_dir, "--device cuda, but torch sees no CUDA device"),
        "hub id": ("Qwen/Qwen2.5-0.5B-Instruct", "serves local directories only"),
    }[case]
    device = "cuda" if case == "no cuda" else "cpu"
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "services.launcher",
            "serve",
            model,
            "--port",
            str(free_port()),
            *metrics_port_flags(),
            "--device",
            device,
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    lines = (done.stdout + done.stderr).strip().splitlines()
    assert done.returncode == 2 and len(lines) == 1 and expected in lines[0]


def test_engines_whose_metrics_ports_would_collide_are_refused_before_anything_starts(llama_dir):
    base = free_port(span=12)
    # engine 0's worker is given base + 10, which engine 1's scheduler takes too
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "services.launcher",
            "serve",
            llama_dir,
            "--device",
            "cpu",
            "--data-parallel-size",
            "2",
            "--port",
            str(free_port()),
            "--scheduler-metrics-port",
            str(base),
            "--worker-metrics-port",
            str(base + 10),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 2
    [line] = (done.stdout + done.stderr).strip().splitlines()
    assert f"would both listen on port {base + 10}" in line and "engine 1's scheduler" in line


def test_with_several_engines_each_gets_its_own_sockets_and_metrics_ports():
    from services.launcher import commands, parse_args

    args = parse_args(
        [
            "up",
            "--data-parallel-size",
            "2",
            "--scheduler-metrics-port",
            "9001",
            "--worker-metrics-port",
            "9002",
            "-tp",
            "2",
        ]
    )
    services = commands(args, "/run/x")
    assert set(services) == {
        "engine 0's scheduler",
        "engine 0's worker",
        "engine 1's scheduler",
        "engine 1's worker",
        "api",
    }

    def flag(service: str, name: str) -> str:
        command = services[service]
        return command[command.index(name) + 1]

    assert flag("engine 0's scheduler", "--metrics-port") == "9001"
    assert flag("engine 1's scheduler", "--metrics-port") == "9011"
    assert flag("engine 1's worker", "--metrics-port") == "9012"  # its ranks: 9012 and 9013
    assert flag("engine 0's worker", "--worker-endpoint") == flag("engine 0's scheduler", "--worker-endpoint")
    assert flag("engine 1's worker", "--worker-endpoint") == flag("engine 1's scheduler", "--worker-endpoint")
    assert flag("engine 0's worker", "--worker-endpoint") != flag("engine 1's worker", "--worker-endpoint")
    assert flag("api", "--scheduler-endpoint") == ",".join(
        flag(f"engine {i}'s scheduler", "--scheduler-endpoint") for i in range(2)
    )
    assert flag("api", "--routing") == "prefix"


def test_sockets_go_under_tmp_when_the_temporary_directory_is_too_deep_for_their_paths(tmp_path, monkeypatch):
    import tempfile

    from services.launcher import SOCKET_PATH_MAX, socket_directory
    from shared.config import Endpoints

    deep = tmp_path / ("d" * 60) / ("e" * 60)
    deep.mkdir(parents=True)
    monkeypatch.setattr(tempfile, "tempdir", str(deep))
    chosen = socket_directory(engines=2)
    try:
        assert os.path.dirname(chosen) == "/tmp" and os.stat(chosen).st_mode & 0o777 == 0o700
        assert len(Endpoints.local(chosen, 1).workers.removeprefix("ipc://")) <= SOCKET_PATH_MAX
    finally:
        os.rmdir(chosen)
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # short enough: the temporary directory itself
    chosen = socket_directory(engines=1)
    assert os.path.dirname(chosen) == str(tmp_path)
    os.rmdir(chosen)


@pytest.mark.parametrize("service", ["scheduler", "worker"])
def test_a_port_taken_after_the_launcher_looked_stops_it_at_once_naming_the_flag(
    llama_dir, service, monkeypatch, capsys
):
    """The launcher checks its ports before anything starts; one taken between that check and the
    service's bind (a race) ends the service with EXIT_PORT_TAKEN, and the launcher then stops at once,
    naming the flag, rather than restarting what cannot start."""
    import signal
    import socket

    from services import launcher

    monkeypatch.setattr(launcher, "port_problem", lambda host, port: None)  # the check passes: the race
    handlers = {signum: signal.getsignal(signum) for signum in (signal.SIGINT, signal.SIGTERM)}
    flag = f"--{service}-metrics-port"
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        ports = {
            "--port": str(free_port()),
            "--scheduler-metrics-port": str(free_port()),
            "--worker-metrics-port": str(free_port()),
            flag: str(holder.getsockname()[1]),
        }
        try:
            code = launcher.main(
                [
                    "serve",
                    llama_dir,
                    "--device",
                    "cpu",
                    "--data-parallel-size",
                    "2",
                    *[item for pair in ports.items() for item in pair],
                ]
            )
        finally:
            for signum, handler in handlers.items():
                signal.signal(signum, handler)
    printed = capsys.readouterr().err
    assert code == 1, printed
    assert f"could not listen on its port, taken since start-up (choose another with {flag})" in printed, printed
    assert "restarting" not in printed
