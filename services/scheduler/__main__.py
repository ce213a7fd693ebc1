"""`python -m services.scheduler`: run the scheduler alone, for deployment."""

import argparse
import contextlib
import os
import shutil
import sys

from services.scheduler.server import SchedulerServer
from shared.cli import (
    EXIT_PORT_TAKEN,
    RUNTIME_DIR_ENV,
    HelpFormatter,
    add_link_args,
    add_lora_args,
    add_metrics_args,
    add_scheduler_args,
    add_wire_args,
    setup_logging,
    stop_on_signals,
)
from shared.config import SCHEDULER_METRICS_PORT, Endpoints, LoraConfig, SchedulerConfig
from shared.glibc_heap import map_large_allocations
from shared.metrics_http import MetricsPortError, serve_metrics
from shared.options import from_namespace
from shared.wire_security import WireSecurityError, keys_for


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m services.scheduler", formatter_class=HelpFormatter)
    add_scheduler_args(parser)
    add_lora_args(parser)
    add_link_args(parser, "scheduler_endpoint", "worker_endpoint", "world_size")
    add_wire_args(parser)
    add_metrics_args(parser, SCHEDULER_METRICS_PORT)
    return parser


def main() -> None:
    args = build_parser().parse_args()
    launcher = os.getppid()
    signals = stop_on_signals()
    setup_logging("scheduler")
    map_large_allocations()  # what keyless peers make it hold goes back when they are dropped
    if len(args.scheduler_endpoint) != 1:
        sys.exit("scheduler: --scheduler-endpoint names the one endpoint this scheduler listens on")
    endpoints = Endpoints(scheduler=args.scheduler_endpoint[0], workers=args.worker_endpoint)
    try:
        keys = keys_for(args, "scheduler", [endpoints.scheduler, endpoints.workers])
    except WireSecurityError as exc:
        sys.exit(f"scheduler: {exc}")
    server = SchedulerServer(
        from_namespace(SchedulerConfig, args),
        endpoints,
        args.world_size,
        keys,
        args.max_message_bytes,
        from_namespace(LoraConfig, args),
    )
    try:
        serve_metrics(server.metrics.registry, args.metrics_host, args.metrics_port, "scheduler")
    except MetricsPortError as exc:
        print(f"scheduler: {exc}", file=sys.stderr)
        sys.exit(EXIT_PORT_TAKEN)
    code = server.run(signals)
    remove_orphaned_runtime_dir(launcher)
    sys.exit(code)


def remove_orphaned_runtime_dir(launcher: int) -> None:
    """Under `pagedserve up`, the launcher removes its socket directory as it exits; if it is gone
    without doing so (SIGKILL), the scheduler, its last owner, does."""
    directory = os.environ.get(RUNTIME_DIR_ENV)
    if directory and os.getppid() != launcher and os.path.basename(directory).startswith("pagedserve-"):
        shutil.rmtree(directory, ignore_errors=True)


if __name__ == "__main__":
    with contextlib.suppress(KeyboardInterrupt):
        main()
