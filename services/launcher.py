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
from types import FrameType

from services.restarts import Restarts, reap
from shared.cli import (
    API_KEY_ENV,
    ENGINE_ENV,
    EXIT_PORT_TAKEN,
    RUNTIME_DIR_ENV,
    HelpFormatter,
    add_api_args,
    add_lora_args,
    add_model_args,
    add_scheduler_args,
    add_worker_args,
    api_keys,
    keep_api_key_off_the_command_line,
)
from shared.config import (
    ENGINE_PORT_STRIDE,
    ApiConfig,
    Endpoints,
    LauncherConfig,
    LoraConfig,
    ModelConfig,
    SchedulerConfig,
    WorkerConfig,
)
from shared.kv_transfer_config import KVTransferConfig
from shared.options import add_options, from_namespace, to_flags

PR_SET_PDEATHSIG = 1
SOCKET_PATH_MAX = 107  # bytes of a Unix socket's path (sockaddr_un.sun_path, less its NUL)
STOP_CODES = (0, -signal.SIGINT, -signal.SIGTERM)  # how a child ends when asked to stop

SHIPPED_MODEL = os.path.join(
    os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "ops", "models", "tiny-python"
)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    args = build_parser().parse_args(argv)
    if getattr(args, "pd", None):  # P prefill engines, then D decode engines
        args.num_prefill, decode = (int(n) for n in args.pd.split(":"))
        args.data_parallel_size = args.num_prefill + decode
    return args


