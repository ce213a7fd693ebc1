"""`python -m services.api`: run the HTTP gateway alone, for deployment."""

import argparse
import contextlib
import json
import logging
import os
import socket
import sys
from types import FrameType

import uvicorn

from services.api.adapters import Adapters
from services.api.application import build_app
from services.api.disaggregation import DisaggregatedEngines
from services.api.engine_client import EngineClient
from services.api.engine_group import EngineGroup
from services.api.http_deadlines import with_header_deadline
from services.api.routing import Router
from shared.cli import (
    EXIT_PORT_TAKEN,
    HelpFormatter,
    add_api_args,
    add_link_args,
    add_lora_args,
    add_model_args,
    add_wire_args,
    admin_key,
    api_keys,
    exit_at_once,
    keep_api_key_off_the_command_line,
    setup_logging,
)
from shared.config import ApiConfig, LoraConfig, SchedulerConfig
from shared.lora import LoraError
from shared.options import add_options, from_namespace
from shared.sampling import MAX_LOGPROBS
from shared.wire_security import WireSecurityError, keys_for

STREAM_ENDS_SECONDS = 1.5  # after --shutdown-timeout: the scheduler's last outputs reach their streams


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m services.api", formatter_class=HelpFormatter)
    add_model_args(parser)
    add_link_args(parser, "scheduler_endpoint", "prefill_endpoint")
    add_api_args(parser)
    add_lora_args(parser)
    add_wire_args(parser)
    # The scheduler's own flag: its requests in flight finish within it, and the api's streams of them with them.
    add_options(
        parser,
        SchedulerConfig,
        "stopping",
        exclude=[n for n in SchedulerConfig.__dataclass_fields__ if n != "shutdown_timeout"],
    )
    return parser


def main() -> None:
    keep_api_key_off_the_command_line()
    parser = build_parser()
    args = parser.parse_args()
    if args.enable_auto_tool_choice and not args.tool_call_parser:
        parser.error("--enable-auto-tool-choice needs --tool-call-parser")
    if args.max_prompts_per_request < 1:
        parser.error("--max-prompts-per-request must be at least 1")
    if not 0 <= args.max_logprobs <= MAX_LOGPROBS:
        parser.error(f"--max-logprobs must be in [0, {MAX_LOGPROBS}]")
    setup_logging("api")
    log = logging.getLogger("services.api")
    if args.disable_log_requests:
        logging.getLogger("pagedserve.access").setLevel(logging.WARNING)
    if args.trust_remote_code:
        log.info(
            "--trust-remote-code is accepted and changes nothing: pagedserve never runs code from a model directory"
        )
    try:
        keys = keys_for(args, "api", args.scheduler_endpoint + (args.prefill_endpoint or []))
    except WireSecurityError as exc:
        sys.exit(f"api: {exc}")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    _tokenizers_only()
    sys.setswitchinterval(0.001)  # the event loop gets the GIL back quickly from threads parsing large bodies
    from transformers import AutoTokenizer  # after the flags, so --help stays quick

    try:
        tokenizer = AutoTokenizer.from_pretrained(args.tokenizer or args.model, local_files_only=True)
        if args.chat_template:
            tokenizer.chat_template = _template(args.chat_template)
        with open(os.path.join(args.model, "config.json")) as f:
            vocab_size = json.load(f)["vocab_size"]
    except (OSError, ValueError, KeyError) as exc:
        log.error("cannot load the tokenizer and config of %s: %s", args.model, exc)
        sys.exit(2)
    name = args.served_model_name or os.path.basename(os.path.normpath(args.model))
    lora = from_namespace(LoraConfig, args)
    try:
        adapters = Adapters(name, args.model, lora)
    except (LoraError, OSError, KeyError) as exc:
        log.error("LoRA adapters: %s", exc)
        sys.exit(2)
    engines = [EngineClient(e, keys, args.max_message_bytes, args.scheduler_timeout) for e in args.scheduler_endpoint]
    if args.prefill_endpoint:
        prefill = [EngineClient(e, keys, args.max_message_bytes, args.scheduler_timeout) for e in args.prefill_endpoint]
        client: EngineGroup = DisaggregatedEngines(
            EngineGroup(prefill, Router(args.routing)), engines, Router(args.routing)
        )
    else:
        client = EngineGroup(engines, Router(args.routing))
    app = build_app(
        client,
        tokenizer,
        name,
        vocab_size,
        from_namespace(ApiConfig, args),
        api_keys(args),
        adapters,
        runtime_lora_updating=lora.enable_lora and lora.allow_runtime_lora_updating,
        admin_key=admin_key(args),
    )
    config = uvicorn.Config(
        app,
        host=args.host,
        port=args.port,
        log_level="warning",
        # Streams still open this long after a stop signal are cut: by then the scheduler has ended their
        # requests (finish_reason abort) at its --shutdown-timeout.
        timeout_graceful_shutdown=int(args.shutdown_timeout + STREAM_ENDS_SECONDS + 0.999),
        http=with_header_deadline(args.request_header_timeout),
    )
    listening = listen(args.host, args.port)
    log.info("listening on http://%s:%d", args.host, args.port)
    OnceStoppedServer(config).run(sockets=[listening])


def listen(host: str, port: int) -> socket.socket:
    """The api's socket, bound here rather than by uvicorn: a port taken since the launcher looked is
    one line and EXIT_PORT_TAKEN, not a traceback and a restart."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    # Named TCP, asyncio turns Nagle's algorithm off on each connection it accepts (as it does on the
    # sockets it binds itself); with protocol 0 it does not, and a streamed response's first chunk,
    # written after its headers, waited for the client's delayed acknowledgement: about 40 ms more to
    # the first token on a kept-alive connection.
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn binds
    try:
        sock.bind((host, port))
    except OSError as exc:
        print(f"api: cannot listen on {host}:{port}: {exc.strerror or exc}", file=sys.stderr)
        sys.exit(EXIT_PORT_TAKEN)
    sock.set_inheritable(True)
    return sock


def _tokenizers_only() -> None:
    """transformers imports torch wherever it is installed, though the api needs only its
    tokenizers: torch is hidden, as on a machine without it (three seconds less at start-up, and
    hundreds of MB less memory)."""
    if "torch" not in sys.modules:
        sys.modules["torch"] = None  # type: ignore[assignment]  # `import torch` fails here; transformers leaves it out
    os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")  # its note that torch is missing


def _template(value: str) -> str:
    """--chat-template: a file's text, or the template itself."""
    if os.path.isfile(value):
        with open(value) as f:
            return f.read()
    return value


class OnceStoppedServer(uvicorn.Server):
    """Stops on SIGINT or SIGTERM: takes no new connection, and lets the responses in flight end (their
    requests finish, or the scheduler ends them at its --shutdown-timeout). A second signal changes nothing:
    a Ctrl-C in a terminal reaches the api twice (from the terminal and from the launcher), and uvicorn would
    abandon its shutdown halfway, with a traceback."""

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        self.should_exit = True


if __name__ == "__main__":
    with contextlib.suppress(KeyboardInterrupt):  # before uvicorn started
        main()
    exit_at_once()
