"""Command-line flags, defined once and used by each service and by the launcher.

Flag names follow vLLM's where vLLM has the same knob.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import signal
import socket
import sys
from collections.abc import Iterator

from shared.config import (
    ApiConfig,
    LinkConfig,
    LoraConfig,
    MetricsConfig,
    ModelConfig,
    SchedulerConfig,
    WireConfig,
    WorkerConfig,
)
from shared.options import add_options
from shared.wire_security import KEYS_DIR_ENV

RUNTIME_DIR_ENV = "PAGEDSERVE_RUNTIME_DIR"  # the launcher's socket directory, for the scheduler to remove if orphaned
ENGINE_ENV = "PAGEDSERVE_ENGINE"  # with several engines, the launcher names each one's processes in their logs
API_KEY_ENV = "PAGEDSERVE_API_KEY"  # the launcher hands the key to the api this way, not on a command line
# A service's exit status when a port it must listen on is taken: a restart would not help, so the
# launcher stops and names the flag that moves the port.
EXIT_PORT_TAKEN = 3
EXIT_AT_FAULT = 4  # a worker the scheduler found at fault: its supervisor starts it again


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Every flag's help shows its default, except defaults taken from the environment (a key)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if action.dest in ("api_key", "keys_dir") or action.required or "(default:" in text:
            return text
        return super()._get_help_string(action) or text


def add_scheduler_args(parser: argparse.ArgumentParser) -> None:
    add_options(parser, SchedulerConfig, "scheduler")


def add_lora_args(parser: argparse.ArgumentParser) -> None:
    add_options(parser, LoraConfig, "LoRA adapters")


def add_model_args(parser: argparse.ArgumentParser, model: str | None = None, positional: bool = False) -> None:
    """--model (required unless given a default, or a positional argument) and --tokenizer."""
    if positional:
        parser.add_argument("model", help="local HF-format model directory")
    add_options(parser, ModelConfig, "model", defaults={"model": model}, exclude=("model",) if positional else ())
    if not positional and model is None:
        next(a for a in parser._actions if a.dest == "model").required = True


def add_worker_args(parser: argparse.ArgumentParser) -> None:
    add_options(parser, WorkerConfig, "worker")


def add_api_args(parser: argparse.ArgumentParser) -> None:
    # The key's default is read now: `keep_api_key_off_the_command_line` may have just put it there.
    add_options(parser, ApiConfig, "api", defaults={"api_key": os.environ.get(API_KEY_ENV) or None})


def keep_api_key_off_the_command_line() -> None:
    """Any user can read a process's command line: a key given as --api-key moves to the
    environment (readable by the same user only), and the process starts again without it."""
    argv = list(sys.orig_argv)
    for i, arg in enumerate(argv):
        if arg == "--api-key" and i + 1 < len(argv):
            key, rest = argv[i + 1], argv[:i] + argv[i + 2 :]
            break
        if arg.startswith("--api-key="):
            key, rest = arg.split("=", 1)[1], argv[:i] + argv[i + 1 :]
            break
    else:
        return
    print(
        f"pagedserve: --api-key on a command line is readable by every user of this machine while the process "
        f"starts; set {API_KEY_ENV} or use --api-key-file instead",
        file=sys.stderr,
    )
    os.environ[API_KEY_ENV] = key
    os.execv(sys.executable, [sys.executable, *rest[1:]])


def api_keys(args: argparse.Namespace) -> list[str]:
    """Every key of --api-key and --api-key-file; SystemExit for a key no header can carry."""
    keys = [k.strip() for k in (args.api_key or "").split(",") if k.strip()]
    if getattr(args, "api_key_file", None):
        try:
            with open(args.api_key_file) as f:
                keys += [line.strip() for line in f if line.strip()]
        except OSError as exc:
            sys.exit(f"cannot read --api-key-file: {exc}")
    for key in keys:
        if not key.isprintable() or " " in key:
            sys.exit("an API key must be printable, without spaces or commas")
    return keys


def admin_key(args: argparse.Namespace) -> str | None:
    """The key of --admin-api-key-file, or None; SystemExit for a file that cannot be read or holds no key."""
    path = getattr(args, "admin_api_key_file", None)
    if not path:
        return None
    try:
        with open(path) as f:
            key = f.read().strip()
    except OSError as exc:
        sys.exit(f"cannot read --admin-api-key-file: {exc}")
    if not key or not key.isprintable() or " " in key or "," in key:
        sys.exit("--admin-api-key-file must hold one key: printable, without spaces or commas")
    return key


def add_link_args(parser: argparse.ArgumentParser, *flags: str) -> None:
    """The engine's links this process takes (by field name of LinkConfig), the endpoints required."""
    fields = set(flags)
    add_options(parser, LinkConfig, "links", exclude=[f for f in LinkConfig.__dataclass_fields__ if f not in fields])
    for action in parser._actions:
        if action.dest in ("scheduler_endpoint", "worker_endpoint"):
            action.required = True


