"""Process topology (docs/design.md, section 2) and the collectives the model uses.

rank r:  dp_rank = r // A,  attn_tp_rank = r % A,  A = tp / dp
groups:  WORLD (MoE/MLP/LM head), ATTN_TP per DP group, and gloo CPU groups for metadata.

The model's collectives count the bytes this rank sends (`SENT`), from the shapes alone (no device
sync), as ring algorithms move them (`ring_bytes`); all-to-all counts the rows that leave the rank.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

# torch 2.13 renamed the tensor-in/tensor-out collectives; older releases have only the old names.
_all_gather_single = getattr(dist, "all_gather_single", dist.all_gather_into_tensor)
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", dist.reduce_scatter_tensor)


def ring_bytes(kind: str, nbytes: int, world: int) -> int:
    """Bytes one rank sends in a ring collective over `world` ranks: all_reduce of an `nbytes` tensor
    2 (world - 1) / world of it, reduce_scatter (nbytes: its input) and all_gather (nbytes: its output)
    (world - 1) / world. The planner predicts with the same function."""
    if world <= 1:
        return 0
    return (2 if kind == "all_reduce" else 1) * (world - 1) * nbytes // world


@dataclass
class SentBytes:
    """Bytes this process has sent in the collectives below since it started (the step metadata of
    `all_gather_ints` and `broadcast_object` excepted); a step's share is the difference around it.
    A CUDA graph's replay adds what its capture counted."""

    total: int = 0


SENT = SentBytes()


@dataclass(frozen=True)
class Topology:
    tp_size: int
    dp_size: int
    rank: int

    @property
    def attn_tp_size(self) -> int:
        return self.tp_size // self.dp_size

    @property
    def dp_rank(self) -> int:
        return self.rank // self.attn_tp_size

    @property
    def attn_tp_rank(self) -> int:
        return self.rank % self.attn_tp_size

    @property
    def is_group_leader(self) -> bool:
        return self.attn_tp_rank == 0

    def group_ranks(self, dp_rank: int) -> list[int]:
        a = self.attn_tp_size
        return list(range(dp_rank * a, (dp_rank + 1) * a))


@dataclass
class Groups:
    """Process groups of one rank. `None` stands for a group of size one (no communication)."""

    topo: Topology
    world: dist.ProcessGroup | None
    attn_tp: dist.ProcessGroup | None
    world_cpu: dist.ProcessGroup | None
    attn_tp_cpu: dist.ProcessGroup | None


def init_groups(topo: Topology, device: str, init_addr: str, timeout_s: float) -> Groups:
    """Joins the job and builds every process group; all ranks must call this together. A
    collective waits up to `timeout_s` for its peers."""
    if topo.tp_size == 1:
        return Groups(topo, None, None, None, None)
    backend = "nccl" if device == "cuda" else "gloo"
    timeout = timedelta(seconds=timeout_s)
    dist.init_process_group(
        backend, init_method=f"tcp://{init_addr}", rank=topo.rank, world_size=topo.tp_size, timeout=timeout
    )
    world = dist.group.WORLD
    world_cpu = world if backend == "gloo" else dist.new_group(backend="gloo", timeout=timeout)
    attn_tp = attn_tp_cpu = None
    for g in range(topo.dp_size):
        # Every rank must take part in creating every group, in the same order.
        ranks = topo.group_ranks(g)
        pg = dist.new_group(ranks, backend=backend, timeout=timeout)
        pg_cpu = pg if backend == "gloo" else dist.new_group(ranks, backend="gloo", timeout=timeout)
        if g == topo.dp_rank:
            attn_tp, attn_tp_cpu = pg, pg_cpu
    if topo.attn_tp_size == 1:
        attn_tp = attn_tp_cpu = None
    return Groups(topo, world, attn_tp, world_cpu, attn_tp_cpu)


def all_reduce(x: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    if group is not None:
        SENT.total += ring_bytes("all_reduce", x.nbytes, dist.get_world_size(group))
        dist.all_reduce(x, group=group)
    return x


def all_gather(x: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    """Concatenates every rank's `x` along dim 0, in rank order."""
    if group is None:
        return x
    out = _all_gather(x, group)
    SENT.total += ring_bytes("all_gather", out.nbytes, dist.get_world_size(group))
    return out


def _all_gather(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    out = x.new_empty((x.shape[0] * dist.get_world_size(group), *x.shape[1:]))
    _all_gather_single(out, x.contiguous(), group=group)
    return out


def reduce_scatter(x: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    """Sums `x` over the group and returns this rank's equal slice of dim 0."""
    if group is None:
        return x
    world = dist.get_world_size(group)
    SENT.total += ring_bytes("reduce_scatter", x.nbytes, world)
    out = x.new_empty((x.shape[0] // world, *x.shape[1:]))
    _reduce_scatter_single(out, x.contiguous(), group=group)
    return out


def all_to_all(
    x: torch.Tensor, in_splits: list[int], out_splits: list[int], group: dist.ProcessGroup | None
) -> torch.Tensor:
    """Sends rows of `x` (in_splits[j] of them, in order) to each rank j; returns the rows received,
    out_splits[i] from each rank i, in rank order."""
    if group is None:
        return x
    leaving = sum(in_splits) - in_splits[dist.get_rank(group)]
    SENT.total += leaving * (x.nbytes // max(x.shape[0], 1))
    out = x.new_empty((sum(out_splits), *x.shape[1:]))
    dist.all_to_all_single(out, x.contiguous(), out_splits, in_splits, group=group)
    return out


def broadcast(x: torch.Tensor, src: int, group: dist.ProcessGroup | None) -> torch.Tensor:
    """`x` of global rank `src` on every rank of `group` (in place; not counted in `SENT`: step data,
    not the forward's)."""
    if group is not None:
        dist.broadcast(x, src=src, group=group)
    return x


def broadcast_object(obj: object, src: int, group: dist.ProcessGroup | None) -> object:
    """Sends a picklable object from global rank `src` to every rank of `group`."""
    if group is None:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=src, group=group)
    return box[0]


def all_gather_ints(values: list[int], group: dist.ProcessGroup | None) -> torch.Tensor:
    """All-gathers a short int vector over a CPU group: returns [world, len(values)]."""
    t = torch.tensor(values, dtype=torch.int64).unsqueeze(0)
    return t if group is None else _all_gather(t, group)
