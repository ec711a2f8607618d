"""Bytes each rank sends in one forward, collective by collective as the engine's code issues them
(docs/design.md, section 3), counted as the engine counts them (`distributed.ring_bytes`; an
all-to-all: the rows leaving the rank). The planner's collective times are made of these, and a
started engine's `StepRecord.comm_bytes` equals them (tests/test_ep.py).

Per decoder layer, by where its MLP runs (T ranks over all, A per DP group, H hidden, e dtype bytes):

- on every group's rows (dense MLP split over WORLD, TP MoE, EP `none`): sum_len all-reduces the
  S + 1 row buffer over WORLD and the S rows of partial sums back; max_len reduce-scatters M rows
  inside ATTN_TP and all-gathers them over WORLD, then the mirror image. TP MoE and EP `none` move
  the same bytes: whole experts change where the expert work runs, not what travels.
- on each rank's own rows (replicated dense MLP, EP `all_to_all`): a reduce-scatter and an all-gather
  of the group's rows inside ATTN_TP (nothing when A = 1), and for all_to_all the dispatch: padded
  steps send a fixed capacity of m * min(top_k, experts per rank) rows to each other rank, their
  expert ids (int64) and the results back; unpadded steps first the counts, then the (row, expert)
  pairs routed to other ranks, their ids, and the results of the pairs other ranks sent here. Those
  depend on the routing: the planner takes a uniform routing ((T - 1) / T of the pairs leave).

LM head: vocabulary-parallel over WORLD, an all-gather (uneven all-to-all: each rank sends its 1/A
of its group's rows) of every group's rows to sample and an all-to-all of the logit shards back to
their groups, in the model's dtype; with --enable-dp-lm-head an all-gather of the shards inside
ATTN_TP only.
"""

from __future__ import annotations

from dataclasses import dataclass

from dpserve.distributed import ring_bytes
from dpserve.layers.dp_comm import near_equal_part
from dpserve.layers.mlp import MoE
from dpserve.step.records import StepLayout, round_up

ID_BYTES = 8  # int64 expert ids and counts of the all_to_all dispatch


@dataclass(frozen=True)
class Collective:
    kind: str  # all_reduce, reduce_scatter, all_gather, all_to_all
    group: str  # "world" (every rank) or "attn" (the DP group's ATTN_TP ranks)
    sent: int  # bytes this rank sends
    # "layers" (gather/scatter around each MLP), "counts" and "dispatch" (all_to_all), "lm_head"
    part: str


def forward_collectives(
    model, layout: StepLayout, dispatched: tuple[int, int] | None = None
) -> list[Collective]:
    """The collectives one rank of DP group `layout.dp_rank` joins in a forward of `model` (the
    engine's model, meta device will do). `dispatched`: (pairs this rank sends to other ranks, pairs
    it receives from them) in each all_to_all layer of an unpadded step; None: a uniform routing."""
    topo = model.groups.topo
    t, a = topo.tp_size, topo.attn_tp_size
    hidden = model.cfg.hidden_size
    e = model.lm_head.element_size()
    row = hidden * e
    out: list[Collective] = []

    def add(kind: str, group: str, nbytes: int, part: str = "layers") -> None:
        n = t if group == "world" else a
        sent = nbytes if kind == "all_to_all" else ring_bytes(kind, nbytes, n)
        if n > 1:
            out.append(Collective(kind, group, sent, part))

    for layer in model.layers:
        mlp = layer.mlp
        if not mlp.on_own_rows:
            if layout.padding_mode == "sum_len":
                rows = layout.mlp_rows
                add("all_reduce", "world", (rows + 1) * row)
                add("all_reduce", "world", rows * row)
            else:
                m = layout.padded_len
                add("reduce_scatter", "attn", m * row)
                add("all_gather", "world", t // a * m * row)
                add("reduce_scatter", "world", t // a * m * row)
                add("all_gather", "attn", m * row)
            continue
        group_rows = round_up(layout.local_rows, a)
        add("reduce_scatter", "attn", group_rows * row)
        if isinstance(mlp, MoE):
            m = group_rows // a  # this rank's own rows
            if layout.padded:
                out_pairs = in_pairs = (t - 1) * m * min(mlp.top_k, mlp.num_experts)  # capacity slots
            else:
                add("all_to_all", "world", (t - 1) * ID_BYTES, "counts")
                pairs = m * mlp.top_k * (t - 1) // t
                out_pairs, in_pairs = dispatched or (pairs, pairs)
            add("all_to_all", "world", out_pairs * row, "dispatch")
            add("all_to_all", "world", out_pairs * ID_BYTES, "dispatch")
            add("all_to_all", "world", in_pairs * row, "dispatch")
        add("all_gather", "attn", group_rows * row)
    shard = model.lm_head.shape[0] * e  # logits of one row's vocabulary shard, in the model's dtype
    own = layout.logit_rows[layout.dp_rank]
    if model.dp_lm_head:
        add("all_gather", "attn", a * own * shard, "lm_head")
    else:
        # Each rank sends its 1/A of its group's rows to every other rank, then the logit shards back.
        mine = near_equal_part(own, a, topo.attn_tp_rank)
        add("all_to_all", "world", (t - 1) * mine * row, "lm_head")
        add("all_to_all", "world", (a * sum(layout.logit_rows) - own) * shard, "lm_head")
    return out


def logged_layout(step, dp_rank: int, attn_tp_size: int) -> StepLayout:
    """The layout of a logged step (a `StepRecord`) as group `dp_rank` ran it."""
    bucket = None
    if step.padded:  # sum_len's bucket is the gathered rows; max_len's the rows of each group
        bucket = step.mlp_rows if step.padding_mode == "sum_len" else step.mlp_rows // len(step.tokens)
    return StepLayout(step.padding_mode, step.tokens, step.logit_rows, dp_rank, attn_tp_size, bucket)


def forward_bytes(model, layout: StepLayout, dispatched: tuple[int, int] | None = None) -> int:
    """Bytes one rank of group `layout.dp_rank` sends in a forward (what StepRecord.comm_bytes counts)."""
    return sum(c.sent for c in forward_collectives(model, layout, dispatched))
