"""The worker's persistent block tables give the same tables and slots as building them from lists."""

import torch

from services.worker.block_tables import BlockTables


def test_rows_grow_and_give_each_sequence_its_own_table_and_slots():
    tables = BlockTables(torch.device("cpu"), rows=2, columns=2)
    lists = {}
    for seq in range(5):  # more sequences than rows, more blocks than columns
        row = tables.claim()
        lists[row] = [10 * seq + b for b in range(seq + 1)]
        tables.write(row, 0, lists[row])
    rows = sorted(lists)
    width = max(len(t) for t in lists.values())
    gathered = tables.gather(torch.tensor(rows), width)
    for i, row in enumerate(rows):
        assert gathered[i, : len(lists[row])].tolist() == lists[row]
    row, positions = rows[-1], torch.arange(0, 5 * 4)
    slots = tables.slot_mapping(torch.full((20,), row), positions, block_size=4)
    assert slots.tolist() == [lists[row][p // 4] * 4 + p % 4 for p in range(20)]


def test_a_write_replaces_the_tail_and_a_fork_copies_the_row():
    tables = BlockTables(torch.device("cpu"))
    parent = tables.claim()
    tables.write(parent, 0, [3, 4, 5])
    child = tables.claim()
    tables.copy_row(parent, child)
    tables.write(child, 2, [9])  # copy-on-write of the last block
    assert tables.gather(torch.tensor([parent, child]), 3).tolist() == [[3, 4, 5], [3, 4, 9]]
    tables.release(child)
    assert tables.claim() == child
