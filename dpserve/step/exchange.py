"""The per-step exchange every rank takes part in (CPU groups, before the forward).

`share` hands the group leader's batch to every rank of its DP group; `exchange` all-gathers one
record per group over the instance, so that every rank then derives the same step layout.
The main step and NEXTN's draft forwards both go through these two calls.
"""

from __future__ import annotations

from typing import TypeVar

from dpserve.distributed import Groups, all_gather_ints, broadcast_object
from dpserve.step.records import IntRecord

T = TypeVar("T")
R = TypeVar("R", bound=IntRecord)


def share(obj: T, groups: Groups) -> T:
    """The group leader's `obj` on every rank of its DP group (the others pass anything)."""
    topo = groups.topo
    return broadcast_object(obj, topo.dp_rank * topo.attn_tp_size, groups.attn_tp_cpu)


def exchange(local: R, groups: Groups) -> list[R]:
    """Every DP group's record, in DP-rank order, from one all-gather of ints; all ranks must call it."""
    rows = all_gather_ints(local.to_ints(), groups.world_cpu)[:: groups.topo.attn_tp_size].tolist()
    return [type(local).from_ints(r) for r in rows]
