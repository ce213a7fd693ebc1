"""`python -m services.worker`: run one worker rank alone, for deployment."""

import argparse
import contextlib
import logging
import os
import sys

from shared.cli import (
    EXIT_PORT_TAKEN,
    HelpFormatter,
    add_link_args,
    add_lora_args,
    add_metrics_args,
    add_model_args,
    add_scheduler_args,
    add_wire_args,
    add_worker_args,
    exit_at_once,
    setup_logging,
    stop_on_signals,
)
from shared.config import WORKER_METRICS_PORT, LoraConfig, ModelConfig, SchedulerConfig, WorkerConfig
from shared.metrics_http import MetricsPortError, serve_metrics
from shared.options import from_namespace
from shared.wire_security import WireSecurityError, keys_for


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m services.worker", formatter_class=HelpFormatter)
    add_model_args(parser)
    add_link_args(parser, "worker_endpoint", "rank", "world_size", "dist_init_method")
    add_worker_args(parser)
    add_scheduler_args(parser)
    add_lora_args(parser)
    add_wire_args(parser)
    add_metrics_args(parser, WORKER_METRICS_PORT)
    return parser


def main() -> None:
    args = build_parser().parse_args()
    # Before torch loads OpenMP: its idle threads would otherwise spin for a while after each
    # operation, on the cores the compiled kernels' threads need (services/worker/cpu_threads.py).
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    # And before torch allocates: its buffers of 2 MiB and more (weights, cache, swap space) then ask
    # the kernel for huge pages, on which one core streams the weights 1.3x as fast (docs/kernel-measurements.md).
    os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")
    if args.tensor_parallel_size > 1:
        setup_logging("worker")
        from services.worker.rank_group import run_group

        sys.exit(run_group(without_tensor_parallel_size(sys.argv[1:]), args.tensor_parallel_size))
    signals = stop_on_signals()
    setup_logging(f"worker{args.rank}")
    try:
        keys = keys_for(args, "worker", [args.worker_endpoint])
    except WireSecurityError as exc:
        sys.exit(f"worker: {exc}")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from services.worker.loader import ModelLoadError  # torch loads only after flags parse
    from services.worker.metrics import WorkerMetrics
    from services.worker.server import WorkerServer, WorkerSetup

    metrics = WorkerMetrics(args.rank)
    try:  # before the model loads, so a busy port costs no start-up time
        port = args.metrics_port + args.rank if args.metrics_port else 0
        serve_metrics(metrics.registry, args.metrics_host, port, f"worker rank {args.rank}")
    except MetricsPortError as exc:
        print(f"worker: {exc}", file=sys.stderr)
        sys.exit(EXIT_PORT_TAKEN)
    setup = WorkerSetup(
        from_namespace(ModelConfig, args),
        from_namespace(WorkerConfig, args),
        from_namespace(SchedulerConfig, args),
        args.worker_endpoint,
        args.dist_init_method,
        args.max_message_bytes,
        from_namespace(LoraConfig, args),
    )
    try:
        server = WorkerServer(setup, args.rank, args.world_size, keys, metrics)
    except ModelLoadError as exc:
        logging.getLogger("services.worker").error("cannot load the model: %s", exc)
        sys.exit(2)
    sys.exit(server.run(signals))


def without_tensor_parallel_size(argv: list[str]) -> list[str]:
    """The flags each rank of a group gets: all but the group's size."""
    kept, skip = [], False
    for arg in argv:
        if skip:
            skip = False
        elif arg in ("--tensor-parallel-size", "-tp"):
            skip = True
        elif not arg.startswith(("--tensor-parallel-size=", "-tp=")):
            kept.append(arg)
    return kept


if __name__ == "__main__":
    with contextlib.suppress(KeyboardInterrupt):
        main()
    exit_at_once()
