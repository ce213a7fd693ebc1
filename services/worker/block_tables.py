"""Every live sequence's block table as one row of a persistent device tensor.

A step changes a row only where its entries add or replace blocks, so a decode step writes almost
nothing, and its writes reach the table together, in one copy (`StepInputs`); the step's padded
tables and its slot mapping are then gathered with a few tensor ops instead of being rebuilt from
Python lists.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kernels.batch import PagedBatch
from services.worker.step_inputs import StepInputs


@dataclass(slots=True)
class StepTensors:
    """A forward pass's inputs on the device."""

    input_ids: torch.Tensor
    positions: torch.Tensor
    batch: PagedBatch
    logit_rows: torch.Tensor  # the rows of the pass's hidden states whose logits are wanted


class BlockTables:
    def __init__(self, device: torch.device, rows: int = 64, columns: int = 16):
        self.device = device
        self.table = torch.zeros(rows, columns, dtype=torch.int32, device=device)
        self.free_rows = list(range(rows - 1, -1, -1))
        self.staging = StepInputs(device)
        self.pending_rows: list[int] = []
        self.pending_columns: list[int] = []
        self.pending_ids: list[int] = []

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
        self.pending_rows, self.pending_columns, self.pending_ids = [], [], []

    def write(self, row: int, start: int, block_ids: list[int]) -> None:
        """Staged: the step's writes reach the table together, in `flush`."""
        if not block_ids:
            return
        end = start + len(block_ids)
        columns = self.table.shape[1]
        if end > columns:
            self.flush()  # the staged writes go to the table they were staged for
            wider = torch.zeros(self.table.shape[0], max(end, 2 * columns), dtype=torch.int32, device=self.device)
            wider[:, :columns] = self.table
            self.table = wider
        self.pending_rows.extend([row] * len(block_ids))
        self.pending_columns.extend(range(start, end))
        self.pending_ids.extend(block_ids)

    def flush(self) -> None:
        """Every staged write, in one copy to the device and one indexed store."""
        if self.pending_ids:
            rows, columns, ids = self.staging.load(self.pending_rows, self.pending_columns, self.pending_ids)
            self.table[rows, columns] = ids.to(torch.int32)
            self.pending_rows, self.pending_columns, self.pending_ids = [], [], []

    def copy_row(self, source: int, target: int) -> None:
        self.flush()
        self.table[target] = self.table[source]

    def gather(self, rows: torch.Tensor, width: int) -> torch.Tensor:
        """The step's block tables, `[len(rows), width]`; columns past a sequence's blocks hold stale ids."""
        self.flush()
        return self.table[rows, :width]

    def slot_mapping(self, token_rows: torch.Tensor, positions: torch.Tensor, block_size: int) -> torch.Tensor:
        self.flush()
        blocks = self.table[token_rows, positions // block_size].long()
        return blocks * block_size + positions % block_size

    def batch(
        self,
        rows: torch.Tensor,
        token_rows: torch.Tensor,
        positions: torch.Tensor,
        query_start: torch.Tensor,
        context_lens: torch.Tensor,
        starts: list[int],
        lens: list[int],
        block_size: int,
    ) -> PagedBatch:
        """The kernels' view of a flattened step: sequence `s` (row `rows[s]`) owns the tokens
        `starts[s]:starts[s + 1]` (each token's row in `token_rows`) at `positions`, and sees
        `lens[s]` positions; the tensors on the device, the two lists on the host."""
        return PagedBatch(
            slot_mapping=self.slot_mapping(token_rows, positions, block_size),
            block_tables=self.gather(rows, -(-max(lens) // block_size)),
            query_start_loc=query_start.to(torch.int32),
            context_lens=context_lens.to(torch.int32),
            query_start_list=starts,
            context_lens_list=lens,
        )

    def step(
        self,
        inputs: StepInputs,
        token_ids: list[int],
        positions: list[int],
        rows: list[int],
        starts: list[int],
        context_lens: list[int],
        logit_rows: list[int],
        block_size: int,
    ) -> StepTensors:
        """A forward pass's inputs, from one load of `inputs`: sequence `s` (row `rows[s]`) owns the
        tokens `starts[s]:starts[s + 1]`, at `positions`, and sees `context_lens[s]` positions."""
        token_rows = [row for s, row in enumerate(rows) for _ in range(starts[s + 1] - starts[s])]
        loaded = inputs.load(token_ids, positions, rows, token_rows, starts, context_lens, logit_rows)
        ids, position_tensor, row_tensor, token_row_tensor, start_tensor, len_tensor, logit_tensor = loaded
        batch = self.batch(
            row_tensor, token_row_tensor, position_tensor, start_tensor, len_tensor, starts, context_lens, block_size
        )
        return StepTensors(ids, position_tensor, batch, logit_tensor)
