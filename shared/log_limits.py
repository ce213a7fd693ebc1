"""A log that a stranger can fill is a resource like any other: lines about bad peers are limited."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable


class RateLimit(logging.Filter):
    """Lets `burst` records through per `window` seconds; the first one let through after a quiet
    spell says how many were dropped meanwhile."""

    def __init__(self, burst: int = 10, window: float = 60.0, clock: Callable[[], float] = time.monotonic):
        super().__init__()
        self.burst, self.window, self.clock = burst, window, clock
        self.window_start = -window
        self.passed = self.dropped = 0

    def filter(self, record: logging.LogRecord) -> bool:
        now = self.clock()
        if now - self.window_start >= self.window:
            self.window_start, self.passed = now, 0
        if self.passed >= self.burst:
            self.dropped += 1
            return False
        self.passed += 1
        if self.dropped:
            record.msg = f"{record.getMessage()} ({self.dropped} more like this were not logged)"
            record.args = None
            self.dropped = 0
        return True
