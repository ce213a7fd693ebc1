"""The one owner of the scheduler's KV state: which physical blocks each sequence holds, in which
tier, how many of its positions are computed, the prefix-cache keys of its full blocks, and how
much of its block table the workers have been told.

Everything else holds a sequence's `SequenceKV` as an opaque handle: it may read it, and changes
it only through this manager's methods (allocate slots, mark computed, take back rejected
proposals, match a prefix, fork, swap, free). Each change of where a block's contents live comes
back as `BlockTransfer`s, which the scheduler sends to the workers with the step.

Blocks are added one at a time as a sequence grows. Forked sequences share every block; the
first write into a shared, partly filled block copies it (copy-on-write). With prefix caching,
each full block is keyed by a hash chained from its parent's (the first from its request's
`cache_salt`), and a new sequence starts from every cached block its prompt matches.
"""

from __future__ import annotations

from collections.abc import Iterable
from collections.abc import Sequence as Blocks
from typing import TYPE_CHECKING

from services.scheduler.block_pool import BlockPool
from shared.prefix_keys import chain_key
from shared.protocol import DEVICE, HOST, BlockTransfer

if TYPE_CHECKING:
    from services.scheduler.request import Request, Sequence


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


class KVCacheManager:
    def __init__(
        self,
        num_gpu_blocks: int,
        block_size: int,
        num_cpu_blocks: int = 0,
        watermark: float = 0.01,
        enable_prefix_caching: bool = False,
    ):
        self.block_size = block_size
        self.gpu = BlockPool(num_gpu_blocks, enable_caching=enable_prefix_caching)
        self.cpu = BlockPool(num_cpu_blocks)
        self.watermark_blocks = int(watermark * num_gpu_blocks)

    @property
    def num_blocks(self) -> int:
        return self.gpu.num_blocks

    @property
    def num_free_blocks(self) -> int:
        return self.gpu.num_available

    @property
    def caching(self) -> bool:
        return self.gpu.enable_caching

    def _pool(self, kv: SequenceKV) -> BlockPool:
        return self.cpu if kv._tier == HOST else self.gpu

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

    def append_slots(self, seq: Sequence, num_new_tokens: int) -> list[BlockTransfer]:
        """Make room for `num_new_tokens`; returns the copy-on-write, if the next write hits a shared block."""
        kv = seq.kv
        copies = []
        if num_new_tokens and self._write_hits_shared_block(kv):
            index = len(kv._blocks) - 1
            shared = kv._blocks[index]
            fresh = self.gpu.allocate()
            self.gpu.release(shared)
            kv._blocks[index] = fresh
            kv._synced = min(kv._synced, index)
            copies.append(BlockTransfer(DEVICE, shared, DEVICE, fresh))
        total = kv._computed + num_new_tokens
        while len(kv._blocks) * self.block_size < total:
            kv._blocks.append(self.gpu.allocate())
        return copies

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

    def match_prefix(self, seq: Sequence) -> list[int]:
        """Cached blocks holding the start of the sequence's tokens (never all of them: the last
        token must be computed to give the next token's logits)."""
        if not self.gpu.enable_caching:
            return []
        tokens = seq.token_ids()
        hits: list[int] = []
        parent = seq.request.cache_root
        for start in range(0, len(tokens) - 1 - self.block_size + 1, self.block_size):
            chunk = tuple(tokens[start : start + self.block_size])
            parent = chain_key(parent, chunk)
            block = self.gpu.lookup(parent, chunk)
            if block is None:
                break
            hits.append(block)
        return hits

    def is_cached_unused(self, block: int) -> bool:
        """Whether a prefix-cache hit revives a block nobody references (so it leaves the available ones)."""
        return self.gpu.is_evictable(block)

    def start(self, seq: Sequence, blocks: list[int]) -> None:
        """Start a sequence on blocks others hold (prefix-cache hits, or a leader's blocks it shares);
        the tokens they hold count as computed."""
        kv = seq.kv
        for block in blocks:
            self.gpu.share(block)
        kv._blocks = list(blocks)
        kv._computed = len(blocks) * self.block_size
        kv._hashes = self._chain(seq, len(blocks))
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

    def _chain(self, seq: Sequence, num_blocks: int) -> list[bytes]:
        hashes, parent, tokens = [], seq.request.cache_root, seq.token_ids()
        for index in range(num_blocks):
            parent = chain_key(parent, tokens[index * self.block_size : (index + 1) * self.block_size])
            hashes.append(parent)
        return hashes

    # --- forking and freeing -------------------------------------------------------------

    def fork(self, parent: Sequence, child: Sequence) -> None:
        """The child shares all of the parent's blocks, and the workers know its table as far as the parent's."""
        source, kv = parent.kv, child.kv
        pool = self._pool(source)
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
        pool = self._pool(kv)
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

    def swap_out(self, request: Request) -> list[BlockTransfer]:
        """Move the request's blocks to host memory."""
        return self._move(request, DEVICE, HOST)

    def can_swap_in(self, request: Request) -> bool:
        needed = len(self._unique_blocks(request)) + len(request.seqs)  # and room to grow
        return self.gpu.num_available - needed >= self.watermark_blocks

    def swap_in(self, request: Request) -> list[BlockTransfer]:
        """Move the request's blocks back to the device."""
        return self._move(request, HOST, DEVICE)

    def _move(self, request: Request, source_tier: int, target_tier: int) -> list[BlockTransfer]:
        source = self.cpu if source_tier == HOST else self.gpu
        target = self.cpu if target_tier == HOST else self.gpu
        mapping: dict[int, int] = {}
        for seq in request.seqs:
            kv = seq.kv
            moved = []
            for block in kv._blocks:
                if block in mapping:
                    target.share(mapping[block])
                else:
                    mapping[block] = target.allocate()
                moved.append(mapping[block])
                source.release(block)
            kv._blocks = moved
            kv._synced = 0
            kv._tier = target_tier
        return [BlockTransfer(source_tier, src, target_tier, dst) for src, dst in mapping.items()]

    # --- checking ------------------------------------------------------------------------

    def audit(self, handles: Iterable[SequenceKV]) -> None:
        """Raise AssertionError unless, in every tier, each block is exactly one of free, referenced or
        cached, and each block's reference count is the number of block tables that hold it."""
        counts: dict[int, dict[int, int]] = {DEVICE: {}, HOST: {}}
        for kv in handles:
            held = counts[kv._tier]
            for block in kv._blocks:
                held[block] = held.get(block, 0) + 1
        for tier, pool in ((DEVICE, self.gpu), (HOST, self.cpu)):
            pool.audit()
            held = counts[tier]
            for block in range(pool.num_blocks):
                if pool.ref_count(block) != held.get(block, 0):
                    raise AssertionError(f"tier {tier}: block {block} is referenced {pool.ref_count(block)} "
                                         f"times, held by {held.get(block, 0)} block tables")
