"""A step's inputs reach the device in one copy from one host buffer (pinned on a GPU), the
request-to-slot table writes included."""

from __future__ import annotations

import torch
from conftest import CountOps

from dpserve.models.batch import ForwardBatch
from dpserve.step.records import StepLayout


def test_one_host_buffer_per_step():
    table = torch.zeros(4, 16, dtype=torch.int32)
    layout = StepLayout("sum_len", (5, 2), (2, 1), 0, 1)
    # Two requests: a 3-token chunk after 2 cached tokens (row 1), one decode token at position 6 (row 2).
    writes = ([1, 1, 1, 2], [2, 3, 4, 6], [11, 12, 13, 9])
    with CountOps() as ops:
        batch = ForwardBatch.build(
            layout,
            table,
            [7, 8, 9, 4],
            [2, 3, 4, 6],
            [11, 12, 13, 9],
            [1, 2],
            [3, 1],
            [5, 7],
            [2, 3],
            table_writes=writes,
        )
    assert ops.calls["lift_fresh"] == 1, ops.calls  # one tensor made from host lists
    assert batch.input_ids.tolist() == [7, 8, 9, 4] and batch.positions.tolist() == [2, 3, 4, 6]
    assert batch.out_slots.tolist() == [11, 12, 13, 9] and batch.logit_idx.tolist() == [2, 3]
    assert batch.attn.table_rows.tolist() == [1, 2] and batch.attn.table_rows.dtype == torch.int32
    assert batch.attn.seq_lens.tolist() == [5, 7] and batch.attn.q_start.tolist() == [0, 3, 4]
    assert table[1, 2:5].tolist() == [11, 12, 13] and table[2, 6].item() == 9 and table.sum().item() == 45
