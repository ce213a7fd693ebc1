"""The prefix cache past the device pool: the host cache in the worker's host memory (`--kv-offloading-size`) and the
files under `--kv-cache-dir`, behind one small API the KV cache manager calls.

A device block enters the host cache with its key as soon as it is cached on the device (write-through), or, write-back,
as the device evicts it; with a folder, every cached block is written to a file too (a restart finds it). A prompt that
matches blocks in the host cache loads them back into device blocks; one that matches files first has them read into the
host cache, off the steps (the running requests' steps go on meanwhile), and starts once a step's result says they are
in, on the blocks whose files the workers found whole. Each move is queued as a `BlockTransfer` on the manager's list,
in order.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from services.scheduler.block_pool import BlockPool
from services.scheduler.disk_index import DiskIndex
from services.scheduler.kv_connectors import KVConnector
from services.scheduler.kv_records import PrefixMatch, TransferCounts
from shared.prefix_keys import block_keys
from shared.protocol import DEVICE, DISK, HOST, BlockTransfer

if TYPE_CHECKING:
    from services.scheduler.request import Request, Sequence
    from shared.protocol import StepResult


class PrefixTiers(KVConnector):
    def __init__(
        self,
        device_pool: BlockPool,
        host_cache: BlockPool,
        host_offset: int,
        disk: DiskIndex | None,
        write_through: bool,
        transfers: list[BlockTransfer],
        moved: TransferCounts,
        block_size: int = 16,
    ):
        self.device_pool, self.host_cache, self.host_offset = device_pool, host_cache, host_offset
        self.block_size = block_size
        self.disk = disk if host_cache.num_blocks else None
        self.write_through = write_through and bool(host_cache.num_blocks)
        self.transfers, self.moved = transfers, moved
        self.reading: dict[bytes, tuple[int, tuple[int, ...]]] = {}  # key -> (host block, tokens) being read

    def match(self, seq: Sequence, block_size: int, disk: bool, match: PrefixMatch) -> None:
        """Fill `match` with the cached blocks, on the device or in the host cache (and with `disk`, then on
        disk), holding the start of the sequence's tokens (never all of them: the last token must be computed
        to give the next token's logits)."""
        tokens = seq.token_ids()
        for _, parent, chunk in block_keys(seq.request.cache_root, tokens, block_size, (len(tokens) - 1) // block_size):
            if not match.reads:  # after a block to read from disk, only more of those: no gap in the table
                block = self.device_pool.lookup(parent, chunk)
                if block is not None:
                    match.blocks.append((DEVICE, block))
                    continue
                slot = self.host_cache.lookup(parent, chunk) if self.host_cache.num_blocks else None
                if slot is not None:
                    match.blocks.append((HOST, slot))
                    continue
            if not disk or not self._on_disk(match, parent, chunk):
                break

    def _on_disk(self, match: PrefixMatch, key: bytes, chunk: tuple[int, ...]) -> bool:
        """Whether the match goes on with a block only on disk (to be read first)."""
        if self.disk is None or match.waiting:
            return False
        if key in self.reading:
            match.waiting = True
            return False
        if not self.disk.holds(key):
            return False
        match.reads.append((key, chunk))
        return True

    # --- as a connector (services/scheduler/kv_connectors.py) -----------------------------------

    def start_loads(self, seq: Sequence, holds: Callable[[bytes], bool]) -> bool:
        """Read the prompt's blocks only on disk into the host cache (those in host memory load with the start)."""
        if self.disk is None or not self.device_pool.enable_caching:
            return False
        match = PrefixMatch()
        self.match(seq, self.block_size, True, match)
        return match.waiting or (bool(match.reads) and self.read_from_disk(match))

    def is_loading(self, request: Request) -> bool:
        """Whether a block of its prompt is being read from disk."""
        if not self.reading or not request.seqs:
            return False
        tokens = request.seqs[0].token_ids()
        keys = block_keys(request.cache_root, tokens, self.block_size, (len(tokens) - 1) // self.block_size)
        return any(key in self.reading for _, key, _ in keys)

    def loading_keys(self) -> set[bytes]:
        return set(self.reading)

    def on_result(self, result: StepResult) -> None:
        if result.reads or result.failed_reads:
            self.finish_reads(result.reads + result.failed_reads, set(result.failed_reads))

    def abandon(self) -> None:
        self.abandon_reads()

    @property
    def pending(self) -> bool:
        return bool(self.reading)

    # --- the disk tier --------------------------------------------------------------------------

    def read_from_disk(self, match: PrefixMatch) -> bool:
        """Queue reads of the match's blocks on disk into the host cache, as far as it has room. True if some
        are read (the request waits until a step's result reports them); False if none can be, so that the
        request computes them instead."""
        held = [block for tier, block in match.blocks if tier == HOST]
        for block in held:  # its hits in the host cache are not what the reads make room by
            self.host_cache.share(block)
        for key, tokens in match.reads:
            if key in self.reading:
                continue
            if not self.host_cache.num_available:
                break
            slot = self.host_cache.allocate()  # held until the read is done
            self.reading[key] = (slot, tokens)
            self.transfers.append(BlockTransfer(DISK, 0, HOST, self.host_offset + slot, key))
            assert self.disk is not None
            self.disk.touch(key)
        for block in held:
            self.host_cache.release(block)
        return any(key in self.reading for key, _ in match.reads)

    def finish_reads(self, keys: list[bytes], failed: set[bytes]) -> None:
        """The workers read these files (off the steps, reported with a step's result): the whole ones are in the
        host cache from now on, the others are forgotten (their blocks will be computed)."""
        for key in keys:
            if key not in self.reading:
                continue  # abandoned: a step failed since
            slot, tokens = self.reading.pop(key)
            if key in failed:
                self.moved.refused += 1
                assert self.disk is not None
                self.disk.drop(key)
            else:
                self.moved.read += 1
                self.host_cache.cache(slot, key, tokens)
            self.host_cache.release(slot)

    def abandon_reads(self) -> None:
        """A step failed, and the workers forgot their reads: the host blocks go back uncached (what was read
        into them is not known), and the files stay, to be read again."""
        for slot, _ in self.reading.values():
            self.host_cache.release(slot)
        self.reading.clear()

    def cached(self, block: int, key: bytes, chunk: tuple[int, ...]) -> None:
        """A device block was just cached under `key`: written through to the host cache, and to a file."""
        if self.write_through:
            self.offload(block, key, chunk)
        if self.disk is not None and not self.disk.holds(key) and key not in self.reading:
            self.transfers.append(BlockTransfer(DEVICE, block, DISK, 0, key))
            self.disk.add(key)
            self.moved.written += 1

    def evicted(self, block: int, key: bytes, tokens: tuple[int, ...]) -> None:
        """The device evicts a cached block: write-back copies it to the host cache now."""
        if self.host_cache.num_blocks and not self.write_through:
            self.offload(block, key, tokens)

    def offload(self, block: int, key: bytes, tokens: tuple[int, ...]) -> None:
        """Copy a cached device block to the host cache (unless that holds it already), in place of the host
        cache's least recently offloaded block when it is full."""
        if self.host_cache.holds(key) or not self.host_cache.num_available:
            return
        slot = self.host_cache.allocate()
        self.host_cache.cache(slot, key, tokens)
        self.host_cache.release(slot)
        self.transfers.append(BlockTransfer(DEVICE, block, HOST, self.host_offset + slot))
        self.moved.offloaded += 1

    def holds(self, key: bytes) -> bool:
        """Whether a block of this key is cached in the host cache or on disk."""
        return self.host_cache.holds(key) or (self.disk is not None and self.disk.holds(key))

    def reading_slots(self) -> dict[int, int]:
        """Host blocks held by a read in flight (one reference each), for the manager's audit."""
        return {slot: 1 for slot, _ in self.reading.values()}
