"""The rows of a step whose final hidden states it reads (services/worker/rows_read.py): a model that keeps rows
computes its last layer's output for those alone, and each reader finds its rows among them."""

from types import SimpleNamespace

import pytest
import torch

from services.worker.pooling import Pooler
from services.worker.rows_read import hidden_rows, rows_read
from shared.protocol import PoolingSpec, ScheduledSequence


def test_the_rows_read_are_the_sampled_and_the_pooled_in_order_or_none_where_all_are():
    assert rows_read([3, 7], [range(9, 10), range(0)], 12) == [3, 7, 9]
    assert rows_read([], [range(0)], 12) == []  # a chunk that reads nothing yet
    assert rows_read([3], [None], 12) is None  # a mean pools every row of its chunk
    assert rows_read(list(range(4)), [], 4) is None  # a decode step reads every row


def test_each_reader_finds_its_rows_where_the_kept_rows_put_them():
    every = torch.arange(12.0)[:, None].expand(12, 3)
    kept = every[[3, 7, 9]]
    assert torch.equal(hidden_rows(kept, [3, 7, 9], [9, 3]), every[[9, 3]])
    assert torch.equal(hidden_rows(every, None, range(4, 6)), every[4:6])
    assert hidden_rows(kept, [3, 7, 9], [3, 7, 9]) is kept


@pytest.mark.parametrize(
    "pooling, start, num_tokens, read",
    [
        ("LAST", 0, 5, range(14, 15)),  # the whole prompt: its last row
        ("LAST", 0, 3, range(0)),  # a first chunk of it: nothing yet
        ("CLS", 0, 3, range(10, 11)),  # the first chunk: its first row
        ("CLS", 3, 2, range(0)),
        ("MEAN", 3, 2, None),  # every row of every chunk
    ],
)
def test_a_pooled_chunk_reads_the_rows_its_pooling_needs(pooling, start, num_tokens, read):
    pooler = Pooler(PoolingSpec(pooling, True, 8), None)
    mirror = SimpleNamespace(token_ids=list(range(5)))
    entry = ScheduledSequence(0, start, num_tokens, [], 0, [])
    assert pooler.rows_read(mirror, entry, first_row=10) == read
