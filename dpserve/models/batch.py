"""What one rank feeds the model in one step."""

from __future__ import annotations

from dataclasses import dataclass
from itertools import accumulate

import torch

from dpserve.attention.backend import AttentionMetadata
from dpserve.step.records import PENDING_TOKEN, BatchReq, GroupBatch, StepLayout


@dataclass
class ForwardBatch:
    # A padded step appends padded rows after the n_g real ones: each a one-token request
    # on the all-zero table row 0, token 0 at position 0 written to the reserved pool slot 0,
    # never sampled.
    input_ids: torch.Tensor  # [n_g] this group's new tokens
    positions: torch.Tensor  # [n_g]
    out_slots: torch.Tensor  # [n_g] KV pool slots the new tokens are written to
    attn: AttentionMetadata
    logit_idx: torch.Tensor  # indices into the n_g tokens whose next token is sampled
    layout: StepLayout
    row_index: torch.Tensor  # sum_len: [local rows] row of the gathered buffer of each local row
    moe_rows: torch.Tensor  # 1 for each real row the MoE sees, 0 for padding (StepLayout.real_rows)
    # The hybrid sliding-window pool: the window layers' own slots (kvcache/window.py), read through
    # a request-to-slot table of their own; None when every layer keeps every token.
    window_attn: AttentionMetadata | None = None
    out_window_slots: torch.Tensor | None = None  # [n_g]
    logit_table_rows: torch.Tensor | None = None  # the request-table row of each row in `logit_idx`

    @classmethod
    def build(
        cls,
        layout: StepLayout,
        req_to_token: torch.Tensor,
        input_ids: list[int],
        positions: list[int],
        out_slots: list[int],
        table_rows: list[int],
        q_lens: list[int],
        seq_lens: list[int],
        logit_idx: list[int],
        own_rank: int | None = None,
        table_writes: tuple[list[int], list[int], list[int]] | None = None,
        window_inputs: tuple[torch.Tensor, list[int], tuple[list[int], list[int], list[int]]] | None = None,
        logit_table_rows: list[int] | None = None,
        pending: tuple[list[int], list[int], torch.Tensor] | None = None,
    ) -> ForwardBatch:
        """The batch of `layout.local_rows` rows (padding included) from per-token and per-request
        lists (`table_rows`, `q_lens`, `seq_lens`: one entry per attention request); `own_rank`: the
        attention TP rank, when the MoE runs on each rank's own rows; `table_writes`: (rows,
        columns, slots) entries of the request-to-slot table this step writes; `window_inputs`: the hybrid
        sliding-window pool's table, out slots and table writes, alike; `logit_table_rows`: the
        table row of each logit row; `pending`: (rows of `input_ids`, table rows, tokens by table
        row) for tokens not read back yet. Every list reaches the device in one copy (`stage`)."""
        dev = req_to_token.device
        lists = {
            "input_ids": input_ids,
            "positions": positions,
            "out_slots": out_slots,
            "table_rows": table_rows,
            "seq_lens": seq_lens,
            "q_start": [0, *accumulate(q_lens)],
            "logit_idx": logit_idx,
            "group_tokens": list(layout.tokens),
        }
        if table_writes is not None:
            lists.update(zip(("rows", "cols", "slots"), table_writes, strict=True))
        if logit_table_rows is not None:
            lists["logit_table_rows"] = logit_table_rows
        if pending is not None:
            lists["pending_at"], lists["pending_rows"] = pending[:2]
        if window_inputs is not None:
            lists["out_window_slots"] = window_inputs[1]
            lists.update(zip(("window_rows", "window_cols", "window_slots"), window_inputs[2], strict=True))
        t = stage(lists, dev)
        if table_writes is not None and table_writes[0]:
            req_to_token[t["rows"], t["cols"]] = t["slots"].int()
        attn = AttentionMetadata(
            req_to_token=req_to_token,
            table_rows=t["table_rows"].int(),
            seq_lens=t["seq_lens"].int(),
            q_start=t["q_start"].int(),
            num_tokens=layout.local_rows,
            max_q_len=max(q_lens, default=0),
            max_seq_len=max(seq_lens, default=0),
            q_lens_host=list(q_lens),
            seq_lens_host=list(seq_lens),
        )
        if pending is not None:
            t["input_ids"][t["pending_at"]] = pending[2][t["pending_rows"]]
        window_attn = None
        if window_inputs is not None:
            table = window_inputs[0]
            if window_inputs[2][0]:
                table[t["window_rows"], t["window_cols"]] = t["window_slots"].int()
            window_attn = attn.on_table(table)
        return cls(
            t["input_ids"],
            t["positions"],
            t["out_slots"],
            attn,
            t["logit_idx"],
            layout,
            layout.row_index(dev),
            layout.real_rows(dev, own_rank, t["group_tokens"]),
            window_attn,
            t.get("out_window_slots"),
            t.get("logit_table_rows"),
        )