def add_wire_args(parser: argparse.ArgumentParser) -> None:
    add_options(parser, WireConfig, "wire", defaults={"keys_dir": os.environ.get(KEYS_DIR_ENV) or None})


def add_metrics_args(parser: argparse.ArgumentParser, default_port: int) -> None:
    add_options(parser, MetricsConfig, "metrics", defaults={"metrics_port": default_port})


def stop_on_signals() -> socket.socket:
    """SIGINT or SIGTERM (Ctrl-C, docker stop, the launcher) stops a service by a KeyboardInterrupt
    in the main thread, which the service turns into a clean exit. Only the first: a Ctrl-C in a
    terminal reaches the launcher's children twice, from the terminal and from the launcher.

    Returns a socket for the service's main loop to poll beside its own: the kernel may hand the
    signal to any thread (zmq's authenticator, the metrics server), and Python runs the handler
    only when the main thread next runs, which a zmq poll without a timeout would never do. The
    signal writes a byte to this socket's pair, and the poll wakes; the loop then calls
    `drain_wakeups`."""

    def interrupt(signum: int, frame: object) -> None:
        global _stop_requested
        _stop_requested = True
        for each in (signal.SIGINT, signal.SIGTERM):
            signal.signal(each, signal.SIG_IGN)
        if not _deferring:  # else the work under way ends first, and `drain_wakeups` stops the service after it
            raise KeyboardInterrupt

    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, interrupt)
    global _signal_sockets
    _signal_sockets = socket.socketpair()
    for end in _signal_sockets:
        end.setblocking(False)
    signal.set_wakeup_fd(_signal_sockets[1].fileno(), warn_on_full_buffer=False)
    sys.unraisablehook = _quiet_about_lost_interrupts
    return _signal_sockets[0]


def _quiet_about_lost_interrupts(unraisable: sys.UnraisableHookArgs) -> None:
    """A stop's KeyboardInterrupt dropped inside a destructor is not an error: `drain_wakeups`
    raises it again. Anything else is reported as Python would."""
    if not (_stop_requested and isinstance(unraisable.exc_value, KeyboardInterrupt)):
        sys.__unraisablehook__(unraisable)


_signal_sockets: tuple[socket.socket, socket.socket] | None = None  # kept open for the process's life
_stop_requested = False
_stop_taken = False
_deferring = False


@contextlib.contextmanager
def stops_deferred() -> Iterator[None]:
    """A stop asked for inside the block takes effect after it, at the next poll, which wakes on the signal's
    byte for `drain_wakeups` to stop: a service's loop defers its stop so that no message is cut between its
    frames and no state is left half updated, and a worker's step so that its block files reach the disk."""
    global _deferring
    outer, _deferring = _deferring, True
    try:
        yield
    finally:
        _deferring = outer


def drain_wakeups() -> None:
    """Empty the socket `stop_on_signals` returned, once a poll has woken on it, and stop if a
    signal asked to: the handler's own KeyboardInterrupt is lost when the main thread runs it
    inside a destructor (zmq frees its message frames in them), and the handler has
    already set the signals to be ignored, so nothing else would stop the service."""
    global _stop_requested
    if _signal_sockets is not None:
        try:
            while woken := _signal_sockets[0].recv(64):
                # The byte names the signal; its Python handler may not have run yet.
                _stop_requested |= any(signum in woken for signum in (signal.SIGINT, signal.SIGTERM))
        except BlockingIOError:
            pass
    if _stop_requested and not _stop_taken:
        raise KeyboardInterrupt


def take_the_stop() -> None:
    """The service has begun its stop (it lets the work in flight finish): wakeups from now on only empty the
    socket, rather than interrupt that."""
    global _stop_taken
    _stop_taken = True


def exit_at_once(code: int = 0) -> None:
    """Exit without the interpreter's teardown: with torch and transformers loaded it takes a
    second or more, and a stopped service has nothing left to flush but its log."""
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def setup_logging(name: str) -> None:
    engine = os.environ.get(ENGINE_ENV)
    if engine:
        name = f"{name}@engine{engine}"
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s {name} %(levelname)s %(name)s: %(message)s")
