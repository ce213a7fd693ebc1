"""`pagedserve up` (or `pagedserve serve MODEL`): start the worker, the scheduler and the api on
this machine, and watch them.
`pagedserve keys DIR`: make the CURVE keys the services need on tcp:// endpoints.

It waits until the api answers /health, forwards SIGINT/SIGTERM to the children, and exits
non-zero as soon as any child dies. The children talk over Unix sockets in a private temporary
directory, removed when the launcher exits.
"""

from __future__ import annotations

import argparse
import ctypes
import importlib.metadata
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request

from shared.cli import (API_KEY_ENV, RUNTIME_DIR_ENV, HelpFormatter, add_api_args, add_scheduler_args,
                        add_worker_args, api_keys, keep_api_key_off_the_command_line)
from shared.config import SCHEDULER_METRICS_PORT, WORKER_METRICS_PORT, Endpoints, SpeculativeConfig

PR_SET_PDEATHSIG = 1

SHIPPED_MODEL = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "ops", "models", "tiny-python")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    return build_parser().parse_args(argv)


def _version() -> str:
    try:
        return importlib.metadata.version("pagedserve")
    except importlib.metadata.PackageNotFoundError:  # run from a source tree that was never installed
        return "(not installed)"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pagedserve", formatter_class=HelpFormatter)
    parser.add_argument("--version", action="version", version=f"pagedserve {_version()}")
    commands = parser.add_subparsers(dest="command", required=True)
    up = commands.add_parser("up", formatter_class=HelpFormatter, help="serve a model with all three processes on this machine")
    up.add_argument("--model", default=SHIPPED_MODEL, help="local HF-format model directory (default: the shipped tiny-python)")
    serve = commands.add_parser("serve", formatter_class=HelpFormatter,
                                help="the same as up, with the model as the first argument (as `vllm serve MODEL`)")
    serve.add_argument("model", help="local HF-format model directory")
    for command in (up, serve):
        add_api_args(command)
        add_scheduler_args(command)
        add_worker_args(command)
        command.add_argument("--ready-timeout", type=float, default=300.0, help="seconds to wait for /health")
        command.add_argument("--scheduler-metrics-port", type=int, default=SCHEDULER_METRICS_PORT,
                             help="port of the scheduler's Prometheus /metrics, on --host (0: none)")
        command.add_argument("--worker-metrics-port", type=int, default=WORKER_METRICS_PORT,
                             help="port of the worker's Prometheus /metrics, on --host (0: none)")
    keys = commands.add_parser("keys", formatter_class=HelpFormatter, help="make CURVE key pairs for the scheduler, the api and the workers")
    keys.add_argument("directory", help="gets one folder per service: scheduler/, api/, worker/")
    keys.add_argument("--force", action="store_true", help="replace keys already there")
    return parser


def make_keys(args: argparse.Namespace) -> int:
    from shared.wire_security import make_keys as write_keys

    if os.path.exists(os.path.join(args.directory, "scheduler", "scheduler.key_secret")) and not args.force:
        print(f"pagedserve: keys already in {args.directory} (--force replaces them)", file=sys.stderr)
        return 0
    for path in write_keys(args.directory):
        print(path)
    return 0


def _flags(args: argparse.Namespace, names: list[str]) -> list[str]:
    flags = []
    for name in names:
        value = getattr(args, name)
        flag = f"--{name.replace('_', '-')}"
        if isinstance(value, SpeculativeConfig):
            flags += [flag, value.to_json()]
        elif value is True:
            flags.append(flag)
        elif value is False and name in ("enable_chunked_prefill", "async_scheduling", "report_cached_tokens"):
            flags.append(f"--no-{flag[2:]}")
        elif value is not None and value is not False:
            flags += [flag, str(value)]
    return flags


SCHEDULER_FLAGS = ["block_size", "max_num_seqs", "max_num_batched_tokens", "max_model_len",
                   "num_gpu_blocks_override", "enable_prefix_caching", "enable_chunked_prefill",
                   "preemption_mode", "kv_reservation", "async_scheduling", "step_timeout", "log_stats_interval",
                   "speculative_config"]
WORKER_FLAGS = ["model", "tokenizer", "device", "dtype", "load_format", "gpu_memory_utilization", "kv_cache_memory", "swap_space",
                "seed", "cpu_threads", "block_size", "num_gpu_blocks_override", "tensor_parallel_size",
                "speculative_config"]
API_FLAGS = ["model", "tokenizer", "host", "port", "served_model_name", "max_request_body_bytes",
             "enable_auto_tool_choice", "tool_call_parser", "chat_template", "max_logprobs", "disable_log_requests",
             "trust_remote_code", "scheduler_timeout", "report_cached_tokens", "request_header_timeout",
             "request_body_timeout"]


def commands(args: argparse.Namespace, endpoints: Endpoints) -> dict[str, list[str]]:
    python = [sys.executable, "-m"]
    return {
        "scheduler": python + ["services.scheduler", "--scheduler-endpoint", endpoints.scheduler,
                               "--worker-endpoint", endpoints.workers, "--world-size", str(args.tensor_parallel_size)]
        + _flags(args, SCHEDULER_FLAGS)
        + ["--metrics-host", args.host, "--metrics-port", str(args.scheduler_metrics_port)],
        "worker": python + ["services.worker", "--worker-endpoint", endpoints.workers]
        + _flags(args, WORKER_FLAGS) + ["--metrics-host", args.host, "--metrics-port", str(args.worker_metrics_port)],
        "api": python + ["services.api", "--scheduler-endpoint", endpoints.scheduler]
        + _flags(args, API_FLAGS),
    }


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.command == "keys":
        return make_keys(args)
    problem = _startup_problem(args)
    if problem:
        print(f"pagedserve: {problem}", file=sys.stderr)
        return 2
    wanted = [("the api", "--port", args.port), ("the scheduler's metrics", "--scheduler-metrics-port",
                                                  args.scheduler_metrics_port)]
    if args.worker_metrics_port:  # rank r serves on the port + r
        wanted += [(f"worker rank {rank}'s metrics", "--worker-metrics-port", args.worker_metrics_port + rank)
                   for rank in range(args.tensor_parallel_size)]
    for service, flag, port in wanted:
        problem = _port_problem(args.host, port) if port else None
        if problem:  # before any model loads, so a busy port costs no start-up time
            print(f"pagedserve: cannot listen on {args.host}:{port} for {service}: {problem} "
                  f"(choose another with {flag})", file=sys.stderr)
            return 2
    directory = tempfile.mkdtemp(prefix="pagedserve-")  # mode 0700
    try:
        return _supervise(args, Endpoints.local(directory), directory)
    finally:
        shutil.rmtree(directory, ignore_errors=True)


