"""Rebalancing experts while serving (`--enable-eplb`).

Every rank runs every forward step and sees the same rows per expert after it (counted on every
group's rows, or summed over WORLD under all_to_all), so every rank counts the same steps and keeps
the same window of load: after `--eplb-rebalance-num-iterations` steps each computes the same new
placement (`place`, deterministic) with no message of its own. The step boundary is the agreement:
the moves run between one step's sampling and the next step's schedule, on every rank at once.

A move keeps every expert that stays on its rank where it is (`align`), so only experts that arrive
at a rank move: point-to-point over WORLD from a rank holding them (a rank's own slot when it has
one), one layer at a time (extra memory: the arriving experts of one layer), `layers_per_chunk`
layers per step boundary. The slot tables are rewritten in place: captured graphs read them and
need no re-capture.
"""

from __future__ import annotations

import time
from collections import Counter

import torch
import torch.distributed as dist

from dpserve.eplb.placement import Placement, imbalance, place
from dpserve.layers.mlp import MoE
from dpserve.messages import Rebalance


def align(old: list[int], new: list[int], ranks: int) -> list[int]:
    """`new` with each rank's experts reordered so that an expert the rank already holds stays in
    its slot: the same experts per rank, the fewest slots changed."""
    per = len(old) // ranks
    out: list[int] = []
    for lo in range(0, len(old), per):
        want = Counter(new[lo : lo + per])
        row: list[int | None] = []
        for e in old[lo : lo + per]:
            row.append(e if want[e] > 0 else None)
            want[e] -= row[-1] is not None
        rest = sorted(want.elements())
        out += [e if e is not None else rest.pop(0) for e in row]
    return out


def moves(old: list[int], new: list[int], ranks: int) -> list[tuple[int, int]]:
    """(source slot, destination slot) of every slot whose expert changes: the source holds that
    expert under `old`, on the destination's rank when one there does, else its holders in turn."""
    per = len(old) // ranks
    holders: dict[int, list[int]] = {}
    for s, e in enumerate(old):
        holders.setdefault(e, []).append(s)
    turn: Counter[int] = Counter()
    out = []
    for dst, e in enumerate(new):
        if old[dst] == e:
            continue
        local = [s for s in holders[e] if s // per == dst // per]
        if local:
            out.append((local[0], dst))
        else:
            out.append((holders[e][turn[e] % len(holders[e])], dst))
            turn[e] += 1
    return out


def move_layer(moe: MoE, new: list[int], group: dist.ProcessGroup) -> tuple[int, int]:
    """Moves this rank's share of one layer's experts to the placement `new` (every rank calls it
    with the same `new`); returns (slots changed, bytes sent between ranks) over all ranks."""
    old = moe.phy_to_log.tolist()
    per, lo = moe.num_experts, moe.first_expert
    me = lo // per
    tensors = moe.expert_tensors
    plan = moves(old, new, moe.ep_ranks)
    arriving: list[tuple[int, list[torch.Tensor]]] = []
    ops = []
    for src, dst in plan:
        to, frm = dst // per, src // per
        if to == me:
            bufs = [torch.empty_like(t[0]) for t in tensors]
            if frm == me:
                for b, t in zip(bufs, tensors, strict=True):
                    b.copy_(t[src - lo])
            else:
                peer = dist.get_global_rank(group, frm)
                ops += [dist.P2POp(dist.irecv, b, peer, group) for b in bufs]
            arriving.append((dst - lo, bufs))
        elif frm == me:
            peer = dist.get_global_rank(group, to)
            ops += [dist.P2POp(dist.isend, t[src - lo], peer, group) for t in tensors]
    if ops:
        for work in dist.batch_isend_irecv(ops):
            work.wait()
    for local, bufs in arriving:  # after every send: a slot may be another's source
        for t, b in zip(tensors, bufs, strict=True):
            t[local].copy_(b)
    moe.set_placement(new)
    expert_bytes = sum(t[0].numel() * t.element_size() for t in tensors)
    return len(plan), expert_bytes * sum(src // per != dst // per for src, dst in plan)


class Rebalancer:
    """Every rank's: the window of load since the last rebalance and the moves still to do."""

    def __init__(self, moes: list[MoE], every: int, layers_per_chunk: int | None, nodes: int, groups: int):
        self.moes, self.every = moes, every
        self.per_chunk = layers_per_chunk or len(moes)
        self.nodes, self.groups = nodes, groups
        self.ranks = moes[0].ep_ranks
        self.load_window = torch.zeros(
            len(moes), moes[0].gate.shape[0], dtype=torch.long, device=moes[0].gate.device
        )
        self.steps = 0
        self.queue: list[tuple[int, list[int]]] = []  # (MoE layer, its new slots) still to move
        self.started: dict = {}  # the rebalance in progress: its figures so far

    def step(self, load: torch.Tensor) -> Rebalance | None:
        """After each forward step, on every rank, with its rows per logical expert ([layers,
        experts]); moves a chunk of layers when a rebalance is due or under way; returns the
        rebalance its last chunk ended."""
        self.load_window += load
        self.steps += 1
        if not self.queue and self.steps % self.every == 0:
            self._plan()
        if not self.started:
            return None
        start = time.perf_counter()
        chunk, self.queue = self.queue[: self.per_chunk], self.queue[self.per_chunk :]
        group = self.moes[0].world_group
        for layer, row in chunk:
            slots, nbytes = move_layer(self.moes[layer], row, group)
            self.started["slots_moved"] += slots
            self.started["bytes_moved"] += nbytes
        self.started["seconds"] += time.perf_counter() - start
        if self.queue:
            return None
        done, self.started = Rebalance(step=self.steps, **self.started), {}
        return done

    def _plan(self) -> None:
        """The new placement from the window's load (read to the host: once per rebalance)."""
        load = self.load_window.to("cpu", copy=True)  # a copy even on the CPU: the load window is zeroed
        self.load_window.zero_()
        if not load.any():
            return
        moes = self.moes
        old = Placement(torch.stack([m.phy_to_log.cpu() for m in moes]), load.shape[1])
        new = place(load, moes[0].num_slots, self.ranks, self.nodes, self.groups)
        before, after = imbalance(load, old, self.ranks), imbalance(load, new, self.ranks)
        rows = zip(old.phy_to_log.tolist(), new.phy_to_log.tolist(), before, after, strict=True)
        for layer, (o, n, b, a) in enumerate(rows):
            row = align(o, n, self.ranks)
            if row != o and a < b:  # else the layer keeps its experts: moving them would not help
                self.queue.append((layer, row))
            else:
                after[layer] = b
        self.started = {
            "slots_moved": 0,
            "bytes_moved": 0,
            "imbalance_before": float(before.mean()),
            "imbalance_after": float(after.mean()),
            "seconds": 0.0,
        }
