"""The GPU block pool: which physical KV blocks are free, and each sequence's block table.

Blocks are handed out one at a time as a sequence grows, so a sequence never holds more than
one partly filled block, and all of them return to the pool when it ends or is preempted.
"""

from __future__ import annotations

from services.scheduler.sequence import Sequence


class OutOfBlocks(RuntimeError):
    pass


class BlockAllocator:
    """A pool of physical block ids with reference counts."""

    def __init__(self, num_blocks: int):
        self.num_blocks = num_blocks
        self._free: list[int] = list(range(num_blocks - 1, -1, -1))  # pop() hands out 0 first
        self._ref_counts = [0] * num_blocks

    @property
    def num_free(self) -> int:
        return len(self._free)

    def allocate(self) -> int:
        if not self._free:
            raise OutOfBlocks("no free GPU block")
        block = self._free.pop()
        self._ref_counts[block] = 1
        return block

    def release(self, block: int) -> None:
        count = self._ref_counts[block]
        if count <= 0:
            raise ValueError(f"block {block} is already free")
        self._ref_counts[block] = count - 1
        if count == 1:
            self._free.append(block)

    def ref_count(self, block: int) -> int:
        return self._ref_counts[block]


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, watermark: float = 0.01):
        self.block_size = block_size
        self.allocator = BlockAllocator(num_blocks)
        self.watermark_blocks = int(watermark * num_blocks)

    @property
    def num_free_blocks(self) -> int:
        return self.allocator.num_free

    @property
    def num_blocks(self) -> int:
        return self.allocator.num_blocks

    def blocks_needed(self, seq: Sequence, num_new_tokens: int) -> int:
        total = seq.num_computed_tokens + num_new_tokens
        return max(0, -(-total // self.block_size) - len(seq.block_table))

    def can_allocate(self, seq: Sequence, num_new_tokens: int) -> bool:
        """Whether a waiting sequence may start, leaving the watermark free for running ones."""
        needed = self.blocks_needed(seq, num_new_tokens)
        return needed <= self.num_blocks and self.num_free_blocks - needed >= self.watermark_blocks

    def can_append(self, seq: Sequence, num_new_tokens: int) -> bool:
        return self.blocks_needed(seq, num_new_tokens) <= self.num_free_blocks

    def append_slots(self, seq: Sequence, num_new_tokens: int) -> list[int]:
        """Grow the block table to hold `num_new_tokens` more tokens; returns the new block ids."""
        new_blocks = [self.allocator.allocate() for _ in range(self.blocks_needed(seq, num_new_tokens))]
        seq.block_table.extend(new_blocks)
        return new_blocks

    def free(self, seq: Sequence) -> None:
        for block in reversed(seq.block_table):
            self.allocator.release(block)
        seq.block_table.clear()
