"""The KV cache manager's check of itself, which the tests run after every step: every pool's counts add up."""

from __future__ import annotations

from collections.abc import Iterable

from services.scheduler.block_pool import BlockPool
from services.scheduler.sequence_kv import SequenceKV
from shared.protocol import DEVICE, HOST


def audit(
    handles: Iterable[SequenceKV],
    device: BlockPool,
    swap: BlockPool,
    host_cache: BlockPool,
    adapter_pages: dict[int, int],
    reading: dict[int, int],
) -> None:
    """Raise AssertionError unless, in every tier, each block is exactly one of free, referenced or
    cached, and each block's reference count is the number of block tables that hold it (and one for each
    page of an adapter a request holds; in the host cache, whose blocks only wait to be loaded, one for a
    block a file is being read into)."""
    counts: dict[int, dict[int, int]] = {DEVICE: {}, HOST: {}}
    for kv in handles:
        held = counts[kv._tier]
        for block in kv._blocks:
            held[block] = held.get(block, 0) + 1
    for page, count in adapter_pages.items():
        counts[DEVICE][page] = counts[DEVICE].get(page, 0) + count
    for name, pool, held in (
        ("device", device, counts[DEVICE]),
        ("swap", swap, counts[HOST]),
        ("host cache", host_cache, reading),
    ):
        pool.audit()
        for block in range(pool.num_blocks):
            if pool.ref_count(block) != held.get(block, 0):
                raise AssertionError(
                    f"{name}: block {block} is referenced {pool.ref_count(block)} "
                    f"times, held by {held.get(block, 0)} block tables"
                )
