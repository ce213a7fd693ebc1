"""A pool of physical KV blocks with reference counts, and an optional prefix cache.

Every block is in exactly one of three states: free, referenced (by one or more block tables),
or cached-and-evictable (no references, but its content is findable by hash and is reused on
a hit, or evicted least-recently-freed first when a free block is needed).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable


class OutOfBlocks(RuntimeError):
    pass


class BlockPool:
    def __init__(self, num_blocks: int, enable_caching: bool = False):
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self._free: list[int] = list(range(num_blocks - 1, -1, -1))  # pop() hands out 0 first
        self._ref_counts = [0] * num_blocks
        self._evictable: OrderedDict[int, None] = OrderedDict()
        self._by_hash: dict[bytes, int] = {}
        self._key_of: dict[int, tuple[bytes, tuple[int, ...]]] = {}  # block -> (key, tokens)
        # Told of each cached block an allocation evicts, before the block is handed out: (block, key, tokens).
        self.on_evict: Callable[[int, bytes, tuple[int, ...]], None] | None = None

    # --- counts --------------------------------------------------------------------------

    @property
    def num_available(self) -> int:
        """Blocks an allocation can take: free ones, and cached ones nobody references."""
        return len(self._free) + len(self._evictable)

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_evictable(self) -> int:
        return len(self._evictable)

    @property
    def num_referenced(self) -> int:
        return self.num_blocks - len(self._free) - len(self._evictable)

    def ref_count(self, block: int) -> int:
        return self._ref_counts[block]

    # --- allocation ----------------------------------------------------------------------

    def allocate(self) -> int:
        if self._free:
            block = self._free.pop()
        elif self._evictable:
            block, _ = self._evictable.popitem(last=False)
            key, tokens = self._key_of[block]
            self._forget(block)
            if self.on_evict is not None:
                self.on_evict(block, key, tokens)
        else:
            raise OutOfBlocks("no free block")
        self._ref_counts[block] = 1
        return block

    def share(self, block: int) -> None:
        """One more block table references `block` (a fork, or a prefix-cache hit)."""
        if self._ref_counts[block] == 0:
            if block not in self._evictable:
                raise ValueError(f"block {block} is free; it cannot be shared")
            del self._evictable[block]
        self._ref_counts[block] += 1

    def release(self, block: int) -> None:
        count = self._ref_counts[block]
        if count <= 0:
            raise ValueError(f"block {block} is already free")
        self._ref_counts[block] = count - 1
        if count == 1:
            if block in self._key_of:
                self._evictable[block] = None  # most recently freed last
            else:
                self._free.append(block)

    # --- contiguous runs, for the reservation baselines -------------------------------

    def free_runs(self, uncached: bool = False) -> list[tuple[int, int]]:
        """(first block, length) of each maximal run of unreferenced blocks with consecutive ids (with `uncached`,
        of blocks no cache holds either)."""
        runs, start = [], None
        for block, count in enumerate(self._ref_counts):
            taken = count or (uncached and block in self._key_of)
            if not taken and start is None:
                start = block
            elif taken and start is not None:
                runs.append((start, block - start))
                start = None
        if start is not None:
            runs.append((start, self.num_blocks - start))
        return runs

    def allocate_run(self, count: int, uncached: bool = False) -> list[int]:
        """`count` blocks with consecutive ids from the first free run long enough (first fit), as an
        allocator of contiguous memory hands them out; with `uncached`, a run that evicts no cached block."""
        start = next((first for first, length in self.free_runs(uncached) if length >= count), None)
        if start is None:
            raise OutOfBlocks(f"no run of {count} free blocks")
        run = range(start, start + count)
        self._free = [block for block in self._free if not start <= block < start + count]
        evicted = []
        for block in run:
            if block in self._evictable:
                del self._evictable[block]
                evicted.append((block, *self._key_of[block]))
                self._forget(block)
            self._ref_counts[block] = 1
        if self.on_evict is not None:  # once the whole run is taken: a callback may free other cached blocks
            for block, key, tokens in evicted:
                self.on_evict(block, key, tokens)
        return list(run)

    # --- prefix cache --------------------------------------------------------------------

    def cache(self, block: int, block_hash: bytes, tokens: tuple[int, ...]) -> None:
        """Make a full, referenced block findable by its content."""
        if not self.enable_caching or block in self._key_of or block_hash in self._by_hash:
            return
        self._by_hash[block_hash] = block
        self._key_of[block] = (block_hash, tokens)

    def keep(self, block: int, key: bytes) -> None:
        """Make a referenced block findable by `key` whether or not prefix caching is on (an adapter's page):
        released, it waits among the cached blocks."""
        self._by_hash[key] = block
        self._key_of[block] = (key, ())

    def uncache(self, block: int) -> None:
        """Forget a block's key; unreferenced, it is free again."""
        if block not in self._key_of:
            return
        self._forget(block)
        if block in self._evictable:
            del self._evictable[block]
            self._free.append(block)

    def lookup(self, block_hash: bytes, tokens: tuple[int, ...]) -> int | None:
        """The cached block holding exactly `tokens` after the same prefix, if any."""
        block = self._by_hash.get(block_hash)
        if block is None or self._key_of[block][1] != tokens:
            return None  # a miss, or a hash collision: never return wrong KV
        return block

    def holds(self, block_hash: bytes) -> bool:
        """Whether a block of this key is cached (in use or evictable)."""
        return block_hash in self._by_hash

    def is_evictable(self, block: int) -> bool:
        return block in self._evictable

    def audit(self) -> None:
        """Raise AssertionError unless each block is exactly one of free, referenced or cached-and-evictable,
        and the prefix cache's two maps agree."""
        free, evictable = set(self._free), set(self._evictable)
        referenced = {block for block, count in enumerate(self._ref_counts) if count > 0}
        if (
            len(free) != len(self._free)
            or free & evictable
            or referenced & (free | evictable)
            or len(free) + len(evictable) + len(referenced) != self.num_blocks
        ):
            raise AssertionError(
                f"{len(self._free)} free, {len(evictable)} cached and {len(referenced)} referenced "
                f"blocks overlap or do not make up the pool of {self.num_blocks}"
            )
        if any(self._by_hash.get(key) != block for block, (key, _) in self._key_of.items()) or (
            len(self._by_hash) != len(self._key_of) or not evictable <= self._key_of.keys()
        ):
            raise AssertionError("the prefix cache's maps disagree")

    def _forget(self, block: int) -> None:
        block_hash, _ = self._key_of.pop(block)
        del self._by_hash[block_hash]
