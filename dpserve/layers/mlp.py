"""Dense MLP and MoE, tensor-parallel over WORLD. Both return partial sums (reduced by the caller)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from dpserve.layers.linear import Linear
from dpserve.models.checkpoint import CheckpointReader


class MLP(nn.Module):
    def __init__(self, hidden: int, intermediate_local: int):
        super().__init__()
        self.gate_up_proj = Linear(hidden, 2 * intermediate_local)
        self.down_proj = Linear(intermediate_local, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)

    def load(self, r: CheckpointReader, prefix: str, shard: int, num_shards: int) -> None:
        gate = r.get_shard(f"{prefix}.gate_proj.weight", 0, shard, num_shards)
        up = r.get_shard(f"{prefix}.up_proj.weight", 0, shard, num_shards)
        self.gate_up_proj.weight.data.copy_(torch.cat([gate, up]))
        self.down_proj.weight.data.copy_(r.get_shard(f"{prefix}.down_proj.weight", 1, shard, num_shards))


def select_experts(
    router_logits: torch.Tensor,
    top_k: int,
    method: str,
    scoring: str,
    num_groups: int,
    topk_groups: int,
    correction_bias: torch.Tensor | None,
    norm_topk_prob: bool,
    scaling: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek routing: returns (weights, expert ids), both [rows, top_k]."""
    scores = router_logits.softmax(-1) if scoring == "softmax" else router_logits.sigmoid()
    choice = scores if correction_bias is None else scores + correction_bias
    if method in ("group_limited_greedy", "noaux_tc"):
        grouped = choice.view(choice.shape[0], num_groups, -1)
        if method == "noaux_tc":
            group_scores = grouped.topk(2, dim=-1).values.sum(-1)
        else:
            group_scores = grouped.max(dim=-1).values
        keep = torch.zeros_like(group_scores, dtype=torch.bool)
        keep.scatter_(1, group_scores.topk(topk_groups, dim=-1).indices, True)
        fill = float("-inf") if method == "noaux_tc" else 0.0
        choice = grouped.masked_fill(~keep.unsqueeze(-1), fill).flatten(1)
    elif method != "greedy":
        raise ValueError(f"unsupported topk_method {method!r}")
    ids = choice.topk(top_k, dim=-1).indices
    weights = scores.gather(1, ids)
    if norm_topk_prob and top_k > 1:
        weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
    return weights * scaling, ids


class MoE(nn.Module):
    """Routed experts (each expert's intermediate dim split over WORLD) plus shared experts."""

    def __init__(self, cfg, intermediate_local: int, shared_local: int):
        super().__init__()
        h, e = cfg.hidden_size, cfg.n_routed_experts
        self.top_k = cfg.num_experts_per_tok
        self.topk_method = cfg.topk_method
        self.scoring = cfg.scoring_func
        self.num_groups = cfg.n_group or 1
        self.topk_groups = cfg.topk_group or 1
        self.norm_topk_prob = bool(cfg.norm_topk_prob)
        self.scaling = cfg.routed_scaling_factor
        self.gate = nn.Parameter(torch.empty(e, h, dtype=torch.float32), requires_grad=False)
        self.correction_bias = (
            nn.Parameter(torch.zeros(e, dtype=torch.float32), requires_grad=False)
            if self.topk_method == "noaux_tc"
            else None
        )
        self.w13 = nn.Parameter(torch.empty(e, 2 * intermediate_local, h), requires_grad=False)
        self.w2 = nn.Parameter(torch.empty(e, h, intermediate_local), requires_grad=False)
        self.shared_experts = MLP(h, shared_local) if shared_local else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits = F.linear(x.float(), self.gate)
        weights, ids = select_experts(
            logits,
            self.top_k,
            self.topk_method,
            self.scoring,
            self.num_groups,
            self.topk_groups,
            self.correction_bias,
            self.norm_topk_prob,
            self.scaling,
        )
        out = self.shared_experts(x) if self.shared_experts is not None else torch.zeros_like(x)
        if x.is_cuda:  # fixed shapes, top_k experts' work per row: eager and captured graphs alike
            from dpserve.layers.fused_moe import fused_experts  # Triton, imported where it runs

            return out.add_(fused_experts(x, self.w13, self.w2, weights, ids))
        self.add_experts_loop(out, x, weights, ids)
        return out

    def add_experts_loop(
        self, out: torch.Tensor, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor
    ) -> None:
        """Adds the routed experts' output: each chosen expert on its own rows (the CPU path, and
        the reference of `fused_experts`)."""
        for e in ids.unique().tolist():
            rows, slot = torch.where(ids == e)
            gate, up = F.linear(x[rows], self.w13[e]).chunk(2, dim=-1)
            y = F.linear(F.silu(gate) * up, self.w2[e])
            out.index_add_(0, rows, y * weights[rows, slot, None].to(y.dtype))

    def load(self, r: CheckpointReader, prefix: str, shard: int, num_shards: int) -> None:
        self.gate.data.copy_(r.get(f"{prefix}.gate.weight", torch.float32))
        if self.correction_bias is not None:
            self.correction_bias.data.copy_(r.get(f"{prefix}.gate.e_score_correction_bias", torch.float32))
        for e in range(self.w13.shape[0]):
            ep = f"{prefix}.experts.{e}"
            gate = r.get_shard(f"{ep}.gate_proj.weight", 0, shard, num_shards)
            up = r.get_shard(f"{ep}.up_proj.weight", 0, shard, num_shards)
            self.w13.data[e].copy_(torch.cat([gate, up]))
            self.w2.data[e].copy_(r.get_shard(f"{ep}.down_proj.weight", 1, shard, num_shards))
        if self.shared_experts is not None:
            self.shared_experts.load(r, f"{prefix}.shared_experts", shard, num_shards)
