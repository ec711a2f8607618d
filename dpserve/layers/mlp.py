"""Dense MLP and MoE. Split over WORLD (tensor-parallel, or expert-parallel on gathered rows) they
return partial sums the caller reduces; `on_own_rows` ones (replicated dense MLPs, MoE with
all_to_all dispatch) return each rank's own rows finished."""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed import ProcessGroup

from dpserve import cpu_ops
from dpserve.cpu_ops import onednn_packs, pack, packed_linear
from dpserve.layers.ep_dispatch import dispatch_combine
from dpserve.layers.linear import Linear
from dpserve.layers.quant import add_weight, building_spec, quantized_linear, quantized_weight
from dpserve.layers.specs import MoESpec
from dpserve.memory import moe_chunk_rows
from dpserve.step.records import StepLayout


class MLP(nn.Module):
    def __init__(self, hidden: int, intermediate_local: int, replicated: bool = False):
        super().__init__()
        self.replicated = replicated  # the whole intermediate dimension on every rank
        self.gate_up_proj = Linear(hidden, 2 * intermediate_local)
        self.down_proj = Linear(intermediate_local, hidden)

    @property
    def on_own_rows(self) -> bool:
        """Runs on each rank's own rows (no gather of every group's rows over WORLD)."""
        return self.replicated

    def forward(
        self, x: torch.Tensor, layout: StepLayout | None = None, real_rows: torch.Tensor | None = None
    ) -> torch.Tensor:
        return self.down_proj(silu_and_mul(self.gate_up_proj(x)))


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up of [..., gate | up]: one fused kernel on the CPU."""
    if cpu_ops.usable(gate_up):
        return torch.ops.dpserve_cpu.silu_and_mul(gate_up)
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def select_experts(
    router_logits: torch.Tensor, spec: MoESpec, correction_bias: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """The routing `spec` declares: returns (weights, expert ids), both [rows, top_k]."""
    if spec.scoring == "topk_softmax":  # gpt-oss: the k best logits, softmax over those k
        values, ids = router_logits.topk(spec.top_k, dim=-1)
        return values.softmax(-1) * spec.scaling, ids
    scores = router_logits.softmax(-1) if spec.scoring == "softmax" else router_logits.sigmoid()
    choice = scores if correction_bias is None else scores + correction_bias
    method = spec.topk_method
    if method in ("group_limited_greedy", "noaux_tc"):
        grouped = choice.view(choice.shape[0], spec.num_groups, choice.shape[1] // spec.num_groups)
        if method == "noaux_tc":
            group_scores = grouped.topk(2, dim=-1).values.sum(-1)
        else:
            group_scores = grouped.max(dim=-1).values
        keep = torch.zeros_like(group_scores, dtype=torch.bool)
        keep.scatter_(1, group_scores.topk(spec.topk_groups, dim=-1).indices, True)
        fill = float("-inf") if method == "noaux_tc" else 0.0
        choice = grouped.masked_fill(~keep.unsqueeze(-1), fill).flatten(1)
    elif method != "greedy":
        raise ValueError(f"unsupported topk_method {method!r}")
    ids = choice.topk(spec.top_k, dim=-1).indices
    weights = scores.gather(1, ids)
    if spec.norm_topk_prob:
        weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
    return weights * spec.scaling, ids


class MoE(nn.Module):
    """Routed experts plus shared experts. Tensor-parallel: every expert, its intermediate dimension
    split over WORLD. Expert-parallel (`experts`: (first, count) of this rank's slots): whole experts,
    the rows routed elsewhere contribute nothing here (the reduce over WORLD adds the other ranks').
    With a `placement` (the logical expert of every slot, redundant ones included: EPLB) a row's
    choice of expert e goes to one of e's replicas, in turn by row and choice: every rank computes
    the same slot for the same gathered row, and no value is read back."""

    def __init__(
        self,
        spec: MoESpec,
        hidden: int,
        intermediate_local: int,
        shared_local: int,
        experts: tuple[int, int] | None = None,
        a2a: bool = False,
        world_group: ProcessGroup | None = None,
        placement: torch.Tensor | None = None,
        movable: bool = False,
    ):
        super().__init__()
        h, e = hidden, spec.num_experts
        self.spec = spec
        self.first_expert, self.num_experts = experts or (0, e)
        self.top_k = spec.top_k
        self.gate = nn.Parameter(torch.empty(e, h, dtype=torch.float32), requires_grad=False)
        self.correction_bias = (
            nn.Parameter(torch.zeros(e, dtype=torch.float32), requires_grad=False)
            if spec.correction_bias
            else None
        )
        n = self.num_experts
        # Slots: one per expert, or the placement's (each slot's expert; a replica's slots in turn).
        experts_of = list(range(e)) if placement is None else placement.tolist()
        self.num_slots = len(experts_of)
        self.slot_experts = experts_of[self.first_expert : self.first_expert + n]
        self.phy_to_log = self.replicas = self.replica_slots = None
        # Live rebalancing (--enable-eplb) rewrites the tables in place (captured graphs read them):
        # wide enough for any placement, an expert holding every spare slot.
        self.movable = movable
        if placement is not None:  # made where the gate is (the model is built on its device)
            replicas, padded = replica_tables(experts_of, e, self.num_slots - e + 1 if movable else 1)
            device = self.gate.device
            self.phy_to_log = torch.tensor(experts_of, device=device)
            self.replicas = torch.tensor(replicas, device=device)
            self.replica_slots = torch.tensor(padded, device=device)  # [experts, most replicas]
        self.router_bias = (
            nn.Parameter(torch.zeros(e, dtype=torch.float32), requires_grad=False)
            if spec.router_bias
            else None
        )
        # 8-bit under a quantized build (`dpserve.layers.quant`): w13_scale, w2_scale beside them.
        add_weight(self, "w13", (n, 2 * intermediate_local, h), building_spec())
        add_weight(self, "w2", (n, h, intermediate_local), building_spec())
        # Expert biases (gpt-oss). Split over WORLD, each rank holds its part of b13 and only rank 0
        # the down projection's bias (zeros elsewhere), so the summed partials add it once.
        self.b13, self.b2 = (
            (
                nn.Parameter(torch.zeros(n, 2 * intermediate_local), requires_grad=False),
                nn.Parameter(torch.zeros(n, h), requires_grad=False),
            )
            if spec.expert_bias
            else (None, None)
        )
        if spec.activation == "swiglu_clamped":
            self.act = functools.partial(swiglu_clamped, alpha=spec.swiglu_alpha, limit=spec.swiglu_limit)
        else:
            self.act = silu_and_mul
        self.intermediate_local = intermediate_local
        # Each expert's w13 and w2 in oneDNN's layout (pack_for_cpu), replacing the two tensors.
        self.packed: tuple[list[torch.Tensor], list[torch.Tensor]] | None = None
        # all_to_all dispatch over WORLD: every rank keeps its own rows, and runs the shared experts
        # on them whole rather than gathering rows for a split (no collective for them at all).
        self.a2a, self.world_group = a2a, world_group
        # Rows routed to each slot (all slots) since the runner last took it: this rank's rows (own
        # rows) or every group's (gathered). A plain tensor: not a weight the planner counts.
        self.load = torch.zeros(self.num_slots, dtype=torch.long)
        self.shared_experts = MLP(h, shared_local, replicated=a2a) if shared_local else None

    @property
    def ep_ranks(self) -> int:
        """The ranks the layer's slots are spread over (1: every expert split over the tp ranks)."""
        return self.num_slots // self.num_experts

    @property
    def on_own_rows(self) -> bool:
        return self.a2a

    def forward(
        self, x: torch.Tensor, layout: StepLayout | None = None, real_rows: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Rows of every group (TP MoE, EP gathering rows) or this rank's own (all_to_all; a padded
        `layout` takes the fixed-capacity dispatch); `real_rows` (1 real, 0 padding) counts the
        real rows' choices into `load`."""
        out = self.shared_experts(x) if self.shared_experts is not None else torch.zeros_like(x)
        if self.a2a:
            world = self.ep_ranks
            padded = layout is not None and layout.padded
            weights, ids = self._route(x, real_rows)
            routed = dispatch_combine(
                x, weights, ids, self.num_experts, world, self.world_group, self._unweighted, padded
            )
            return out.add_(routed)
        # Every group's rows (dp x the step's tokens): router and experts a bounded chunk at a time.
        step = moe_chunk_rows(
            x.shape[1], self.intermediate_local, self.top_k, self.gate.shape[0], x.element_size()
        )
        for lo in range(0, x.shape[0], step):
            rows = slice(lo, lo + step)
            weights, ids = self._route(x[rows], None if real_rows is None else real_rows[rows], lo)
            # Experts of other ranks (expert-parallel) fall outside [0, num_experts): skipped.
            out[rows] += self._routed(x[rows], weights, ids - self.first_expert)
        return out

    def _route(
        self, x: torch.Tensor, real_rows: torch.Tensor | None, first_row: int = 0
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(weights, slot ids) of each row, from float32 router logits (`first_row`: the first row's
        index in the step's rows); counts real rows' choices per slot."""
        logits = F.linear(x.float(), self.gate, self.router_bias)
        weights, ids = select_experts(logits, self.spec, self.correction_bias)
        if self.replica_slots is not None:  # choice j of row i: replica (i * top_k + j) mod replicas
            turn = torch.arange(
                first_row * self.top_k, first_row * self.top_k + ids.numel(), device=ids.device
            )
            ids = self.replica_slots[ids, turn.view_as(ids) % self.replicas[ids]]
        if real_rows is not None:
            self.load.index_add_(0, ids.flatten(), real_rows.repeat_interleave(self.top_k))
        return weights, ids

    def _routed(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """This rank's experts' weighted sum per row (`ids`: local expert indices)."""
        if self.packed is not None:
            return experts_loop(x, *self.packed, weights, ids, packed_linear, self.act, self.b13, self.b2)
        quantized = self.w13_scale is not None  # 8-bit: each weight with its scales
        w13 = quantized_weight(self, "w13") if quantized else self.w13
        w2 = quantized_weight(self, "w2") if quantized else self.w2
        if x.is_cuda:  # fixed shapes, top_k experts' work per row: eager and captured graphs alike
            from dpserve.layers.fused_moe import fused_experts  # Triton, imported where it runs

            spec = self.spec
            clamp = (spec.swiglu_alpha, spec.swiglu_limit) if spec.activation == "swiglu_clamped" else None
            return fused_experts(x, w13, w2, weights, ids, b13=self.b13, b2=self.b2, clamp=clamp)
        linear = quantized_linear if quantized else F.linear
        return experts_loop(x, w13, w2, weights, ids, linear, self.act, self.b13, self.b2)

    def pack_for_cpu(self) -> bool:
        """Reorders every local expert's weights once for oneDNN and frees the stacked tensors, as
        `Linear.pack_for_cpu` does (F.linear would reorder them at every call); the same bits. False
        where not packed: another device or dtype, or no native bfloat16."""
        if self.w13 is None or self.movable or not onednn_packs(self.w13.dtype, self.w13.device.type):
            return False
        self.packed = ([pack(w) for w in self.w13], [pack(w) for w in self.w2])
        self.w13 = self.w2 = None  # their storage goes: the packed copies replace them
        return True

    @property
    def expert_tensors(self) -> list[torch.Tensor]:
        """What a slot holds of its expert, each [local slots, ...]: what rebalancing moves."""
        return [
            t for t in (self.w13, self.w2, self.w13_scale, self.w2_scale, self.b13, self.b2) if t is not None
        ]

    def set_placement(self, experts_of: list[int]) -> None:
        """Each slot's expert from now on (its weights already moved there), the tables in place."""
        replicas, padded = replica_tables(experts_of, self.gate.shape[0], self.replica_slots.shape[1])
        self.phy_to_log.copy_(torch.tensor(experts_of))
        self.replicas.copy_(torch.tensor(replicas))
        self.replica_slots.copy_(torch.tensor(padded))
        self.slot_experts = experts_of[self.first_expert : self.first_expert + self.num_experts]

    def _unweighted(self, x: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """Each row through its one local expert (-1: none, zero output), as a dispatch delivers them."""
        return self._routed(x, torch.ones_like(ids, dtype=torch.float32)[:, None], ids[:, None])


def replica_tables(experts_of: list[int], experts: int, width: int) -> tuple[list[int], list[list[int]]]:
    """Each expert's replica count and its slots in slot order, padded to at least `width` with its
    first slot (a table lookup per row and choice picks one)."""
    slots: list[list[int]] = [[] for _ in range(experts)]
    for s, x in enumerate(experts_of):
        slots[x].append(s)
    width = max(width, *map(len, slots))
    return [len(s) for s in slots], [s + [s[0]] * (width - len(s)) for s in slots]


def experts_loop(
    x: torch.Tensor,
    w13: Sequence[torch.Tensor],
    w2: Sequence[torch.Tensor],
    weights: torch.Tensor,
    ids: torch.Tensor,
    linear: Callable[..., torch.Tensor] = F.linear,
    act: Callable[[torch.Tensor], torch.Tensor] = silu_and_mul,
    b13: torch.Tensor | None = None,
    b2: torch.Tensor | None = None,
) -> torch.Tensor:
    """The routed experts' weighted sum per row, each chosen expert on its own rows (ids outside
    [0, experts) skipped): the CPU path, and the reference of the fused kernels. `w13`, `w2`: per
    expert, stacked or packed for `linear(x, w, bias)`; `act` of [gate | up]; biases per expert."""
    out = torch.zeros_like(x)
    for e in ids.unique().tolist():
        if not 0 <= e < len(w13):
            continue
        rows, slot = torch.where(ids == e)
        h = act(linear(x[rows], w13[e], None if b13 is None else b13[e]))
        y = linear(h, w2[e], None if b2 is None else b2[e])
        out.index_add_(0, rows, y * weights[rows, slot, None].to(y.dtype))
    return out


def swiglu_clamped(gate_up: torch.Tensor, alpha: float, limit: float) -> torch.Tensor:
    """gpt-oss's activation of [..., gate | up]: gate clamped above and up on both sides at `limit`,
    then (up + 1) * gate * sigmoid(alpha * gate)."""
    gate, up = gate_up.chunk(2, dim=-1)
    gate = gate.clamp(max=limit)
    return (up.clamp(-limit, limit) + 1) * gate * torch.sigmoid(gate * alpha)