def group_inputs(
    batch: GroupBatch,
    layout: StepLayout,
    req_to_token: torch.Tensor,
    pending: torch.Tensor,
    own_rank: int | None = None,
    req_to_window: torch.Tensor | None = None,
    write_table: bool = True,
) -> ForwardBatch:
    """The one builder of a forward's inputs from a group's batch, for the target model's steps and
    NEXTN's MTP forwards alike (a padded layout: the shapes of a captured graph). Host work is
    proportional to the new tokens, not to the contexts. A request whose first token is
    `PENDING_TOKEN` takes it from `pending[table_row]`, on the device (a token not read back yet);
    `req_to_window`: the hybrid sliding-window pool's table; `write_table`: False when the table
    already holds the batch's slots (NEXTN's draft extend over the positions the step wrote)."""
    reqs = batch.reqs
    rows, cols, slots = [], [], []  # request-to-slot table entries written this step
    for r in reqs if write_table else ():
        rows += [r.table_row] * (len(r.prefix) + len(r.slots))
        cols += range(r.start - len(r.prefix), r.seq_len)
        slots += r.prefix + r.slots
    positions = [p for r in reqs for p in range(r.start, r.seq_len)]
    # Rows to return logits for: a request's last, or every one of a verify step's.
    ends = list(accumulate(len(r.tokens) for r in reqs))
    logit_idx = [i for r, end in zip(reqs, ends, strict=True) for i in range(end - r.logit_rows, end)]
    # Padded rows: token 0 at position 0, each a one-token request on row 0, writing slot 0.
    pad = layout.local_rows - batch.num_tokens
    if layout.padded:
        # A padded step has a decode graph's shapes: one query row per token. A verify step's token
        # at position p attends to the p + 1 keys up to its own, its drafts included (all of them are
        # in the pool before attention reads it): causal attention, row by row.
        table_rows = [r.table_row for r in reqs for _ in r.tokens]
        q_lens, seq_lens = [1] * len(positions), [p + 1 for p in positions]
    else:
        table_rows, q_lens, seq_lens = (
            [r.table_row for r in reqs],
            [len(r.tokens) for r in reqs],
            [r.seq_len for r in reqs],
        )
    waiting = [
        (end - len(r.tokens), r.table_row)
        for r, end in zip(reqs, ends, strict=True)
        if r.tokens and r.tokens[0] == PENDING_TOKEN
    ]
    return ForwardBatch.build(
        layout,
        req_to_token,
        [t for r in reqs for t in r.tokens] + [0] * pad,
        positions + [0] * pad,
        [s for r in reqs for s in r.slots] + [0] * pad,
        table_rows + [0] * pad,
        q_lens + [1] * pad,
        seq_lens + [1] * pad,
        logit_idx,
        own_rank,
        table_writes=(rows, cols, slots),
        window_inputs=None if req_to_window is None else _window_inputs(req_to_window, reqs, pad),
        logit_table_rows=[r.table_row for r in reqs for _ in range(r.logit_rows)],
        pending=([i for i, _ in waiting], [row for _, row in waiting], pending) if waiting else None,
    )


def _window_inputs(req_to_window: torch.Tensor, reqs: list[BatchReq], pad: int) -> tuple:
    """The hybrid pool's table, the new tokens' window slots, and the table entries to write."""
    rows, cols, slots = [], [], []
    for r in reqs:
        rows += [r.table_row] * len(r.window_slots)
        cols += range(r.seq_len - len(r.window_slots), r.seq_len)
        slots += r.window_slots
    out = [s for r in reqs for s in r.window_slots[len(r.window_slots) - len(r.tokens) :]] + [0] * pad
    return req_to_window, out, (rows, cols, slots)


def stage(
    ints: dict[str, list[int]], device: torch.device, floats: dict[str, list[float]] | None = None
) -> dict[str, torch.Tensor]:
    """Host lists as tensors on `device` (int64, and float64 for `floats`): views of one buffer built
    on the host (pinned when the device is a GPU) and copied once without blocking the host
    (pageable copies would block, each). Floats travel as their bit patterns: a view, not a cast."""
    floats, pin = floats or {}, device.type == "cuda"
    host = torch.tensor(
        [x for v in ints.values() for x in v], dtype=torch.long, pin_memory=pin and not floats
    )
    if floats:
        real = torch.tensor([x for v in floats.values() for x in v], dtype=torch.float64).view(torch.long)
        buffer = torch.empty(len(host) + len(real), dtype=torch.long, pin_memory=pin)
        host = torch.cat([host, real], out=buffer)
    parts = host.to(device, non_blocking=True).split([len(v) for v in (*ints.values(), *floats.values())])
    out = dict(zip(ints, parts, strict=False))
    out.update((k, t.view(torch.float64)) for k, t in zip(floats, parts[len(ints) :], strict=True))
    return out
