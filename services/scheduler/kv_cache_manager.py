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

Tiers: the device pool; in the worker's host memory the swap pool (whole preempted requests) and, with
`--kv-offloading-size`, a host cache of prefix-cache blocks; and files (`--kv-cache-dir`). The host cache and
the files are `PrefixTiers` (services/scheduler/prefix_tiers.py). Starting a request (its prefix hits, reads
from disk, its adapter's pages) is planned here too (`plan_start`, services/scheduler/starts.py), so that the
scheduler asks questions of this manager and never reaches into its pools.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

from services.scheduler.adapter_pages import AdapterPages
from services.scheduler.block_pool import BlockPool
from services.scheduler.disk_index import DiskIndex
from services.scheduler.kv_audit import audit
from services.scheduler.kv_connectors import Connectors
from services.scheduler.kv_records import PrefixMatch, TransferCounts
from services.scheduler.prefix_tiers import PrefixTiers
from services.scheduler.remote_kv import RemoteKV
from services.scheduler.sequence_kv import SequenceKV
from services.scheduler.starts import StartPlan, plan_start
from services.scheduler.stats import LoraStats
from shared.prefix_keys import block_keys, chain_key
from shared.protocol import DEVICE, HOST, BlockTransfer, LoraLoad, LoraRef

if TYPE_CHECKING:
    from services.scheduler.request import Request, Sequence


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
        self.device_pool = BlockPool(num_gpu_blocks, enable_caching=enable_prefix_caching)
        self.swap_pool = BlockPool(num_cpu_blocks)  # the swap pool: host ids [0, num_cpu_blocks)
        # The host cache: host ids from num_cpu_blocks on. Its blocks are never referenced, only cached.
        self.host_cache = BlockPool(num_host_cache_blocks if enable_prefix_caching else 0, enable_caching=True)
        self._host_offset = num_cpu_blocks
        self.watermark_blocks = int(watermark * num_gpu_blocks)
        self.moved = TransferCounts()
        self._transfers: list[BlockTransfer] = []
        self.tiers = PrefixTiers(
            self.device_pool,
            self.host_cache,
            num_cpu_blocks,
            disk if enable_prefix_caching else None,
            write_through,
            self._transfers,
            self.moved,
            block_size,
        )
        self.adapters: AdapterPages | None = None  # with LoRA adapters: their pages in the device pool
        self.remote = RemoteKV(self.device_pool, block_size)  # blocks to and from other engines (P/D)
        self.connectors = Connectors([self.tiers, self.remote], self.holds)  # the one way KV enters or leaves
        self.device_pool.on_evict = self._evicted

    def enable_adapters(
        self, max_loras: int, half_elements: int, dims: dict[str, list[int]], label_limit: int = 0
    ) -> None:
        self.adapters = AdapterPages(self.device_pool, max_loras, half_elements, dims, label_limit)

    def _evicted(self, block: int, key: bytes, tokens: tuple[int, ...]) -> None:
        if self.adapters is not None and self.adapters.evicted(key):
            return
        self.connectors.evicted(block, key, tokens)

    @property
    def disk(self) -> DiskIndex | None:
        return self.tiers.disk

    @property
    def num_blocks(self) -> int:
        return self.device_pool.num_blocks

    @property
    def num_free_blocks(self) -> int:
        return self.device_pool.num_available

    @property
    def caching(self) -> bool:
        return self.device_pool.enable_caching

    def _pool(self, tier: int) -> BlockPool:
        """The pool a sequence's blocks are in: the device's, or the swap pool in host memory."""
        return self.swap_pool if tier == HOST else self.device_pool

    # --- the transfers for the next step ---------------------------------------------------

    @property
    def has_transfers(self) -> bool:
        return bool(self._transfers) or self.connectors.has_messages

    def take_transfers(self) -> list[BlockTransfer]:
        """The transfers queued since the last call, in order, for the step being built."""
        transfers = list(self._transfers)
        self._transfers.clear()  # the list the prefix tiers queue on too
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
            return self.blocks_needed(*seqs[0]) <= self.device_pool.num_available
        return sum(self.blocks_needed(seq, n) for seq, n in seqs) <= self.device_pool.num_available

    def append_slots(self, seq: Sequence, num_new_tokens: int) -> None:
        """Make room for `num_new_tokens`, copying the last block first if the next write hits a shared one."""
        kv = seq.kv
        if num_new_tokens and self._write_hits_shared_block(kv):
            index = len(kv._blocks) - 1
            shared = kv._blocks[index]
            fresh = self.device_pool.allocate()
            self.device_pool.release(shared)
            kv._blocks[index] = fresh
            kv._synced = min(kv._synced, index)
            self._transfers.append(BlockTransfer(DEVICE, shared, DEVICE, fresh))
            self.moved.copied += 1
        total = kv._computed + num_new_tokens
        while len(kv._blocks) * self.block_size < total:
            kv._blocks.append(self.device_pool.allocate())

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
            self.device_pool.release(kv._blocks.pop())
        kv._synced = min(kv._synced, len(kv._blocks))

    def can_reserve(self, num_blocks: int) -> bool:
        return any(length >= num_blocks for _, length in self.device_pool.free_runs())

    def reserve(self, seq: Sequence, num_blocks: int) -> None:
        """`num_blocks` blocks at once, with consecutive ids: how a baseline with contiguous KV memory
        holds them."""
        kv = seq.kv
        if num_blocks > len(kv._blocks):
            kv._blocks.extend(self.device_pool.allocate_run(num_blocks - len(kv._blocks)))

    def fragmented_blocks(self, num_blocks: int) -> int:
        """Free blocks in runs too short for a reservation of `num_blocks`: external fragmentation."""
        return sum(length for _, length in self.device_pool.free_runs() if length < num_blocks)

    def _write_hits_shared_block(self, kv: SequenceKV) -> bool:
        return kv._computed % self.block_size != 0 and self.device_pool.ref_count(kv._blocks[-1]) > 1

    # --- starting a sequence -------------------------------------------------------------

    def match_prefix(self, seq: Sequence, disk: bool = True) -> PrefixMatch:
        """Cached blocks, on the device or in the host cache (and with `disk`, then on disk), holding the
        start of the sequence's tokens (never all of them: the last token must be computed)."""
        match = PrefixMatch()
        if self.device_pool.enable_caching:
            self.tiers.match(seq, self.block_size, disk, match)
        return match

    def read_from_disk(self, match: PrefixMatch) -> bool:
        """Queue reads of the match's blocks on disk (PrefixTiers.read_from_disk): True if the request waits."""
        return self.tiers.read_from_disk(match)

    @property
    def reads_pending(self) -> bool:
        """Loads (from disk, from another engine) the workers started and have not reported yet."""
        return self.connectors.pending

    def finish_reads(self, keys: list[bytes], failed: set[bytes]) -> None:
        self.tiers.finish_reads(keys, failed)

    def abandon_reads(self) -> None:
        self.connectors.abandon()

    def plan_start(
        self, request: Request, budget: int, chunked_prefill: bool, reserved: int, watermark: bool, disk: bool = True
    ) -> StartPlan | None:
        """How a waiting request starts, or None if it does not fit now (services/scheduler/starts.py)."""
        return plan_start(self, request, budget, chunked_prefill, reserved, watermark, disk)

    def revives(self, match: PrefixMatch) -> int:
        """Device blocks of the match that nobody references: starting on them takes them from the available ones."""
        return sum(1 for tier, block in match.blocks if tier == DEVICE and self.device_pool.is_evictable(block))

    def start(self, seq: Sequence, match: PrefixMatch) -> None:
        """Start a sequence on cached blocks (prefix-cache hits, or the blocks of a leader it shares);
        the tokens they hold count as computed. A block in the host cache is loaded into a new device
        block, which the device's prefix cache then holds too."""
        kv = seq.kv
        pinned = [block for tier, block in match.blocks if tier == HOST]
        for tier, block in match.blocks:  # held first, so that no allocation below evicts one of them
            (self.host_cache if tier == HOST else self.device_pool).share(block)
        kv._hashes = self._chain(seq, match.num_blocks)
        table = []
        for index, (tier, block) in enumerate(match.blocks):
            if tier == HOST:
                loaded = self.device_pool.allocate()
                self._transfers.append(BlockTransfer(HOST, self._host_offset + block, DEVICE, loaded))
                self.moved.loaded += 1
                size = self.block_size
                self.device_pool.cache(
                    loaded, kv._hashes[index], tuple(seq.token_at(p) for p in range(index * size, (index + 1) * size))
                )
                block = loaded
            table.append(block)
        for slot in pinned:
            self.host_cache.release(slot)
        kv._blocks = table
        kv._computed = len(table) * self.block_size
        kv._synced = 0
        kv._tier = DEVICE

    def cache_full_blocks(self, seq: Sequence) -> None:
        """Register the blocks that computation has filled since the last call."""
        if not self.device_pool.enable_caching:
            return
        kv = seq.kv
        # Only positions whose step is done: a step planned ahead may have scheduled the position of a token not
        # sampled yet, and one that fails leaves what it was to compute unwritten.
        num_full = min(kv._computed - seq.flight.computing, seq.num_tokens) // self.block_size
        for index in range(len(kv._hashes), num_full):
            parent = kv._hashes[-1] if kv._hashes else seq.request.cache_root
            chunk = tuple(seq.token_at(p) for p in range(index * self.block_size, (index + 1) * self.block_size))
            block_hash = chain_key(parent, chunk)
            kv._hashes.append(block_hash)
            self.device_pool.cache(kv._blocks[index], block_hash, chunk)
            self.connectors.cached(kv._blocks[index], block_hash, chunk)

    def _chain(self, seq: Sequence, num_blocks: int) -> list[bytes]:
        return [key for _, key, _ in block_keys(seq.request.cache_root, seq.token_ids(), self.block_size, num_blocks)]

    def holds(self, key: bytes) -> bool:
        """Whether a block of this prefix-cache key is cached in any tier."""
        return self.device_pool.holds(key) or self.tiers.holds(key)

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
        return len(self._unique_blocks(request)) <= self.swap_pool.num_available

    def swap_out(self, request: Request) -> None:
        """Move the request's blocks to the swap pool in host memory; its adapter's pages it no longer holds."""
        self.moved.swapped_out += self._move(request, DEVICE, HOST)
        self.release_adapter(request)

    def can_swap_in(self, request: Request) -> bool:
        if not self.adapter_can_start(request):
            return False
        needed = len(self._unique_blocks(request)) + len(request.seqs) + self.adapter_blocks_to_start(request)
        return self.device_pool.num_available - needed >= self.watermark_blocks  # and room to grow

    def swap_in(self, request: Request) -> None:
        """Move the request's blocks back to the device, its adapter's pages first (loaded again if need be)."""
        self.acquire_adapter(request)
        self.moved.swapped_in += self._move(request, HOST, DEVICE)

    # --- LoRA adapters' pages in the device pool -----------------------------------------

    def adapter_problem(self, lora: LoraRef) -> str | None:
        """Why the adapter cannot run here, or None (then `adapter_pages` says what it takes)."""
        if self.adapters is None:
            return "this server serves no LoRA adapters (start it with --enable-lora)"
        return self.adapters.problem(lora)

    def adapter_pages(self, lora: LoraRef) -> int:
        return self.adapters.pages_for(lora) if self.adapters is not None else 0

    def count_request(self, request: Request) -> None:
        if self.adapters is not None:
            self.adapters.count_request(request.lora)

    def adapter_can_start(self, request: Request) -> bool:
        """Whether the request's adapter (if any) has a slot: not every one held by running requests."""
        return self.adapters is None or self.adapters.can_start(request.lora)

    def adapter_blocks_to_start(self, request: Request) -> int:
        return self.adapters.blocks_to_start(request.lora) if self.adapters is not None else 0

    def acquire_adapter(self, request: Request) -> None:
        """The request's adapter's pages, held while it runs (loaded into pages of the pool if need be)."""
        if self.adapters is not None and request.lora is not None:
            self.adapters.acquire(request.request_id, request.lora)

    def release_adapter(self, request: Request) -> None:
        if self.adapters is not None:
            self.adapters.release(request.request_id, request.lora)

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

    # --- what the metrics read ------------------------------------------------------------

    def stats(self) -> dict[str, int]:
        """The pools' and the transfers' counts, by the names of the scheduler's `Stats` fields."""
        device, swap, host, moved, disk = self.device_pool, self.swap_pool, self.host_cache, self.moved, self.disk
        return dict(
            num_gpu_blocks=device.num_blocks,
            num_free_gpu_blocks=device.num_free,
            num_cached_gpu_blocks=device.num_evictable,
            num_cpu_blocks=swap.num_blocks,
            num_free_cpu_blocks=swap.num_available,
            blocks_swapped_out=moved.swapped_out,
            blocks_swapped_in=moved.swapped_in,
            blocks_copied=moved.copied,
            blocks_offloaded=moved.offloaded,
            blocks_loaded=moved.loaded,
            blocks_written_to_disk=moved.written,
            blocks_read_from_disk=moved.read,
            disk_reads_refused=moved.refused,
            num_disk_blocks=len(disk) if disk is not None else 0,
            disk_capacity_blocks=disk.capacity if disk is not None else 0,
            num_host_cache_blocks=host.num_blocks,
            num_cached_host_blocks=host.num_evictable,
            block_size=self.block_size,
            **self.connectors.stats(),
        )

    def lora_stats(self) -> LoraStats | None:
        adapters = self.adapters
        if adapters is None:
            return None
        return LoraStats(
            len(adapters.on_device), adapters.num_pages, adapters.loads, adapters.evictions, dict(adapters.requests)
        )

    def device_use(self) -> float:
        """The share of device blocks in use."""
        return self.device_pool.num_referenced / max(self.device_pool.num_blocks, 1)

    # --- checking ------------------------------------------------------------------------

    def audit(self, handles: Iterable[SequenceKV]) -> None:
        """Raise AssertionError unless every pool's counts add up (services/scheduler/kv_audit.py)."""
        held_pages = self.adapters.held_pages() if self.adapters is not None else {}
        for block, count in self.connectors.held_device_blocks().items():
            held_pages[block] = held_pages.get(block, 0) + count
        audit(handles, self.device_pool, self.swap_pool, self.host_cache, held_pages, self.tiers.reading_slots())
