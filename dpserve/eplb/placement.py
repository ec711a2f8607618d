"""Expert placement from recorded load (expert-parallel load balancing, EPLB): which logical expert
each physical expert slot holds, so that with `--ep-size tp` every rank gets about the same rows.

The approach is the one DeepSeek published with their EPLB, written here from its description:

1. *Replicate*: a layer has `num_slots` physical slots for its `E` logical experts; every expert
   gets one, and each spare slot goes in turn to the expert whose load per replica is the highest
   (its rows are then split evenly between its replicas).
2. *Pack*: the slots are dealt to the ranks, `num_slots / ranks` each, heaviest replica first, each
   to the rank with the least load so far that still has room (balanced packing).
3. *Hierarchically* with several nodes, when the model groups its experts (DeepSeek-V3's
   `n_group`, which node-limited routing keeps a token within) and the groups divide over the
   nodes: first the groups are packed onto nodes by their load, then replication and packing
   happen inside each node over its experts, so a row's copies stay within the node its group
   landed on. Otherwise one global pass (as DeepSeek's global policy).

Ties go to the lowest index, so every rank computes the same placement from the same load.
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Placement:
    """Per MoE layer: the logical expert of each physical slot (slot s lives on rank
    s // (num_slots / ranks))."""

    phy_to_log: torch.Tensor  # [layers, num_slots], long
    num_experts: int

    @property
    def replicas(self) -> torch.Tensor:
        """[layers, experts]: each expert's slot count."""
        return torch.stack([torch.bincount(row, minlength=self.num_experts) for row in self.phy_to_log])


def identity(layers: int, experts: int) -> Placement:
    """The placement without EPLB: expert e in slot e, each rank a contiguous block of experts."""
    return Placement(torch.arange(experts).expand(layers, experts).clone(), experts)


def replicate(load: list[float], num_slots: int) -> list[int]:
    """Replicas per expert: one each, then every spare slot to the highest load per replica."""
    if num_slots < len(load):
        raise ValueError(f"{num_slots} slots cannot hold {len(load)} experts")
    count = [1] * len(load)
    for _ in range(num_slots - len(load)):
        e = max(range(len(load)), key=lambda i: (load[i] / count[i], -i))
        count[e] += 1
    return count


def pack(weights: list[float], bins: int) -> list[int]:
    """The bin of each item, `len(weights) / bins` items per bin: heaviest first, each to the lightest
    bin that still has room."""
    if len(weights) % bins:
        raise ValueError(f"{len(weights)} items cannot be split evenly over {bins} bins")
    room = len(weights) // bins
    totals, sizes, out = [0.0] * bins, [0] * bins, [0] * len(weights)
    for i in sorted(range(len(weights)), key=lambda i: (-weights[i], i)):
        b = min((b for b in range(bins) if sizes[b] < room), key=lambda b: (totals[b], b))
        out[i], totals[b], sizes[b] = b, totals[b] + weights[i], sizes[b] + 1
    return out


def _place_layer(load: list[float], experts: list[int], num_slots: int, ranks: int) -> list[int]:
    """The slots of `experts` (a node's, or all) over `ranks` ranks: the expert of each slot, the
    slots of rank r at [r * num_slots / ranks, (r + 1) * num_slots / ranks)."""
    count = replicate([load[e] for e in experts], num_slots)
    replicas = [(e, load[e] / c) for e, c in zip(experts, count, strict=True) for _ in range(c)]
    bins = pack([w for _, w in replicas], ranks)
    per_rank = num_slots // ranks
    # Within a rank, slots in logical order (a stable layout: an unchanged rank keeps its weights).
    slots: list[list[int]] = [
        sorted(e for (e, _), b in zip(replicas, bins, strict=True) if b == r) for r in range(ranks)
    ]
    assert all(len(s) == per_rank for s in slots)
    return [e for s in slots for e in s]


def place(load: torch.Tensor, num_slots: int, ranks: int, nodes: int = 1, groups: int = 1) -> Placement:
    """The placement of every layer of `load` ([layers, experts]: rows each expert took) over
    `num_slots` slots on `ranks` expert-parallel ranks spread over `nodes` nodes; `groups`: the
    model's expert groups (1: none)."""
    layers, experts = load.shape
    if num_slots % ranks or ranks % nodes:
        raise ValueError(
            f"{num_slots} expert slots over {ranks} ranks on {nodes} node(s) do not split evenly: the slots "
            f"(experts + redundant ones) must be a multiple of the ranks, the ranks of the nodes"
        )
    if num_slots < experts:
        raise ValueError(f"{num_slots} slots cannot hold the {experts} experts")
    hierarchical = nodes > 1 and groups > 1 and groups % nodes == 0 and experts % groups == 0
    phy = torch.empty(layers, num_slots, dtype=torch.long)
    for layer in range(layers):
        w = [float(x) for x in load[layer]]
        if not hierarchical:
            phy[layer] = torch.tensor(_place_layer(w, list(range(experts)), num_slots, ranks))
            continue
        size = experts // groups
        group_load = [sum(w[g * size : (g + 1) * size]) for g in range(groups)]
        node_of = pack(group_load, nodes)
        per_node = num_slots // nodes
        for n in range(nodes):
            mine = [e for g in range(groups) if node_of[g] == n for e in range(g * size, (g + 1) * size)]
            lo = n * per_node
            phy[layer, lo : lo + per_node] = torch.tensor(_place_layer(w, mine, per_node, ranks // nodes))
    return Placement(phy, experts)


def imbalance(load: torch.Tensor, placement: Placement, ranks: int) -> torch.Tensor:
    """Per layer, the busiest rank's rows over the mean rank's when each expert's rows are split
    evenly between its replicas ([layers], float; 1.0: balanced)."""
    per_replica = load.double() / placement.replicas.double()
    slot_load = per_replica.gather(1, placement.phy_to_log)
    per_rank = slot_load.view(load.shape[0], ranks, -1).sum(2)
    return per_rank.max(1).values / per_rank.mean(1).clamp_min(1e-12)


def read_load(path: str) -> torch.Tensor:
    """[layers, experts]: the rows of every line of a load file (bench.one_batch's --expert-load) summed."""
    total = None
    with open(path) as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                rows = torch.tensor(json.loads(line)["rows_per_expert"], dtype=torch.long)
            except (ValueError, KeyError, TypeError) as e:
                raise ValueError(f"{path}:{n}: not a line of rows_per_expert ({e})") from None
            if total is not None and rows.shape != total.shape:
                raise ValueError(
                    f"{path}:{n}: {list(rows.shape)} layers x experts, earlier lines {list(total.shape)}"
                )
            total = rows if total is None else total + rows
    if total is None or total.dim() != 2:
        raise ValueError(f"{path}: no expert load in it")
    return total


@functools.cache
def start_placement(
    path: str | None, layers: int, experts: int, slots: int, ranks: int, nodes: int, groups: int, mtp: int = 0
) -> Placement:
    """The placement an engine starts with (once per process): from `path` (--init-expert-location:
    a recorded load, or a placement python -m dpserve.eplb wrote), else from an even load. A file
    may carry `mtp` more rows (an MTP layer's, recorded by an engine running NEXTN). Raises
    ValueError naming what does not fit this engine."""
    with torch.device("cpu"):  # host tables, whatever device the model is being built on
        return _start_placement(path, layers, experts, slots, ranks, nodes, groups, mtp)


def _start_placement(
    path: str | None, layers: int, experts: int, slots: int, ranks: int, nodes: int, groups: int, mtp: int
) -> Placement:
    rows = {layers, layers + mtp}
    extra = f" (+ {mtp} for its MTP layer)" if mtp else ""
    model = f"{layers} MoE layers{extra}"
    if path is None:
        return place(torch.ones(layers, experts), slots, ranks, nodes, groups)
    try:
        with open(path) as f:
            saved = json.loads(f.read())
    except ValueError:  # several lines: a load file
        saved = None
    except OSError as e:
        raise ValueError(f"init_expert_location {path}: {e.strerror}") from None
    if isinstance(saved, dict) and "phy_to_log" in saved:
        phy = torch.tensor(saved["phy_to_log"], dtype=torch.long)
        want = {"num_experts": experts, "num_slots": slots, "ep_size": ranks}
        got = {k: saved.get(k) for k in want}
        fits = phy.dim() == 2 and phy.shape[0] in rows and phy.shape[1] == slots
        if got != want or not fits or not ((phy >= 0) & (phy < experts)).all():
            raise ValueError(
                f"init_expert_location {path} places {got['num_experts']} experts in {got['num_slots']} slots "
                f"over {got['ep_size']} ranks for {phy.shape[0]} MoE layers; this engine has {experts} experts, "
                f"{slots} slots over {ranks} ranks and {model}"
            )
        placement = Placement(phy, experts)
        if not (placement.replicas > 0).all():
            raise ValueError(f"init_expert_location {path} leaves an expert without a slot")
        return placement
    load = read_load(path)
    if load.shape[0] not in rows or load.shape[1] != experts:
        raise ValueError(
            f"init_expert_location {path} records {load.shape[0]} MoE layers x {load.shape[1]} experts; this "
            f"model has {layers} x {experts}{extra}"
        )
    return place(load, slots, ranks, nodes, groups)
