"""The rows of a step whose final hidden states it reads: the sampled ones and those its pooled prompt chunks pool.
A model that `keeps_rows` computes its last layer's output for those rows alone (every row's keys and values are
still written); the step then finds each row it reads at its place among them."""

from __future__ import annotations

from collections.abc import Sequence

import torch


def rows_read(logit_rows: list[int], pooled: Sequence[range | None], total: int) -> list[int] | None:
    """The rows read, in order, or None where that is every one of the step's `total` rows (or a pooled chunk, None,
    reads all of its own)."""
    if any(rows is None for rows in pooled):
        return None
    read = sorted(set(logit_rows).union(*pooled))  # type: ignore[arg-type]
    return read if len(read) < total else None


def read_tensor(
    read: list[int], logit_rows: list[int], logit_tensor: torch.Tensor, device: torch.device
) -> torch.Tensor:
    """The rows read, on the device: the step's own tensor of its logit rows where those are all it reads."""
    return logit_tensor if read == logit_rows else torch.tensor(read, device=device)


def hidden_rows(
    hidden: torch.Tensor, read: list[int] | None, rows: Sequence[int], rows_tensor: torch.Tensor | None = None
) -> torch.Tensor:
    """`rows` of a step's final hidden states, which hold every row (`read` None) or `read`'s alone; `rows_tensor`,
    the same rows on the device where the step has them."""
    if read is None:
        if isinstance(rows, range):
            return hidden[rows.start : rows.stop]
        return hidden[rows_tensor if rows_tensor is not None else list(rows)]
    if read == list(rows):
        return hidden
    at = {row: k for k, row in enumerate(read)}
    return hidden[[at[row] for row in rows]]
