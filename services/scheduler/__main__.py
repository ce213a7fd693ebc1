"""`python -m services.scheduler`: run the scheduler alone, for deployment."""

import argparse
import sys

from services.scheduler.server import SchedulerServer
from shared.cli import add_endpoint_args, add_scheduler_args, scheduler_config, setup_logging
from shared.config import Endpoints


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m services.scheduler")
    add_scheduler_args(parser)
    add_endpoint_args(parser)
    parser.add_argument("--world-size", type=int, default=1, help="worker ranks to wait for")
    args = parser.parse_args()
    setup_logging("scheduler")
    endpoints = Endpoints(scheduler=args.scheduler_endpoint, workers=args.worker_endpoint)
    sys.exit(SchedulerServer(scheduler_config(args), endpoints, args.world_size).run())


if __name__ == "__main__":
    try:
        main()
    except KeyboardInterrupt:
        pass