def _exited(children: dict[str, subprocess.Popen]) -> dict[str, int]:
    return {name: child.returncode for name, child in children.items() if child.poll() is not None}


def _supervise(args: argparse.Namespace, endpoints: Endpoints, runtime_dir: str) -> int:
    keys = api_keys(args)
    env = {name: dict(os.environ) for name in ("scheduler", "worker", "api")}
    if keys:
        env["api"][API_KEY_ENV] = ",".join(keys)
    # Whoever outlives the launcher (SIGKILLed, so its finally never runs) removes the socket directory.
    env["scheduler"][RUNTIME_DIR_ENV] = runtime_dir
    launcher = os.getpid()
    children = {name: subprocess.Popen(cmd, env=env[name], preexec_fn=lambda: _die_with(launcher))
                for name, cmd in commands(args, endpoints).items()}
    stopping = False
    failed = False

    def stop(signum, frame):
        nonlocal stopping
        stopping = True
        for child in children.values():
            if child.poll() is None:
                child.send_signal(signum)

    signal.signal(signal.SIGINT, stop)
    signal.signal(signal.SIGTERM, stop)
    url = f"http://{args.host}:{args.port}/health"
    deadline = time.monotonic() + args.ready_timeout
    ready = False
    while not stopping:
        dead = _exited(children)
        if dead:
            if not any(dead.values()):  # a clean exit follows another's failure: let the cause show first
                grace = time.monotonic() + 1.0
                while time.monotonic() < grace and not any(dead.values()):
                    time.sleep(0.05)
                    dead = _exited(children)
            for name, code in sorted(dead.items(), key=lambda item: item[1] == 0):
                print(f"pagedserve: {name} exited with code {code}; stopping", file=sys.stderr)
            failed = True
            stop(signal.SIGTERM, None)
            break
        if not ready:
            ready = _healthy(url)
            if ready:
                print(f"pagedserve: ready at http://{args.host}:{args.port}/v1", file=sys.stderr, flush=True)
            elif time.monotonic() > deadline:
                print("pagedserve: not ready in time; stopping", file=sys.stderr)
                failed = True
                stop(signal.SIGTERM, None)
                break
        time.sleep(0.2)
    for child in children.values():
        _reap(child)
    return 1 if failed else 0


def _die_with(parent: int) -> None:
    """In a child before it runs: SIGTERM when the launcher dies, however it dies (Linux's
    PR_SET_PDEATHSIG), so a SIGKILLed launcher leaves no services behind."""
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    if os.getppid() != parent:  # it died before the request took hold
        os._exit(1)


def _startup_problem(args: argparse.Namespace) -> str | None:
    """What would stop the services from starting, found before any of them loads anything."""
    if getattr(args, "enable_auto_tool_choice", False) and not args.tool_call_parser:
        return "--enable-auto-tool-choice needs --tool-call-parser (hermes or llama3_json)"
    if not os.path.isdir(args.model):
        if re.fullmatch(r"[\w.-]+/[\w.-]+", args.model) and not os.path.exists(os.path.dirname(args.model)):
            return (f"{args.model} looks like a Hugging Face model id, and pagedserve serves local directories "
                    f"only (it never downloads): fetch it with `huggingface-cli download {args.model} --local-dir "
                    "DIR` where the hub is reachable, then serve DIR")
        return f"the model {args.model} is not a directory"
    if not os.path.isfile(os.path.join(args.model, "config.json")):
        return f"{args.model} has no config.json: it is not a Hugging Face model directory"
    try:
        with open(os.path.join(args.model, "config.json")) as f:
            config = json.load(f)
    except (OSError, ValueError) as exc:
        return f"cannot read {args.model}/config.json: {exc}"
    heads, size = config.get("num_attention_heads", config.get("n_head")), args.tensor_parallel_size
    if isinstance(heads, int) and heads % size:  # the ranks would find it only after loading
        return f"the number of attention heads ({heads}) is not divisible by the tensor-parallel size ({size})"
    if args.device == "cuda":
        import torch  # only here: it takes a second or two to import

        if not torch.cuda.is_available():
            return "--device cuda, but torch sees no CUDA device here (use --device cpu or auto)"
    return None


def _port_problem(host: str, port: int) -> str | None:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn binds
        try:
            probe.bind((host, port))
        except OSError as exc:
            return exc.strerror or str(exc)
    return None


def _healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=1) as response:
            return response.status == 200
    except OSError:
        return False


def _reap(child: subprocess.Popen, grace: float = 10.0) -> int:
    try:
        return child.wait(grace)
    except subprocess.TimeoutExpired:
        child.kill()
        return child.wait()


def main_entry() -> None:
    keep_api_key_off_the_command_line()
    sys.exit(main())


if __name__ == "__main__":
    main_entry()
