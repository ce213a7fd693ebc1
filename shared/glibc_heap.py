"""glibc's heap, where the process can see or steer it: how much is handed out, large blocks mapped
outside it, free pages given back. Each is a no-op (or 0) where the C library is not glibc.

Why a process steers it: glibc serves an allocation from its own mapping once it is over a
threshold that rises to each large block freed (up to 32 MiB); after that, blocks of that size come
from the heap and stay in the process once freed. Frames a peer sends before it authenticates are
exactly such blocks, so a process that reads them from strangers fixes the threshold; one that
parses large request bodies trims the heap after them."""

from __future__ import annotations

import ctypes
from typing import Any

M_MMAP_THRESHOLD = -3
THRESHOLD_BYTES = 1 << 20


def _function(name: str) -> Any:
    try:
        return getattr(ctypes.CDLL(None), name)
    except (OSError, AttributeError):  # not glibc (mallinfo2: or glibc before 2.33)
        return None


class _MallocInfo(ctypes.Structure):
    _fields_ = [
        (name, ctypes.c_size_t)
        for name in (
            "arena",
            "ordblks",
            "smblks",
            "hblks",
            "hblkhd",
            "usmblks",
            "fsmblks",
            "uordblks",
            "fordblks",
            "keepcost",
        )
    ]


_MALLOPT, _MALLOC_TRIM, _MALLINFO2 = _function("mallopt"), _function("malloc_trim"), _function("mallinfo2")
if _MALLINFO2 is not None:
    _MALLINFO2.restype = _MallocInfo


def map_large_allocations(threshold: int = THRESHOLD_BYTES) -> bool:
    """Fix glibc's mmap threshold (which stops it rising); False where that cannot be done."""
    return _MALLOPT is not None and bool(_MALLOPT(M_MMAP_THRESHOLD, threshold))


def trim() -> None:
    """Hand the heap's free pages back to the system (it takes milliseconds)."""
    if _MALLOC_TRIM is not None:
        _MALLOC_TRIM(0)


def heap_in_use() -> int:
    """Bytes the C heap has handed out (over every arena, mapped blocks included), or 0 where unknown."""
    if _MALLINFO2 is None:
        return 0
    info = _MALLINFO2()
    return int(info.uordblks + info.hblkhd)
