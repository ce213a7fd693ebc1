"""`python -m services.worker --tensor-parallel-size N`: start N worker ranks on this machine, one
process each, joined in one process group, and keep them together.

A rank that dies leaves the others stuck in their next all-reduce, so the group lives and dies as
a whole: when one rank exits, the others are stopped and all N start again (the scheduler fails
the requests in flight when the first rank's connection drops, and schedules again once every
rank has reported Ready). A rank that exits with code 2 could not load the model, and one that exits
with EXIT_PORT_TAKEN could not listen on its metrics port: then the group stops for good, with that
code, as starting again would not help.
"""

from __future__ import annotations

import logging
import signal
import socket
import subprocess
import sys
import time
from types import FrameType

from shared.cli import EXIT_PORT_TAKEN

log = logging.getLogger("services.worker.rank_group")

RESTART_PAUSE = 1.0  # seconds between a group's end and its restart
FINAL = (2, EXIT_PORT_TAKEN)  # exit statuses that a restart would only repeat


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def rank_commands(worker_args: list[str], size: int) -> list[list[str]]:
    init = f"tcp://127.0.0.1:{free_port()}"
    return [
        [
            sys.executable,
            "-m",
            "services.worker",
            *worker_args,
            "--rank",
            str(rank),
            "--world-size",
            str(size),
            "--dist-init-method",
            init,
        ]
        for rank in range(size)
    ]


def run_group(worker_args: list[str], size: int) -> int:
    stopping = False
    ranks: list[subprocess.Popen[bytes]] = []

    def stop(signum: int, frame: FrameType | None) -> None:
        nonlocal stopping
        stopping = True
        for rank in ranks:
            if rank.poll() is None:
                rank.send_signal(signal.SIGTERM)

    signal.signal(signal.SIGINT, stop)
    signal.signal(signal.SIGTERM, stop)
    while True:
        ranks[:] = [subprocess.Popen(command) for command in rank_commands(worker_args, size)]
        while not stopping and all(rank.poll() is None for rank in ranks):
            time.sleep(0.1)
        if not stopping:
            dead = next(r for r, rank in enumerate(ranks) if rank.poll() is not None)
            code = ranks[dead].returncode
            log.error("rank %d of %d exited with code %s; stopping the group", dead, size, code)
            stop(signal.SIGTERM, None)
            stopping = code in FINAL
        for rank in ranks:
            try:
                rank.wait(10)
            except subprocess.TimeoutExpired:
                rank.kill()
                rank.wait()
        if stopping:
            return next((rank.returncode for rank in ranks if rank.returncode in FINAL), 0)
        log.info("restarting all %d ranks", size)
        time.sleep(RESTART_PAUSE)
