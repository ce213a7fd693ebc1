"""Every live sequence's block table as one row of a persistent device tensor.

A step changes a row only where its entries add or replace blocks, so a decode step writes almost
nothing; the step's padded tables and its slot mapping are then gathered with a few tensor ops
instead of being rebuilt from Python lists.
"""

from __future__ import annotations

import torch

from kernels.batch import PagedBatch


class BlockTables:
    def __init__(self, device: torch.device, rows: int = 64, columns: int = 16):
        self.device = device
        self.table = torch.zeros(rows, columns, dtype=torch.int32, device=device)
        self.free_rows = list(range(rows - 1, -1, -1))

    def claim(self) -> int:
        if not self.free_rows:
            rows = self.table.shape[0]
            self.table = torch.cat([self.table, torch.zeros_like(self.table)])
            self.free_rows = list(range(2 * rows - 1, rows - 1, -1))
        return self.free_rows.pop()

    def release(self, row: int) -> None:
        self.free_rows.append(row)

    def reset(self) -> None:
        self.free_rows = list(range(self.table.shape[0] - 1, -1, -1))

    def write(self, row: int, start: int, block_ids: list[int]) -> None:
        if not block_ids:
            return
        end = start + len(block_ids)
        columns = self.table.shape[1]
        if end > columns:
            wider = torch.zeros(self.table.shape[0], max(end, 2 * columns), dtype=torch.int32, device=self.device)
            wider[:, :columns] = self.table
            self.table = wider
        self.table[row, start:end] = torch.tensor(block_ids, dtype=torch.int32, device=self.device)

    def copy_row(self, source: int, target: int) -> None:
        self.table[target] = self.table[source]

    def gather(self, rows: torch.Tensor, width: int) -> torch.Tensor:
        """The step's block tables, `[len(rows), width]`; columns past a sequence's blocks hold stale ids."""
        return self.table[rows, :width]

    def slot_mapping(self, token_rows: torch.Tensor, positions: torch.Tensor, block_size: int) -> torch.Tensor:
        blocks = self.table[token_rows, positions // block_size].long()
        return blocks * block_size + positions % block_size

    def batch(self, rows: list[int], positions: torch.Tensor, starts: list[int], context_lens: list[int],
              block_size: int) -> PagedBatch:
        """The kernels' view of a flattened step: sequence `s` (row `rows[s]`) owns the tokens
        `starts[s]:starts[s + 1]` at `positions`, and sees `context_lens[s]` positions."""
        device = self.device
        row_index = torch.tensor(rows, dtype=torch.int64, device=device)
        query_lens = torch.tensor([b - a for a, b in zip(starts, starts[1:])], dtype=torch.int64, device=device)
        return PagedBatch(
            slot_mapping=self.slot_mapping(row_index.repeat_interleave(query_lens), positions, block_size),
            block_tables=self.gather(row_index, -(-max(context_lens) // block_size)),
            query_start_loc=torch.tensor(starts, dtype=torch.int32, device=device),
            context_lens=torch.tensor(context_lens, dtype=torch.int32, device=device),
            query_start_list=starts,
            context_lens_list=context_lens,
        )
