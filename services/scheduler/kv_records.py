"""Values of the KV cache manager's API: the cached blocks a prompt starts with, and the counts of blocks moved."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from shared.protocol import DEVICE, HOST


@dataclass(slots=True)
class PrefixMatch:
    """The cached blocks a prompt starts with, in order: (tier, block), a host block to be loaded; then
    the blocks after them that are only on disk, as (key, tokens), to read before it starts, and
    whether some of its blocks are being read already."""

    blocks: list[tuple[int, int]] = field(default_factory=list)
    reads: list[tuple[bytes, tuple[int, ...]]] = field(default_factory=list)
    waiting: bool = False

    @classmethod
    def on_device(cls, blocks: Iterable[int]) -> PrefixMatch:
        return cls([(DEVICE, block) for block in blocks])

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    @property
    def num_loads(self) -> int:
        """Blocks that come from host memory: each takes a device block."""
        return sum(1 for tier, _ in self.blocks if tier == HOST)


@dataclass(slots=True)
class TransferCounts:
    """Blocks moved since the start, by why."""

    swapped_out: int = 0
    swapped_in: int = 0
    copied: int = 0  # copy-on-write
    offloaded: int = 0  # device -> host cache, as the device evicted them
    loaded: int = 0  # host cache -> device, for a prefix hit
    written: int = 0  # device -> disk, as they were cached
    read: int = 0  # disk -> host cache, found whole
    refused: int = 0  # disk reads that found no whole file for their key
