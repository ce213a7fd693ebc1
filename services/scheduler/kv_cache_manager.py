"""The one owner of the scheduler's KV state: which physical blocks each sequence holds, in which
tier, how many of its positions are computed, the prefix-cache keys of its full blocks, and how
much of its block table the workers have been told.

Everything else holds a sequence's `SequenceKV` as an opaque handle: it may read it, and changes
it only through this manager's methods (allocate slots, mark computed, take back rejected
proposals, match a prefix, fork, swap, free). Each change of where a block's contents live is
queued as a `BlockTransfer`, in the order the changes were made; the scheduler takes the queue
with the step it builds, and the workers carry the transfers out in that order before its forward
pass, so a block is read before it is written again.

Blocks are added one at a time as a sequence grows. Forked sequences share every block; the
first write into a shared, partly filled block copies it (copy-on-write). With prefix caching,
each full block is keyed by a hash chained from its parent's (the first from its request's
`cache_salt`), and a new sequence starts from every cached block its prompt matches.

Tiers: the device pool, the worker's host memory, and files. Host memory holds the swap pool (whole
preempted requests) and, with `--kv-offloading-size`, a host cache: each block is copied there with its
key as soon as it is cached on the device (write-through), or, write-back, as the device evicts it; a
later prompt that matches it loads it back to the
device instead of computing it again. With `--kv-cache-dir` each full block is also written to a
file as soon as it is cached on the device (so a restart finds it); a prompt that matches files
first has them read into the host cache, and starts once a step has done so, on the blocks whose
files the workers found whole.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from services.scheduler.adapter_pages import AdapterPages
from services.scheduler.block_pool import BlockPool
from services.scheduler.disk_index import DiskIndex
from services.scheduler.sequence_kv import SequenceKV
from shared.prefix_keys import chain_key
from shared.protocol import DEVICE, DISK, HOST, BlockTransfer, LoraLoad

if TYPE_CHECKING:
    from services.scheduler.request import Request, Sequence


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


class KVCacheManager:
    def __init__(
        self,
        num_gpu_blocks: int,
        block_size: int,
        num_cpu_blocks: int = 0,
        watermark: float = 0.01,
        enable_prefix_caching: bool = False,
        num_host_cache_blocks: int = 0,
        disk: DiskIndex | None = None,
        write_through: bool = False,
    ):
        self.block_size = block_size
        self.gpu = BlockPool(num_gpu_blocks, enable_caching=enable_prefix_caching)
        self.cpu = BlockPool(num_cpu_blocks)  # the swap pool: host ids [0, num_cpu_blocks)
        # The host cache: host ids from num_cpu_blocks on. Its blocks are never referenced, only cached.
        self.host = BlockPool(num_host_cache_blocks if enable_prefix_caching else 0, enable_caching=True)
        self._host_offset = num_cpu_blocks
        self.watermark_blocks = int(watermark * num_gpu_blocks)
        self.moved = TransferCounts()
        self._transfers: list[BlockTransfer] = []
        self.disk = disk if enable_prefix_caching and self.host.num_blocks else None
        self._reading: dict[bytes, tuple[int, tuple[int, ...]]] = {}  # key -> (host block, tokens) being read
        self.write_through = write_through and bool(self.host.num_blocks)
        self.adapters: AdapterPages | None = None  # with LoRA adapters: their pages in the device pool
        self.gpu.on_evict = self._evicted

    def enable_adapters(self, max_loras: int, half_elements: int, dims: dict[str, list[int]],
                        label_limit: int = 0) -> None:
        self.adapters = AdapterPages(self.gpu, max_loras, half_elements, dims, label_limit)

    def _evicted(self, block: int, key: bytes, tokens: tuple[int, ...]) -> None:
        if self.adapters is not None and self.adapters.evicted(key):
            return
        if self.host.num_blocks and not self.write_through:
            self._offload(block, key, tokens)

    @property
    def num_blocks(self) -> int:
        return self.gpu.num_blocks

    @property
    def num_free_blocks(self) -> int:
        return self.gpu.num_available

    @property
    def caching(self) -> bool:
        return self.gpu.enable_caching

    def _pool(self, tier: int) -> BlockPool:
        """The pool a sequence's blocks are in: the device's, or the swap pool in host memory."""
        return self.cpu if tier == HOST else self.gpu

    # --- the transfers for the next step ---------------------------------------------------

    @property
    def has_transfers(self) -> bool:
        return bool(self._transfers)

    def take_transfers(self) -> list[BlockTransfer]:
        """The transfers queued since the last call, in order, for the step being built."""
        transfers, self._transfers = self._transfers, []
        return transfers

    def take_lora_loads(self) -> list[LoraLoad]:
        """Adapters to write into their pages, after the step's transfers."""
        return self.adapters.take_loads() if self.adapters is not None else []

    # --- growing a running sequence ------------------------------------------------------

    def blocks_needed(self, seq: Sequence, num_new_tokens: int) -> int:
        """New blocks for `num_new_tokens` more tokens, a copy-on-write included."""
        if num_new_tokens == 0:
            return 0
        kv = seq.kv
        total = kv._computed + num_new_tokens
        needed = -(-total // self.block_size) - len(kv._blocks)
        return max(0, needed) + self._write_hits_shared_block(kv)

    def can_append(self, seqs: list[tuple[Sequence, int]]) -> bool:
        if len(seqs) == 1:  # the common case, on the hot path
            return self.blocks_needed(*seqs[0]) <= self.gpu.num_available
        return sum(self.blocks_needed(seq, n) for seq, n in seqs) <= self.gpu.num_available

    def append_slots(self, seq: Sequence, num_new_tokens: int) -> None:
        """Make room for `num_new_tokens`, copying the last block first if the next write hits a shared one."""
        kv = seq.kv
        if num_new_tokens and self._write_hits_shared_block(kv):
            index = len(kv._blocks) - 1
            shared = kv._blocks[index]
            fresh = self.gpu.allocate()
            self.gpu.release(shared)
            kv._blocks[index] = fresh
            kv._synced = min(kv._synced, index)
            self._transfers.append(BlockTransfer(DEVICE, shared, DEVICE, fresh))
            self.moved.copied += 1
        total = kv._computed + num_new_tokens
        while len(kv._blocks) * self.block_size < total:
            kv._blocks.append(self.gpu.allocate())

    def mark_computed(self, seq: Sequence, num_tokens: int) -> None:
        """A step computes `num_tokens` more positions of the sequence (into slots already appended)."""
        seq.kv._computed += num_tokens

    def take_back(self, seq: Sequence, num_rejected: int) -> None:
        """Positions a step computed for proposals the model rejected count as not computed, and the
        blocks only they had taken go back to the pool."""
        kv = seq.kv
        kv._computed -= num_rejected
        keep = -(-kv._computed // self.block_size)
        while len(kv._blocks) > keep:
            self.gpu.release(kv._blocks.pop())
        kv._synced = min(kv._synced, len(kv._blocks))

    def can_reserve(self, num_blocks: int) -> bool:
        return any(length >= num_blocks for _, length in self.gpu.free_runs())

    def reserve(self, seq: Sequence, num_blocks: int) -> None:
        """`num_blocks` blocks at once, with consecutive ids: how a baseline with contiguous KV memory
        holds them."""
        kv = seq.kv
        if num_blocks > len(kv._blocks):
            kv._blocks.extend(self.gpu.allocate_run(num_blocks - len(kv._blocks)))

    def fragmented_blocks(self, num_blocks: int) -> int:
        """Free blocks in runs too short for a reservation of `num_blocks`: external fragmentation."""
        return sum(length for _, length in self.gpu.free_runs() if length < num_blocks)

    def _write_hits_shared_block(self, kv: SequenceKV) -> bool:
        return kv._computed % self.block_size != 0 and self.gpu.ref_count(kv._blocks[-1]) > 1

    # --- starting a sequence -------------------------------------------------------------

    def match_prefix(self, seq: Sequence, disk: bool = True) -> PrefixMatch:
        """Cached blocks, on the device or in the host cache (and with `disk`, then on disk), holding the
        start of the sequence's tokens (never all of them: the last token must be computed to give the
        next token's logits)."""
        match = PrefixMatch()
        if not self.gpu.enable_caching:
            return match
        tokens = seq.token_ids()
        parent = seq.request.cache_root
        for start in range(0, len(tokens) - 1 - self.block_size + 1, self.block_size):
            chunk = tuple(tokens[start : start + self.block_size])
            parent = chain_key(parent, chunk)
            if not match.reads:  # after a block to read from disk, only more of those: no gap in the table
                block = self.gpu.lookup(parent, chunk)
                if block is not None:
                    match.blocks.append((DEVICE, block))
                    continue
                slot = self.host.lookup(parent, chunk) if self.host.num_blocks else None
                if slot is not None:
                    match.blocks.append((HOST, slot))
                    continue
            if not disk or not self._on_disk(match, parent, chunk):
                break
        return match

    def _on_disk(self, match: PrefixMatch, key: bytes, chunk: tuple[int, ...]) -> bool:
        """Whether the match goes on with a block only on disk (to be read first)."""
        if self.disk is None or match.waiting:
            return False
        if key in self._reading:
            match.waiting = True
            return False
        if not self.disk.holds(key):
            return False
        match.reads.append((key, chunk))
        return True

    def read_from_disk(self, match: PrefixMatch) -> bool:
        """Queue reads of the match's blocks on disk into the host cache, as far as it has room. True if some
        are read (the request waits for the step that reads them); False if none can be, so that the
        request computes them instead."""
        held = [block for tier, block in match.blocks if tier == HOST]
        for block in held:  # its hits in the host cache are not what the reads make room by
            self.host.share(block)
        for key, tokens in match.reads:
            if key in self._reading:
                continue
            if not self.host.num_available:
                break
            slot = self.host.allocate()  # held until the read is done
            self._reading[key] = (slot, tokens)
            self._transfers.append(BlockTransfer(DISK, 0, HOST, self._host_offset + slot, key))
            assert self.disk is not None
            self.disk.touch(key)
        for block in held:
            self.host.release(block)
        return any(key in self._reading for key, _ in match.reads)

    def finish_reads(self, keys: list[bytes], failed: set[bytes]) -> None:
        """A step read these files: the whole ones are in the host cache from now on, the others are
        forgotten (their blocks will be computed)."""
        for key in keys:
            slot, tokens = self._reading.pop(key)
            if key in failed:
                self.moved.refused += 1
                assert self.disk is not None
                self.disk.drop(key)
            else:
                self.moved.read += 1
                self.host.cache(slot, key, tokens)
            self.host.release(slot)

    def abandon_reads(self) -> None:
        """The steps that were to read files failed: their host blocks go back."""
        self.finish_reads(list(self._reading), set())

    def revives(self, match: PrefixMatch) -> int:
        """Device blocks of the match that nobody references: starting on them takes them from the available ones."""
        return sum(1 for tier, block in match.blocks if tier == DEVICE and self.gpu.is_evictable(block))

    def start(self, seq: Sequence, match: PrefixMatch) -> None:
        """Start a sequence on cached blocks (prefix-cache hits, or the blocks of a leader it shares);
        the tokens they hold count as computed. A block in the host cache is loaded into a new device
        block, which the device's prefix cache then holds too."""
        kv = seq.kv
        pinned = [block for tier, block in match.blocks if tier == HOST]
        for tier, block in match.blocks:  # held first, so that no allocation below evicts one of them
            (self.host if tier == HOST else self.gpu).share(block)
        kv._hashes = self._chain(seq, match.num_blocks)
        table = []
        for index, (tier, block) in enumerate(match.blocks):
            if tier == HOST:
                loaded = self.gpu.allocate()
                self._transfers.append(BlockTransfer(HOST, self._host_offset + block, DEVICE, loaded))
                self.moved.loaded += 1
                size = self.block_size
                self.gpu.cache(loaded, kv._hashes[index], tuple(seq.token_at(p) for p in
                                                                range(index * size, (index + 1) * size)))
                block = loaded
            table.append(block)
        for slot in pinned:
            self.host.release(slot)
        kv._blocks = table
        kv._computed = len(table) * self.block_size
        kv._synced = 0
        kv._tier = DEVICE

    def cache_full_blocks(self, seq: Sequence) -> None:
        """Register the blocks that computation has filled since the last call."""
        if not self.gpu.enable_caching:
            return
        kv = seq.kv
        # A step planned ahead may have scheduled the position of a token not sampled yet.
        num_full = min(kv._computed, seq.num_tokens) // self.block_size
        for index in range(len(kv._hashes), num_full):
            parent = kv._hashes[-1] if kv._hashes else seq.request.cache_root
            chunk = tuple(seq.token_at(p) for p in range(index * self.block_size, (index + 1) * self.block_size))
            block_hash = chain_key(parent, chunk)
            kv._hashes.append(block_hash)
            self.gpu.cache(kv._blocks[index], block_hash, chunk)
            if self.write_through:
                self._offload(kv._blocks[index], block_hash, chunk)
            if self.disk is not None and not self.disk.holds(block_hash) and block_hash not in self._reading:
                self._transfers.append(BlockTransfer(DEVICE, kv._blocks[index], DISK, 0, block_hash))
                self.disk.add(block_hash)
                self.moved.written += 1

    def _chain(self, seq: Sequence, num_blocks: int) -> list[bytes]:
        hashes, parent, tokens = [], seq.request.cache_root, seq.token_ids()
        for index in range(num_blocks):
            parent = chain_key(parent, tokens[index * self.block_size : (index + 1) * self.block_size])
            hashes.append(parent)
        return hashes

    def _offload(self, block: int, key: bytes, tokens: tuple[int, ...]) -> None:
        """Copy a cached device block to the host cache (unless that holds it already), in place of the host
        cache's least recently offloaded block when it is full: as the device evicts it, or write-through as
        soon as it is cached."""
        if self.host.holds(key) or not self.host.num_available:
            return
        slot = self.host.allocate()
        self.host.cache(slot, key, tokens)
        self.host.release(slot)
        self._transfers.append(BlockTransfer(DEVICE, block, HOST, self._host_offset + slot))
        self.moved.offloaded += 1

    def holds(self, key: bytes) -> bool:
        """Whether a block of this prefix-cache key is cached in any tier."""
        return self.gpu.holds(key) or self.host.holds(key) or (self.disk is not None and self.disk.holds(key))

    # --- forking and freeing -------------------------------------------------------------

    def fork(self, parent: Sequence, child: Sequence) -> None:
        """The child shares all of the parent's blocks, and the workers know its table as far as the parent's."""
        source, kv = parent.kv, child.kv
        pool = self._pool(source._tier)
        for block in source._blocks:
            pool.share(block)
        kv._blocks = list(source._blocks)
        kv._hashes = list(source._hashes)
        kv._computed = source._computed
        kv._synced = source._synced
        kv._tier = source._tier

    def free(self, seq: Sequence) -> None:
        """Release the sequence's blocks, in whichever tier they are."""
        kv = seq.kv
        pool = self._pool(kv._tier)
        for block in reversed(kv._blocks):
            pool.release(block)
        kv._blocks = []

    def reset(self, seq: Sequence) -> None:
        """Preempted by recompute: its blocks go, and every position counts as not computed."""
        self.free(seq)
        kv = seq.kv
        kv._computed = 0
        kv._hashes.clear()
        kv._synced = 0
        kv._tier = DEVICE

    # --- what the workers are told -------------------------------------------------------

    def unsynced_blocks(self, seq: Sequence, worker_has_table: bool) -> tuple[int, list[int]]:
        """Where the workers' copy of the block table stops being right, and the entries from there on
        (all of them for a sequence the workers do not hold); from now on the workers know the table."""
        kv = seq.kv
        start = kv._synced if worker_has_table else 0
        kv._synced = len(kv._blocks)
        return start, kv._blocks[start:]

    # --- swapping whole requests ---------------------------------------------------------

    def _unique_blocks(self, request: Request) -> list[int]:
        return list(dict.fromkeys(b for seq in request.seqs for b in seq.kv._blocks))

    def num_blocks_held(self, request: Request) -> int:
        """Distinct blocks the request's sequences hold (shared ones once)."""
        return len(self._unique_blocks(request))

    def can_swap_out(self, request: Request) -> bool:
        return len(self._unique_blocks(request)) <= self.cpu.num_available

    def swap_out(self, request: Request) -> None:
        """Move the request's blocks to the swap pool in host memory; its adapter's pages it no longer holds."""
        self.moved.swapped_out += self._move(request, DEVICE, HOST)
        if self.adapters is not None:
            self.adapters.release(request.request_id, request.lora)

    def can_swap_in(self, request: Request) -> bool:
        needed = len(self._unique_blocks(request)) + len(request.seqs)  # and room to grow
        if self.adapters is not None:
            if not self.adapters.can_start(request.lora):
                return False
            needed += self.adapters.blocks_to_start(request.lora)
        return self.gpu.num_available - needed >= self.watermark_blocks

    def swap_in(self, request: Request) -> None:
        """Move the request's blocks back to the device, its adapter's pages first (loaded again if need be)."""
        if self.adapters is not None and request.lora is not None:
            self.adapters.acquire(request.request_id, request.lora)
        self.moved.swapped_in += self._move(request, HOST, DEVICE)

    def _move(self, request: Request, source_tier: int, target_tier: int) -> int:
        source, target = self._pool(source_tier), self._pool(target_tier)
        mapping: dict[int, int] = {}
        for seq in request.seqs:
            kv = seq.kv
            moved = []
            for block in kv._blocks:
                if block not in mapping:
                    mapping[block] = target.allocate()
                    self._transfers.append(BlockTransfer(source_tier, block, target_tier, mapping[block]))
                else:
                    target.share(mapping[block])
                moved.append(mapping[block])
                source.release(block)
            kv._blocks = moved
            kv._synced = 0
            kv._tier = target_tier
        return len(mapping)

    # --- checking ------------------------------------------------------------------------

    def audit(self, handles: Iterable[SequenceKV]) -> None:
        """Raise AssertionError unless, in every tier, each block is exactly one of free, referenced or
        cached, and each block's reference count is the number of block tables that hold it (and one for each
        page of an adapter a request holds; in the host cache, whose blocks only wait to be loaded, one for a
        block a file is being read into)."""
        counts: dict[int, dict[int, int]] = {DEVICE: {}, HOST: {}}
        for kv in handles:
            held = counts[kv._tier]
            for block in kv._blocks:
                held[block] = held.get(block, 0) + 1
        if self.adapters is not None:
            for page, count in self.adapters.held_pages().items():
                counts[DEVICE][page] = counts[DEVICE].get(page, 0) + count
        reading = {slot: 1 for slot, _ in self._reading.values()}
        for name, pool, held in (("device", self.gpu, counts[DEVICE]), ("swap", self.cpu, counts[HOST]),
                                 ("host cache", self.host, reading)):
            pool.audit()
            for block in range(pool.num_blocks):
                if pool.ref_count(block) != held.get(block, 0):
                    raise AssertionError(f"{name}: block {block} is referenced {pool.ref_count(block)} "
                                         f"times, held by {held.get(block, 0)} block tables")
