"""`python -m services.worker`: run one worker rank alone, for deployment."""

import argparse
import logging
import os
import sys

from shared.cli import HelpFormatter, add_scheduler_args, add_wire_args, add_worker_args, setup_logging
from shared.wire_security import WireSecurityError, keys_for


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m services.worker", formatter_class=HelpFormatter)
    parser.add_argument("--model", required=True, help="local HF-format model directory")
    parser.add_argument("--worker-endpoint", required=True, help="the scheduler's worker endpoint")
    parser.add_argument("--rank", type=int, default=0, help="this worker's rank among the tensor-parallel workers")
    parser.add_argument("--world-size", type=int, default=1, help="tensor-parallel workers in all")
    add_worker_args(parser)
    add_scheduler_args(parser)
    add_wire_args(parser)
    return parser


def main() -> None:
    args = build_parser().parse_args()
    setup_logging(f"worker{args.rank}")
    try:
        keys = keys_for(args, "worker", [args.worker_endpoint])
    except WireSecurityError as exc:
        sys.exit(f"worker: {exc}")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from services.worker.loader import ModelLoadError  # torch loads only after flags parse
    from services.worker.server import WorkerServer

    try:
        server = WorkerServer(args, args.rank, args.world_size, keys)
    except ModelLoadError as exc:
        logging.getLogger("services.worker").error("cannot load the model: %s", exc)
        sys.exit(2)
    server.run()


if __name__ == "__main__":
    try:
        main()
    except KeyboardInterrupt:
        pass
