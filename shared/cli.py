"""Command-line flags, defined once and used by each service and by the launcher.

Flag names follow vLLM's where vLLM has the same knob.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import socket
import sys

from shared.config import SchedulerConfig, SpeculativeConfig
from shared.sampling import MAX_LOGPROBS
from shared.sockets import MAX_MESSAGE_BYTES
from shared.wire_security import add_wire_security_args

RUNTIME_DIR_ENV = "PAGEDSERVE_RUNTIME_DIR"  # the launcher's socket directory, for the scheduler to remove if orphaned
ENGINE_ENV = "PAGEDSERVE_ENGINE"  # with several engines, the launcher names each one's processes in their logs
API_KEY_ENV = "PAGEDSERVE_API_KEY"  # the launcher hands the key to the api this way, not on a command line


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Every flag's help shows its default, except defaults taken from the environment (a key)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if action.dest in ("api_key", "keys_dir") or action.required or "(default:" in text:
            return text
        return super()._get_help_string(action)


def add_scheduler_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("scheduler")
    group.add_argument("--block-size", type=int, default=16, help="tokens per KV block")
    group.add_argument("--max-num-seqs", type=int, default=256, help="sequences per step")
    group.add_argument(
        "--max-num-batched-tokens",
        type=int,
        default=None,
        help="tokens per step; None: 2048 with chunked prefill, else max(context, 2048)",
    )
    group.add_argument("--max-model-len", type=int, default=None, help="context length limit; None: the model's own")
    group.add_argument(
        "--num-gpu-blocks-override",
        type=int,
        default=None,
        help="KV blocks on the device, instead of what memory allows (for tests and benchmarks)",
    )
    group.add_argument("--enable-prefix-caching", action="store_true", help="reuse cached prompt blocks")
    group.add_argument(
        "--enable-chunked-prefill",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="split long prompts over steps, mixed with decodes",
    )
    group.add_argument(
        "--preemption-mode",
        choices=["swap", "recompute", "auto"],
        default="auto",
        help="what happens to a preempted request: swapped to CPU memory, dropped and recomputed, "
        "or whichever costs less for it",
    )
    group.add_argument(
        "--kv-reservation",
        choices=["paged", "max", "pow2", "oracle"],
        default="paged",
        help="KV memory a request holds from its start: blocks on demand (paged), or, as baselines "
        "that reserve contiguous memory would, room for the whole context (max), for the next "
        "power of two of max_tokens (pow2) or for exactly max_tokens (oracle)",
    )
    group.add_argument(
        "--async-scheduling",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="plan each step while the workers compute the one before",
    )
    group.add_argument(
        "--step-timeout", type=float, default=180.0, help="seconds a step may take before its worker counts as lost"
    )
    group.add_argument(
        "--log-stats-interval",
        type=float,
        default=10.0,
        help="seconds between log lines of throughput, queues and KV use (0: none)",
    )
    group.add_argument(
        "--speculative-config",
        type=speculative_config,
        default=None,
        help="speculative decoding, as JSON in vLLM's form: "
        '\'{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, '
        '"prompt_lookup_min": 2}\' or \'{"method": "draft_model", "model": DIR, '
        '"num_speculative_tokens": 3}\' (default: none)',
    )


def add_worker_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("worker")
    group.add_argument(
        "--device",
        choices=["auto", "cpu", "cuda"],
        default="auto",
        help="where the model runs; auto: cuda where there is one",
    )
    group.add_argument(
        "--dtype",
        type=_dtype,
        choices=["auto", "float32", "float16", "bfloat16"],
        default="auto",
        help="weights and KV cache; auto: the checkpoint's (a half type on a CPU where the compiled "
        "kernels read it, with float32 activations; a float32 checkpoint as float16 on CUDA)",
    )
    group.add_argument(
        "--kv-cache-dtype",
        choices=["auto", "int8", "fp8"],
        default="auto",
        help="auto: the model's dtype; int8 or fp8 (E4M3): each cached key and value row quantized "
        "to one byte a value with its own scale, 3.8x the tokens of a float32 cache in the "
        "same memory (1.9x of float16)",
    )
    group.add_argument(
        "--load-format",
        choices=["auto", "dummy"],
        default="auto",
        help="dummy: random weights from config.json alone, for benchmarks",
    )
    group.add_argument(
        "--gpu-memory-utilization",
        type=float,
        default=0.9,
        help="share of the GPU's memory for weights, activations and KV cache",
    )
    group.add_argument("--kv-cache-memory", type=float, default=1.0, help="GiB of KV cache on CPU")
    group.add_argument("--swap-space", type=float, default=4.0, help="GiB of CPU swap space for KV blocks")
    group.add_argument("--seed", type=int, default=0, help="seed of the sampler for requests without one")
    group.add_argument(
        "--tensor-parallel-size",
        "-tp",
        type=int,
        default=1,
        help="worker ranks that split the model's attention heads and MLP among them, one "
        "process each (on GPUs: one GPU each)",
    )
    group.add_argument(
        "--enforce-eager",
        action="store_true",
        help="no CUDA graphs: every step runs eagerly (by default a GPU worker of one rank replays "
        "decode steps of up to --max-num-seqs sequences from graphs captured at start-up)",
    )
    group.add_argument(
        "--max-seq-len-to-capture",
        type=int,
        default=8192,
        help="the longest context a decode step on CUDA graphs covers; longer ones run eagerly",
    )
    group.add_argument(
        "--cpu-threads",
        type=int,
        default=0,
        help="torch threads of a worker on a CPU device (0: every core while other processes "
        "leave them nearly idle, one fewer otherwise; chosen each second)",
    )


def _dtype(name: str) -> str:
    """vLLM's dtype names too: half and float."""
    return {"half": "float16", "float": "float32"}.get(name, name)


