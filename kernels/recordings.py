"""The kernel calls a stretch of code makes, kept as it runs for kernels/replay.py to make again: while
one is open (`native.open_recording`, set by `replay.record`), `native.share_task` adds each call it
makes, and the other ways of calling a kernel refuse the recording. A module of its own, which
native.py (loaded by setup.py with the standard library alone) imports only for type checking."""

from __future__ import annotations

from collections.abc import Callable


class Recording:
    """The kernel calls made while it is open, in order: each a task's address, its thread
    count, its word count and its words, as `pool_replay` takes them, and between them, as callables,
    whatever else a replay must do again (kernels/replay.py). `refusal` says why the calls cannot be
    replayed (a kernel called some other way), None if they can."""

    __slots__ = ("calls", "refusal", "inside")

    def __init__(self):
        self.calls: list[tuple[int, ...] | Callable[[], object]] = []
        self.refusal: str | None = None
        self.inside = False  # within share_task, whose own call of the pool is the one recorded

    def refuse(self, why: str) -> None:
        if self.refusal is None:
            self.refusal = why
