"""Large allocations go straight back to the system when freed.

glibc serves an allocation from its own mapping once it is over a threshold that rises to each
large block freed (up to 32 MiB); after that, blocks of that size come from the heap and stay in
the process once freed. Frames a peer sends before it authenticates are exactly such blocks, so a
process that reads them from strangers fixes the threshold: each one is mapped and unmapped."""

from __future__ import annotations

import ctypes

M_MMAP_THRESHOLD = -3
THRESHOLD_BYTES = 1 << 20


def map_large_allocations(threshold: int = THRESHOLD_BYTES) -> bool:
    """Fix glibc's mmap threshold (which stops it rising); False where the C library is not glibc."""
    try:
        return bool(ctypes.CDLL(None).mallopt(M_MMAP_THRESHOLD, threshold))
    except (OSError, AttributeError):
        return False
