"""Block tables: which physical blocks each sequence uses, in the GPU pool or the CPU swap pool.

Blocks are added one at a time as a sequence grows. Forked sequences share every block; the
first write into a shared, partly filled block copies it (copy-on-write), and the copy is
reported as a (src, dst) pair for the worker to carry out before the forward pass. With prefix
caching, each full block is keyed by a hash chained from its parent's (the first from its
request's `cache_salt`), and a new sequence starts from every cached block its prompt matches.
"""

from __future__ import annotations

from services.scheduler.block_pool import BlockPool
from services.scheduler.request import Request, Sequence
from shared.prefix_keys import chain_key


class BlockManager:
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

    # --- growing a running sequence ------------------------------------------------------

    def blocks_needed(self, seq: Sequence, num_new_tokens: int) -> int:
        """New blocks for `num_new_tokens` more tokens, a copy-on-write included."""
        if num_new_tokens == 0:
            return 0
        total = seq.num_computed_tokens + num_new_tokens
        needed = -(-total // self.block_size) - len(seq.block_table)
        return max(0, needed) + self._write_hits_shared_block(seq)

    def can_append(self, seqs: list[tuple[Sequence, int]]) -> bool:
        if len(seqs) == 1:  # the common case, on the hot path
            return self.blocks_needed(*seqs[0]) <= self.gpu.num_available
        return sum(self.blocks_needed(seq, n) for seq, n in seqs) <= self.gpu.num_available

    def append_slots(self, seq: Sequence, num_new_tokens: int) -> list[tuple[int, int]]:
        """Make room for `num_new_tokens`; returns the copy-on-write (src, dst) pairs."""
        copies = []
        if num_new_tokens and self._write_hits_shared_block(seq):
            index = len(seq.block_table) - 1
            shared = seq.block_table[index]
            fresh = self.gpu.allocate()
            self.gpu.release(shared)
            seq.block_table[index] = fresh
            seq.first_unsynced_block = min(seq.first_unsynced_block, index)
            copies.append((shared, fresh))
        total = seq.num_computed_tokens + num_new_tokens
        while len(seq.block_table) * self.block_size < total:
            seq.block_table.append(self.gpu.allocate())
        return copies

    def can_reserve(self, num_blocks: int) -> bool:
        return any(length >= num_blocks for _, length in self.gpu.free_runs())

    def reserve(self, seq: Sequence, num_blocks: int) -> None:
        """`num_blocks` blocks at once, with consecutive ids: how a baseline with contiguous KV memory
        holds them."""
        if num_blocks > len(seq.block_table):
            seq.block_table.extend(self.gpu.allocate_run(num_blocks - len(seq.block_table)))

    def fragmented_blocks(self, num_blocks: int) -> int:
        """Free blocks in runs too short for a reservation of `num_blocks`: external fragmentation."""
        return sum(length for _, length in self.gpu.free_runs() if length < num_blocks)

    def _write_hits_shared_block(self, seq: Sequence) -> bool:
        return seq.num_computed_tokens % self.block_size != 0 and self.gpu.ref_count(seq.block_table[-1]) > 1

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

    def start(self, seq: Sequence, hits: list[int]) -> None:
        """Attach the prefix-cache hits; the tokens they hold count as computed."""
        for block in hits:
            self.gpu.share(block)
        seq.block_table = list(hits)
        seq.num_computed_tokens = len(hits) * self.block_size
        seq.block_hashes = self._chain(seq, len(hits))

    def cache_full_blocks(self, seq: Sequence) -> None:
        """Register the blocks that computation has filled since the last call."""
        if not self.gpu.enable_caching:
            return
        # A step planned ahead may have scheduled the position of a token not sampled yet.
        num_full = min(seq.num_computed_tokens, seq.num_tokens) // self.block_size
        for index in range(len(seq.block_hashes), num_full):
            parent = seq.block_hashes[-1] if seq.block_hashes else seq.request.cache_root
            chunk = tuple(seq.token_at(p) for p in range(index * self.block_size, (index + 1) * self.block_size))
            block_hash = chain_key(parent, chunk)
            seq.block_hashes.append(block_hash)
            self.gpu.cache(seq.block_table[index], block_hash, chunk)

    def _chain(self, seq: Sequence, num_blocks: int) -> list[bytes]:
        hashes, parent, tokens = [], seq.request.cache_root, seq.token_ids()
        for index in range(num_blocks):
            parent = chain_key(parent, tokens[index * self.block_size : (index + 1) * self.block_size])
            hashes.append(parent)
        return hashes

    # --- forking and freeing -------------------------------------------------------------

    def fork(self, parent: Sequence, child: Sequence) -> None:
        for block in parent.block_table:
            self.gpu.share(block)
        child.block_table = list(parent.block_table)
        child.block_hashes = list(parent.block_hashes)
        child.num_computed_tokens = parent.num_computed_tokens

    def free(self, seq: Sequence, pool: BlockPool | None = None) -> None:
        pool = pool or self.gpu
        for block in reversed(seq.block_table):
            pool.release(block)
        seq.block_table = []

    # --- swapping whole requests ---------------------------------------------------------

    def _unique_blocks(self, request: Request) -> list[int]:
        return list(dict.fromkeys(b for seq in request.seqs for b in seq.block_table))

    def can_swap_out(self, request: Request) -> bool:
        return len(self._unique_blocks(request)) <= self.cpu.num_available

    def swap_out(self, request: Request) -> list[tuple[int, int]]:
        """Move the request's blocks to the CPU pool; returns (gpu, cpu) pairs to copy."""
        return self._move(request, source=self.gpu, target=self.cpu)

    def can_swap_in(self, request: Request) -> bool:
        needed = len(self._unique_blocks(request)) + len(request.seqs)  # and room to grow
        return self.gpu.num_available - needed >= self.watermark_blocks

    def swap_in(self, request: Request) -> list[tuple[int, int]]:
        """Move the request's blocks back to the GPU pool; returns (cpu, gpu) pairs to copy."""
        return self._move(request, source=self.cpu, target=self.gpu)

    def _move(self, request: Request, source: BlockPool, target: BlockPool) -> list[tuple[int, int]]:
        mapping: dict[int, int] = {}
        for seq in request.seqs:
            moved = []
            for block in seq.block_table:
                if block in mapping:
                    target.share(mapping[block])
                else:
                    mapping[block] = target.allocate()
                moved.append(mapping[block])
                source.release(block)
            seq.block_table = moved
            seq.first_unsynced_block = 0
        return list(mapping.items())
