"""A stretch of the model's Python, its kernel calls kept and replayed without it.

On a CPU a decode step's some sixty kernel calls are a few hundred microseconds apart at most, and
the Python that works out their arguments between them took a sixth of a step (docs/kernel-measurements.md).
`record` runs a function once, keeping every kernel call it makes (kernels/recordings.py) and every
tensor torch makes or views meanwhile, so that the addresses those calls were given stay valid; a
`Replay` then makes the same calls on the same addresses in one C loop (helper_pool.c's
`pool_replay`), with the function's in-place torch operations (a copy, an add) done again between
them as they were.

That holds only where each computation of the function is a kernel call or an in-place torch
operation, and no decision of its Python depends on the data: a torch operation that makes new values,
or a value read back to Python, refuses the recording, and the caller runs the function each time.
What changes from one replay to the next must be written into the tensors the recording read (the
caller's static inputs), and a result is read from the tensor the recording returned.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from kernels import native
from kernels.recordings import Recording
from kernels.workspace import step_scratch

ALLOCATIONS = {torch.ops.aten.empty.memory_format, torch.ops.aten.empty_strided.default}


class Replay:
    """A recording's calls, ready to make again: runs of kernel calls as `pool_replay` takes them, and
    the torch operations between them."""

    __slots__ = ("parts", "held", "calls")

    def __init__(self, calls: list, held: list[torch.Tensor]):
        self.parts: list[tuple[ctypes.Array, int] | Callable[[], object]] = []
        self.held = held  # every tensor the recording saw: its calls' addresses stay theirs
        self.calls = sum(1 for call in calls if isinstance(call, tuple))
        run: list[int] = []
        for call in calls:
            if isinstance(call, tuple):
                run.extend(call)
                continue
            self._close(run)
            run = []
            self.parts.append(call)
        self._close(run)

    def _close(self, run: list[int]) -> None:
        if run:
            self.parts.append(((ctypes.c_int64 * len(run))(*run), len(run)))

    def __call__(self) -> None:
        pool = native.helper_pool()
        assert pool is not None, "a recording is made only where the C helpers run"
        replay = pool.replay
        for part in self.parts:
            if isinstance(part, tuple):
                failed = replay(*part)
                if failed:
                    raise RuntimeError(f"kernel call {failed} of a replay failed, where its recording's did not")
            else:
                part()


def record(function: Callable[..., Any], *args) -> tuple[Any, Replay | None, str | None]:
    """`function(*args)`, run once; with it a `Replay` of its calls, or None and why it cannot be replayed."""
    if native.helper_pool() is None:
        return function(*args), None, "the C helpers cannot be built here"
    with step_scratch.reusing_every_size(), _recording() as recording, _Watch(recording) as watch:
        result = function(*args)
    if recording.refusal is not None:
        return result, None, recording.refusal
    return result, Replay(recording.calls, watch.held), None


@contextlib.contextmanager
def _recording() -> Iterator[Recording]:
    """Every kernel call of this thread's code within, kept (one recording at a time, on the thread that
    runs the model)."""
    if native.open_recording is not None:
        raise RuntimeError("a recording is already open")
    native.open_recording = opened = Recording()
    try:
        yield opened
    finally:
        native.open_recording = None


class _Watch(TorchDispatchMode):
    """Sees each torch operation of a recording: keeps the tensors, keeps in-place operations for the
    replay, and refuses any other computation."""

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        # torch wraps a mode's dispatch to keep its compiler out, importing that compiler (a second or
        # more) at the first call; a recording never runs compiled code, so the wrapper is not needed.
        return False

    def __init__(self, recording: Recording):
        super().__init__()
        self.recording = recording
        self.held: list[torch.Tensor] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        result = func(*args, **kwargs)
        tensors = [t for t in tree_leaves((args, kwargs, result)) if isinstance(t, torch.Tensor)]
        self.held.extend(tensors)
        if func in ALLOCATIONS:
            return result
        if func.is_view:
            base = args[0].untyped_storage().data_ptr()
            if any(t.untyped_storage().data_ptr() != base for t in tree_leaves(result) if isinstance(t, torch.Tensor)):
                self.recording.refuse(f"{func} made new values")
        elif func._schema.name.endswith("_") and func._schema.is_mutable:  # in place: done again on replay
            self.recording.calls.append(functools.partial(func, *args, **kwargs))
        else:
            self.recording.refuse(f"{func} is computed by torch")
        return result
