"""`pagedserve up`'s restarts: a process that dies after the service was ready is started again, with the
processes that must restart with it, while the rest serve."""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Callable


class Restarts:
    """Once the service has been ready, a process that dies is started again while the rest serve:
    the api alone, or its engine (scheduler and worker together, so the worker reports to a fresh
    scheduler). Requests in flight on a dead engine end with an error from the api; a dead api's
    clients see their connection close. A part that dies more than `LIMIT` times a minute is not
    started again, and one that dies before the first ready (a bad flag or model) is not either."""

    LIMIT = 3

    def __init__(
        self,
        parts: dict[str, tuple[str, ...]],
        children: dict[str, subprocess.Popen[bytes]],
        start: Callable[[str], subprocess.Popen[bytes]],
    ):
        self.children = children
        self.start = start
        self.parts = parts  # label -> the processes that restart together
        self.times: dict[str, list[float]] = {label: [] for label in self.parts}

    def restart(self, dead: dict[str, int]) -> bool:
        """Start the dead processes' parts again; False where that is not the thing to do."""
        parts = [label for label, names in self.parts.items() if any(name in dead for name in names)]
        now = time.monotonic()
        for label in parts:
            self.times[label] = [t for t in self.times[label] if now - t < 60.0] + [now]
            if len(self.times[label]) > self.LIMIT:
                print(
                    f"pagedserve: {label.removeprefix('the ')} died {self.LIMIT + 1} times in a minute", file=sys.stderr
                )
                return False
        for label in parts:
            names = self.parts[label]
            for name in names:
                if name in dead:
                    print(
                        f"pagedserve: {name} exited with code {dead[name]}; restarting {label}",
                        file=sys.stderr,
                        flush=True,
                    )
                elif self.children[name].poll() is None:
                    self.children[name].terminate()
            # Every process of the part is gone before any starts again: a new scheduler would otherwise take the
            # old worker, still ending, as its rank, say it is ready, and lose it a moment later.
            for name in names:
                reap(self.children[name])
            for name in names:
                self.children[name] = self.start(name)
        return True


def reap(child: subprocess.Popen[bytes], grace: float = 10.0) -> int:
    try:
        return child.wait(grace)
    except subprocess.TimeoutExpired:
        child.kill()
        return child.wait()