def add_api_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("api")
    group.add_argument("--host", default="127.0.0.1", help="address the api listens on")
    group.add_argument("--port", type=int, default=8000, help="port the api listens on")
    group.add_argument(
        "--served-model-name", default=None, help="the name clients ask for; None: the model directory's name"
    )
    group.add_argument(
        "--tokenizer",
        default=None,
        help="directory of the tokenizer; None: the model directory (a dummy-weight config needs one)",
    )
    group.add_argument("--max-request-body-bytes", type=int, default=8 << 20, help="larger request bodies get 413")
    group.add_argument(
        "--request-header-timeout",
        type=float,
        default=10.0,
        help="seconds a connection has to send a request's headers before it is closed",
    )
    group.add_argument(
        "--request-body-timeout",
        type=float,
        default=60.0,
        help="seconds a request's body has to arrive whole before it gets 408",
    )
    group.add_argument(
        "--scheduler-timeout",
        type=float,
        default=5.0,
        help="seconds without a word from the scheduler (it answers a heartbeat twice a second) "
        "before the api counts it as stalled: requests in flight fail, /health answers 503 "
        "until it answers again",
    )
    group.add_argument(
        "--routing",
        choices=["round_robin", "least_load", "prefix"],
        default="prefix",
        help="with several engines, which serves a request: in turn, the least loaded, or the one "
        "its prompt's first blocks hash to (where they are cached), unless that one is loaded "
        "well above the others",
    )
    group.add_argument(
        "--chat-template", default=None, help="a Jinja chat template, as a file or inline, in place of the tokenizer's"
    )
    group.add_argument(
        "--max-logprobs",
        type=int,
        default=MAX_LOGPROBS,
        help=f"the most log-probabilities a request may ask for per token (at most {MAX_LOGPROBS})",
    )
    group.add_argument("--disable-log-requests", action="store_true", help="no log line per request")
    group.add_argument(
        "--trust-remote-code",
        action="store_true",
        help="accepted as vLLM accepts it; pagedserve never runs code from a model directory",
    )
    group.add_argument(
        "--enable-auto-tool-choice",
        action="store_true",
        help="serve tool_choice 'auto' (the default with tools): the model's calls are parsed "
        "from its text by --tool-call-parser",
    )
    group.add_argument(
        "--tool-call-parser",
        choices=["hermes", "llama3_json"],
        default=None,
        help="the model's tool-call format: hermes (Hermes, Qwen 2.5/3) or llama3_json (Llama 3.1+)",
    )
    group.add_argument(
        "--api-key",
        default=os.environ.get(API_KEY_ENV) or None,
        help="every route but /health and /metrics then needs 'Authorization: Bearer KEY'; several "
        f"keys, comma-separated, are tenants of their own (default: ${API_KEY_ENV}; never shown)",
    )
    group.add_argument(
        "--api-key-file",
        default=None,
        help="keys as for --api-key, one a line, from a file (keeps them off the command line)",
    )
    group.add_argument(
        "--report-cached-tokens",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="usage.prompt_tokens_details.cached_tokens in responses (always from the request's own "
        "tenant and cache_salt); --no-report-cached-tokens leaves it out",
    )


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


