"""A sequence's KV state as the KV cache manager (services/scheduler/kv_cache_manager.py) keeps it."""

from __future__ import annotations

from collections.abc import Sequence as Blocks

from shared.protocol import DEVICE, HOST


class SequenceKV:
    """A sequence's KV state. Read it anywhere; only `KVCacheManager` writes it."""

    __slots__ = ("_blocks", "_computed", "_hashes", "_synced", "_tier")

    def __init__(self) -> None:
        self._blocks: list[int] = []  # block ids in the pool of `_tier`
        self._computed = 0  # positions computed, or scheduled in a step in flight (its proposals included)
        self._hashes: list[bytes] = []  # prefix-cache keys of the full blocks so far
        self._synced = 0  # block table entries before this index are known to the workers
        self._tier = DEVICE

    @property
    def num_computed(self) -> int:
        return self._computed

    @property
    def block_table(self) -> Blocks[int]:
        return self._blocks

    @property
    def swapped(self) -> bool:
        return self._tier == HOST