def pd_flags(args: argparse.Namespace, engine: int, directory: str) -> tuple[list[str], list[str]]:
    """With --pd: engine i's scheduler flags and worker flags for its part, prefill or decode, and its share of the
    cores."""
    if not getattr(args, "pd", None):
        return [], []
    role = "kv_producer" if engine < args.num_prefill else "kv_consumer"
    address = f"ipc://{os.path.join(directory, f'kv-{engine}.sock')}"
    base = args.kv_transfer or KVTransferConfig(role)
    config = KVTransferConfig(role, base.connector, base.ip, base.port, address, base.key_file, base.hold_seconds)
    scheduler = ["--kv-transfer-config", config.to_json()]
    if role == "kv_consumer" and not args.enable_prefix_caching:
        scheduler.append("--enable-prefix-caching")  # fetched blocks arrive through the prefix cache
    cores = max(1, (os.cpu_count() or 1) // args.data_parallel_size)
    return scheduler, [] if args.cpu_threads else ["--cpu-threads", str(cores)]


def _version() -> str:
    try:
        return importlib.metadata.version("pagedserve")
    except importlib.metadata.PackageNotFoundError:  # run from a source tree that was never installed
        return "(not installed)"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pagedserve", formatter_class=HelpFormatter)
    parser.add_argument("--version", action="version", version=f"pagedserve {_version()}")
    commands = parser.add_subparsers(dest="command", required=True)
    up = commands.add_parser(
        "up", formatter_class=HelpFormatter, help="serve a model with all three processes on this machine"
    )
    add_model_args(up, model=SHIPPED_MODEL)
    serve = commands.add_parser(
        "serve",
        formatter_class=HelpFormatter,
        help="the same as up, with the model as the first argument (as `vllm serve MODEL`)",
    )
    add_model_args(serve, positional=True)
    for command in (up, serve):
        add_options(command, LauncherConfig, "launcher")
        add_api_args(command)
        add_scheduler_args(command)
        add_worker_args(command)
        add_lora_args(command)
    keys = commands.add_parser(
        "keys", formatter_class=HelpFormatter, help="make CURVE key pairs for the scheduler, the api and the workers"
    )
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


def engine_names(args: argparse.Namespace, engine: int) -> tuple[str, str]:
    """The names the launcher gives an engine's scheduler and worker in what it prints."""
    if args.data_parallel_size == 1:
        return "scheduler", "worker"
    return f"engine {engine}'s scheduler", f"engine {engine}'s worker"


def metrics_ports(args: argparse.Namespace, engine: int) -> tuple[int, int]:
    """Engine i's scheduler metrics port and its worker rank 0's (0: none)."""
    shift = ENGINE_PORT_STRIDE * engine
    return (
        args.scheduler_metrics_port + shift if args.scheduler_metrics_port else 0,
        args.worker_metrics_port + shift if args.worker_metrics_port else 0,
    )


def commands(args: argparse.Namespace, directory: str) -> dict[str, list[str]]:
    """Each service's command line: its part of the typed configs, as flags (shared/options.py)."""
    python = [sys.executable, "-m"]
    model = to_flags(from_namespace(ModelConfig, args))
    scheduler_flags = to_flags(from_namespace(SchedulerConfig, args))
    lora_flags = to_flags(from_namespace(LoraConfig, args))
    engines = [Endpoints.local(directory, engine) for engine in range(args.data_parallel_size)]
    services = {}
    for engine, endpoints in enumerate(engines):
        scheduler, worker = engine_names(args, engine)
        scheduler_port, worker_port = metrics_ports(args, engine)
        pd_scheduler, pd_worker = pd_flags(args, engine, directory)
        services[scheduler] = [
            *python,
            "services.scheduler",
            "--scheduler-endpoint",
            endpoints.scheduler,
            "--worker-endpoint",
            endpoints.workers,
            "--world-size",
            str(args.tensor_parallel_size),
            *scheduler_flags,
            *pd_scheduler,
            *lora_flags,
            "--metrics-host",
            args.host,
            "--metrics-port",
            str(scheduler_port),
        ]
        services[worker] = [
            *python,
            "services.worker",
            "--worker-endpoint",
            endpoints.workers,
            *model,
            *to_flags(from_namespace(WorkerConfig, args)),
            *scheduler_flags,
            *pd_scheduler,
            *pd_worker,
            *lora_flags,
            "--metrics-host",
            args.host,
            "--metrics-port",
            str(worker_port),
        ]
    # The key goes to the api in its environment, never on a command line.
    api = from_namespace(ApiConfig, args, api_key=None, api_key_file=None)
    services["api"] = [
        *python,
        "services.api",
        "--scheduler-endpoint",
        ",".join(e.scheduler for e in engines[getattr(args, "num_prefill", 0) :]),
        *(["--prefill-endpoint", ",".join(e.scheduler for e in engines[: args.num_prefill])] if args.pd else []),
        *model,
        *to_flags(api),
        *lora_flags,
        "--shutdown-timeout",
        repr(args.shutdown_timeout),
    ]
    return services


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.command == "keys":
        return make_keys(args)
    problem = _startup_problem(args)
    if problem:
        print(f"pagedserve: {problem}", file=sys.stderr)
        return 2
    wanted = [("the api", "--port", args.port)]
    for engine in range(args.data_parallel_size):
        scheduler, worker = engine_names(args, engine)
        scheduler_port, worker_port = metrics_ports(args, engine)
        the = "the " if args.data_parallel_size == 1 else ""
        wanted.append((f"{the}{scheduler}'s metrics", "--scheduler-metrics-port", scheduler_port))
        if worker_port:  # rank r serves on the port + r
            wanted += [
                (f"{worker} rank {rank}'s metrics", "--worker-metrics-port", worker_port + rank)
                for rank in range(args.tensor_parallel_size)
            ]
    taken: dict[int, str] = {}
    for service, flag, port in wanted:
        if port and port in taken:
            print(
                f"pagedserve: {service} ({flag}) and {taken[port]} would both listen on port {port} (choose ports "
                f"{ENGINE_PORT_STRIDE} or more apart, or fewer ranks)",
                file=sys.stderr,
            )
            return 2
        taken[port] = service
    for service, flag, port in wanted:
        problem = port_problem(args.host, port) if port else None
        if problem:  # before any model loads, so a busy port costs no start-up time
            print(
                f"pagedserve: cannot listen on {args.host}:{port} for {service}: {problem} "
                f"(choose another with {flag})",
                file=sys.stderr,
            )
            return 2
    directory = socket_directory(args.data_parallel_size)
    if directory is None:
        print(
            f"pagedserve: the temporary directory {tempfile.gettempdir()} is too deep for Unix socket paths "
            f"({SOCKET_PATH_MAX} bytes at most), and so is /tmp: set TMPDIR to a shorter one",
            file=sys.stderr,
        )
        return 2
    try:
        return _supervise(args, directory)
    finally:
        shutil.rmtree(directory, ignore_errors=True)


def socket_directory(engines: int) -> str | None:
    """A new private directory (mode 0700) for the services' Unix sockets: in the temporary directory
    where the longest socket path fits in an address, else in /tmp (a deep TMPDIR, as test runners
    and some schedulers set, would otherwise fail the scheduler's bind); None where neither fits."""
    for parent in dict.fromkeys([tempfile.gettempdir(), "/tmp"]):
        name = os.path.join(parent, "pagedserve-" + "x" * 8)  # mkdtemp's random part is 8 characters
        longest = Endpoints.local(name, engines - 1).workers.removeprefix("ipc://")
        if len(longest.encode()) <= SOCKET_PATH_MAX and os.path.isdir(parent):
            return tempfile.mkdtemp(prefix="pagedserve-", dir=parent)
    return None


def _exited(children: dict[str, subprocess.Popen[bytes]]) -> dict[str, int]:
    return {name: child.returncode for name, child in children.items() if child.poll() is not None}


def _supervise(args: argparse.Namespace, runtime_dir: str) -> int:
    keys = api_keys(args)
    env = {name: value for name, value in os.environ.items() if name != API_KEY_ENV}  # only the api needs it
    api_env = {**env, API_KEY_ENV: ",".join(keys)} if keys else env
    # Whoever outlives the launcher (SIGKILLed, so its finally never runs) removes the socket directory.
    scheduler_env = {**env, RUNTIME_DIR_ENV: runtime_dir}
    launcher = os.getpid()
    services = commands(args, runtime_dir)
    schedulers = {engine_names(args, engine)[0] for engine in range(args.data_parallel_size)}
    engine_of = {name: engine for engine in range(args.data_parallel_size) for name in engine_names(args, engine)}

    def start(name: str) -> subprocess.Popen[bytes]:
        service_env = api_env if name == "api" else scheduler_env if name in schedulers else env
        if name in engine_of and args.data_parallel_size > 1:
            service_env = {**service_env, ENGINE_ENV: str(engine_of[name])}
        return subprocess.Popen(services[name], env=service_env, preexec_fn=lambda: _die_with(launcher))

    children = {name: start(name) for name in services}
    restarts = Restarts(restart_parts(args), children, start)
    stopping = False
    failed = False

    def stop(signum: int, frame: FrameType | None) -> None:
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
        taken = [name for name, code in dead.items() if code == EXIT_PORT_TAKEN]
        # Before the first ready, a port taken since the check above would only be taken again. After it, the
        # port was the service's own a moment ago, held briefly by another socket: restarts (rate-limited) retry.
        if taken and not ready:
            for name in taken:
                print(
                    f"pagedserve: {name} could not listen on its port, taken since start-up (choose another "
                    f"with {port_flag(args, name)}); stopping",
                    file=sys.stderr,
                )
            failed = True
            stop(signal.SIGTERM, None)
            break
        if dead and ready:  # after start-up, a death is a crash (or a kill) to recover from
            if any(code in STOP_CODES for code in dead.values()):
                time.sleep(0.5)  # Ctrl-C reaches the whole process group: the launcher's own stop comes too
            if stopping:
                break
            if restarts.restart(dead):
                continue
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
        reap(child)
    return 1 if failed else 0


def restart_parts(args: argparse.Namespace) -> dict[str, tuple[str, ...]]:
    """What restarts together: the api alone, each engine's scheduler and worker together."""
    parts: dict[str, tuple[str, ...]] = {"the api": ("api",)}
    for engine in range(args.data_parallel_size):
        label = f"engine {engine}" if args.data_parallel_size > 1 else "the scheduler and the worker"
        parts[label] = engine_names(args, engine)
    return parts


def port_flag(args: argparse.Namespace, name: str) -> str:
    """The flag that moves the port of the service `name`."""
    if name == "api":
        return "--port"
    schedulers = {engine_names(args, engine)[0] for engine in range(args.data_parallel_size)}
    return "--scheduler-metrics-port" if name in schedulers else "--worker-metrics-port"


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
            return (
                f"{args.model} looks like a Hugging Face model id, and pagedserve serves local directories "
                f"only (it never downloads): fetch it with `huggingface-cli download {args.model} --local-dir "
                "DIR` where the hub is reachable, then serve DIR"
            )
        return f"the model {args.model} is not a directory"
    if not os.path.isfile(os.path.join(args.model, "config.json")):
        return f"{args.model} has no config.json: it is not a Hugging Face model directory"
    try:
        with open(os.path.join(args.model, "config.json")) as f:
            config = json.load(f)
    except (OSError, ValueError) as exc:
        return f"cannot read {args.model}/config.json: {exc}"
    if args.data_parallel_size < 1:
        return "--data-parallel-size must be 1 or more"
    heads, size = config.get("num_attention_heads", config.get("n_head")), args.tensor_parallel_size
    if isinstance(heads, int) and heads % size:  # the ranks would find it only after loading
        return f"the number of attention heads ({heads}) is not divisible by the tensor-parallel size ({size})"
    if args.device == "cuda":
        import torch  # only here: it takes a second or two to import

        if not torch.cuda.is_available():
            return "--device cuda, but torch sees no CUDA device here (use --device cpu or auto)"
    return None


def port_problem(host: str, port: int) -> str | None:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn binds
        try:
            probe.bind((host, port))
        except OSError as exc:
            return exc.strerror or str(exc)
    return None


def _healthy(url: str) -> bool:
    """Every engine serves (a degraded api answers 200 too, with status "degraded")."""
    try:
        with urllib.request.urlopen(url, timeout=1) as response:
            return bool(response.status == 200 and json.loads(response.read()).get("status") == "ok")
    except (OSError, ValueError):
        return False


def main_entry() -> None:
    keep_api_key_off_the_command_line()
    sys.exit(main())


if __name__ == "__main__":
    main_entry()