def add_endpoint_args(parser: argparse.ArgumentParser, required: bool = True, worker: bool = True) -> None:
    group = parser.add_argument_group("endpoints")
    group.add_argument("--scheduler-endpoint", required=required, help="e.g. tcp://0.0.0.0:5555")
    if worker:
        group.add_argument("--worker-endpoint", required=required, help="e.g. tcp://0.0.0.0:5556")
    add_wire_args(parser)


def add_wire_args(parser: argparse.ArgumentParser) -> None:
    add_wire_security_args(parser)
    parser.add_argument(
        "--max-message-bytes",
        type=int,
        default=MAX_MESSAGE_BYTES,
        help="larger frames on the internal wire drop their sender's connection "
        f"({MAX_MESSAGE_BYTES >> 20} MiB by default)",
    )


def add_metrics_args(parser: argparse.ArgumentParser, default_port: int, what: str = "") -> None:
    group = parser.add_argument_group("metrics")
    group.add_argument("--metrics-host", default="127.0.0.1", help="address of this service's /metrics")
    group.add_argument(
        "--metrics-port",
        type=int,
        default=default_port,
        help=f"port of this service's Prometheus /metrics{what} (0: none)",
    )


def speculative_config(text: str) -> SpeculativeConfig | None:
    """argparse's type for --speculative-config: a bad value is a usage error naming the problem."""
    try:
        return SpeculativeConfig.parse(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def scheduler_config(args: argparse.Namespace) -> SchedulerConfig:
    return SchedulerConfig(
        block_size=args.block_size,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_model_len=args.max_model_len,
        num_gpu_blocks_override=args.num_gpu_blocks_override,
        enable_prefix_caching=args.enable_prefix_caching,
        enable_chunked_prefill=args.enable_chunked_prefill,
        preemption_mode=args.preemption_mode,
        kv_reservation=args.kv_reservation,
        async_scheduling=args.async_scheduling,
        step_timeout=args.step_timeout,
        log_stats_interval=args.log_stats_interval,
        speculative=args.speculative_config,
    )


def stop_on_signals() -> socket.socket:
    """SIGINT or SIGTERM (Ctrl-C, docker stop, the launcher) stops a service by a KeyboardInterrupt
    in the main thread, which the service turns into a clean exit. Only the first: a Ctrl-C in a
    terminal reaches the launcher's children twice, from the terminal and from the launcher.

    Returns a socket for the service's main loop to poll beside its own: the kernel may hand the
    signal to any thread (zmq's authenticator, the metrics server), and Python runs the handler
    only when the main thread next runs, which a zmq poll without a timeout would never do. The
    signal writes a byte to this socket's pair, and the poll wakes; the loop then calls
    `drain_wakeups`."""

    def interrupt(signum, frame):
        global _stop_requested
        _stop_requested = True
        for each in (signal.SIGINT, signal.SIGTERM):
            signal.signal(each, signal.SIG_IGN)
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


def _quiet_about_lost_interrupts(unraisable) -> None:
    """A stop's KeyboardInterrupt dropped inside a destructor is not an error: `drain_wakeups`
    raises it again. Anything else is reported as Python would."""
    if not (_stop_requested and isinstance(unraisable.exc_value, KeyboardInterrupt)):
        sys.__unraisablehook__(unraisable)


_signal_sockets: tuple[socket.socket, socket.socket] | None = None  # kept open for the process's life
_stop_requested = False


def drain_wakeups() -> None:
    """Empty the socket `stop_on_signals` returned, once a poll has woken on it, and stop if a
    signal asked to: the handler's own KeyboardInterrupt is lost when the main thread runs it
    inside a destructor (zmq frees its message frames in them), and the handler has
    already set the signals to be ignored, so nothing else would stop the service."""
    if _signal_sockets is not None:
        try:
            while _signal_sockets[0].recv(64):
                pass
        except BlockingIOError:
            pass
    if _stop_requested:
        raise KeyboardInterrupt


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
    logging.basicConfig(
        level=logging.INFO,
        format=f"%(asctime)s {name} %(levelname)s %(name)s: %(message)s",
    )
