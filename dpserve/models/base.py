"""The decoder stack shared by every model: embedding, layers, final norm, LM head; and the weight
tables of the parts every model shares (norms, dense MLPs, MoE)."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from dpserve.attention.backend import AttentionBackend
from dpserve.config import EngineConfig
from dpserve.distributed import Groups, Topology, all_gather
from dpserve.kvcache.pool import KVPool
from dpserve.layers.dp_comm import DPComm
from dpserve.layers.mlp import MLP, MoE
from dpserve.layers.norm import RMSNorm
from dpserve.models.batch import ForwardBatch
from dpserve.models.config import ModelConfig
from dpserve.models.loader import Weight
from dpserve.models.mtp import MTPLayer
from dpserve.step.records import StepLayout


class DecoderLayer(nn.Module):
    """Attention on local rows, DP gather, MLP/MoE on global rows, DP scatter."""

    def __init__(self, cfg: ModelConfig, attn: nn.Module, mlp: MLP | MoE, comm: DPComm):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = attn
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = mlp
        self.comm = comm

    def forward(self, hidden: torch.Tensor, batch: ForwardBatch, pool: KVPool) -> torch.Tensor:
        attn_partial = self.self_attn(self.input_layernorm(hidden), batch, pool)
        if self.mlp.on_own_rows:  # replicated dense MLP, or MoE with all_to_all dispatch
            rows, residual = self.comm.own_rows(attn_partial, hidden, batch.layout)
            out = self.mlp(self.post_attention_layernorm(rows), batch.layout, batch.moe_rows) + residual
            return self.comm.from_own_rows(out, batch.layout)
        global_rows, residual = self.comm.gather(attn_partial, hidden, batch.layout, batch.row_index)
        mlp_partial = self.mlp(self.post_attention_layernorm(global_rows), batch.layout, batch.moe_rows)
        return self.comm.scatter(mlp_partial, residual, batch.layout, batch.row_index)

    def weights(self, prefix: str, topo: Topology) -> list[Weight]:
        mlp = self.mlp
        mlp_table = moe_weights if isinstance(mlp, MoE) else mlp_weights
        return [
            Weight(f"{prefix}.input_layernorm.weight", self.input_layernorm.weight),
            Weight(f"{prefix}.post_attention_layernorm.weight", self.post_attention_layernorm.weight),
            *self.self_attn.weights(f"{prefix}.self_attn"),
            *mlp_table(mlp, f"{prefix}.mlp", topo),
        ]


def build_mlp(cfg: ModelConfig, groups: Groups, options: EngineConfig, index: int) -> MLP | MoE:
    """Layer `index`'s MLP: dense (split over the tp ranks, or replicated with moe_dense_tp_size 1)
    or MoE (each expert split over the tp ranks, or whole experts per rank with ep_size tp)."""
    spec, t, h = cfg.moe, groups.topo.tp_size, cfg.hidden_size
    if spec is None or not spec.is_moe_layer(index):
        if options.moe_dense_tp_size == 1:
            return MLP(h, cfg.hf.intermediate_size, replicated=True)
        return MLP(h, cfg.hf.intermediate_size // t)
    # Beside all_to_all dispatch each rank keeps only its own rows: shared experts run there whole.
    a2a = options.moe_a2a_backend == "all_to_all"
    shared = spec.shared_intermediate_size
    shared_local = shared if a2a else shared // t
    if options.ep_size == 1:
        return MoE(spec, h, spec.intermediate_size // t, shared_local)
    slots = spec.num_experts + options.ep_num_redundant_experts
    per_rank = slots // options.ep_size
    experts = (groups.topo.rank * per_rank, per_rank)
    placement = None
    movable = options.enable_eplb
    if (
        options.ep_num_redundant_experts or options.init_expert_location or movable
    ):  # slots apart from experts
        table = cfg.expert_placement(options)
        ordinal = sum(spec.is_moe_layer(i) for i in range(index))  # an MTP layer's: the last layer's row
        placement = table.phy_to_log[min(ordinal, len(table.phy_to_log) - 1)]
    return MoE(spec, h, spec.intermediate_size, shared_local, experts, a2a, groups.world, placement, movable)


def mlp_weights(mlp: MLP, prefix: str, topo: Topology) -> list[Weight]:
    """A dense MLP split over WORLD (gate and up by rows, fused; down by columns), or replicated
    when it holds the whole intermediate dimension (moe_dense_tp_size 1, shared experts beside
    all_to_all dispatch)."""
    gate, up = mlp.gate_up_proj.weight.chunk(2)
    down = mlp.down_proj.weight
    rows, cols = ((None, 0), (None, 0)) if mlp.replicated else ((0, topo.rank), (1, topo.rank))
    return [
        Weight(f"{prefix}.gate_proj.weight", gate, *rows),
        Weight(f"{prefix}.up_proj.weight", up, *rows),
        Weight(f"{prefix}.down_proj.weight", down, *cols),
    ]


def moe_weights(moe: MoE, prefix: str, topo: Topology) -> list[Weight]:
    """The router (replicated, float32); the routed experts, each split over WORLD as a dense MLP is
    (TP MoE) or this rank's own whole (EP: only they are read); the shared experts."""
    whole = moe.num_experts < moe.gate.shape[0]  # expert-parallel
    if moe.spec.checkpoint == "fused":
        return fused_expert_weights(moe, prefix, topo, whole)
    out = [Weight(f"{prefix}.gate.weight", moe.gate)]
    if moe.correction_bias is not None:
        out.append(Weight(f"{prefix}.gate.e_score_correction_bias", moe.correction_bias))
    for local, expert in enumerate(moe.slot_experts):
        gate, up = moe.w13[local].chunk(2)
        name = f"{prefix}.experts.{expert}"
        part = (None, 0) if whole else (0, topo.rank)
        out += [
            Weight(f"{name}.gate_proj.weight", gate, *part),
            Weight(f"{name}.up_proj.weight", up, *part),
            Weight(f"{name}.down_proj.weight", moe.w2[local], *(None, 0) if whole else (1, topo.rank)),
        ]
    if moe.shared_experts is not None:
        out += mlp_weights(moe.shared_experts, f"{prefix}.shared_experts", topo)
    return out


def fused_expert_weights(moe: MoE, prefix: str, topo: Topology, whole: bool) -> list[Weight]:
    """gpt-oss's experts, all in one tensor each: gate_up_proj [E, hidden, 2I] with gate and up
    interleaved (so a rank's slice of I is one contiguous run of 2 I / tp columns), down_proj
    [E, I, hidden], their biases [E, 2I] and [E, hidden]; the router `router` with a bias. The down
    projection's bias is read by rank 0 alone under TP MoE (the partials are summed)."""
    r, inter = topo.rank, moe.intermediate_local

    def gate_then_up(t: torch.Tensor) -> torch.Tensor:
        return torch.cat([t[..., 0::2], t[..., 1::2]], dim=-1)

    experts = f"{prefix}.experts"
    out = [Weight(f"{prefix}.router.weight", moe.gate), Weight(f"{prefix}.router.bias", moe.router_bias)]
    if whole:  # this rank's slots, each its expert whole
        for s, e in enumerate(moe.slot_experts):
            one = slice(s, s + 1)
            out += [
                Weight(
                    f"{experts}.gate_up_proj",
                    moe.w13[one],
                    0,
                    e,
                    transform=lambda t: gate_then_up(t).transpose(1, 2),
                ),
                Weight(f"{experts}.down_proj", moe.w2[one], 0, e, transform=lambda t: t.transpose(1, 2)),
                Weight(f"{experts}.gate_up_proj_bias", moe.b13[one], 0, e, transform=gate_then_up),
                Weight(f"{experts}.down_proj_bias", moe.b2[one], 0, e),
            ]
        return out
    out += [
        Weight(
            f"{experts}.gate_up_proj",
            moe.w13,
            2,
            r,
            part_size=2 * inter,
            transform=lambda t: gate_then_up(t).transpose(1, 2),
        ),
        Weight(f"{experts}.down_proj", moe.w2, 1, r, part_size=inter, transform=lambda t: t.transpose(1, 2)),
        Weight(f"{experts}.gate_up_proj_bias", moe.b13, 1, r, part_size=2 * inter, transform=gate_then_up),
    ]
    return out + ([Weight(f"{experts}.down_proj_bias", moe.b2)] if r == 0 else [])


class CausalLM(nn.Module):
    """Replicated embedding; LM head vocabulary-parallel over WORLD, or with `dp_lm_head` inside the
    attention TP group (vocab padded, never cut)."""

    def __init__(
        self,
        cfg: ModelConfig,
        groups: Groups,
        comm: DPComm,
        layers: list[DecoderLayer],
        backend: AttentionBackend,
        mtp: MTPLayer | None = None,
        dp_lm_head: bool = False,
    ):
        super().__init__()
        self.cfg, self.groups, self.comm, self.attn_backend = cfg, groups, comm, backend
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.embed_tokens.weight.requires_grad_(False)
        self.layers = nn.ModuleList(layers)
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.dp_lm_head = dp_lm_head
        topo = groups.topo
        self.vocab_shard = -(-cfg.vocab_size // (topo.attn_tp_size if dp_lm_head else topo.tp_size))
        self.lm_head = nn.Parameter(torch.empty(self.vocab_shard, cfg.hidden_size), requires_grad=False)
        self.mtp = mtp  # the NEXTN draft layer, when speculation asks for it

    @torch.no_grad()
    def forward(self, batch: ForwardBatch, pool: KVPool) -> torch.Tensor:
        """Returns the full-vocabulary logits (float32) of this group's rows to sample."""
        return self.compute_logits(self.forward_hidden(batch, pool), batch)

    @torch.no_grad()
    def forward_hidden(
        self, batch: ForwardBatch, pool: KVPool, run_layer: Callable[..., torch.Tensor] | None = None
    ) -> torch.Tensor:
        """Embedding and decoder layers: the fixed-shape part a CUDA graph captures.
        `run_layer(layer, hidden, batch, pool)` runs each layer (default: its forward; a compiled
        DecoderLayer.forward under --enable-torch-compile)."""
        self.attn_backend.prepare(batch.attn)
        if batch.window_attn is not None:
            self.attn_backend.prepare(batch.window_attn)
        hidden = self.embed_tokens(batch.input_ids)
        run = run_layer or DecoderLayer.__call__
        for layer in self.layers:
            hidden = run(layer, hidden, batch, pool)
        return hidden

    @torch.no_grad()
    def compute_logits(self, hidden: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        """Final norm and the vocabulary-parallel LM head on the rows to sample."""
        return self.lm_head_logits(self.norm(hidden[batch.logit_idx]), batch.layout)

    def lm_head_logits(self, rows: torch.Tensor, layout: StepLayout) -> torch.Tensor:
        """Full-vocabulary logits (float32) of this group's normed `rows` (`layout.logit_rows` of them)."""
        # Logits travel in the model's dtype (half the bytes of float32) and are upcast on arrival.
        if self.dp_lm_head:  # this group's rows, the vocabulary split inside the group
            shard = F.linear(rows, self.lm_head)  # [own rows, vocab_shard]
            return all_gather(shard.t(), self.groups.attn_tp).t()[:, : self.cfg.vocab_size].float()
        rows = self.comm.gather_logit_rows(rows, layout)
        shard = F.linear(rows, self.lm_head)  # [every group's rows, vocab_shard]
        return self.comm.scatter_logits(shard, layout)[:, : self.cfg.vocab_size].float()

    @torch.no_grad()
    def draft_hidden(self, hidden: torch.Tensor, batch: ForwardBatch, pool: KVPool) -> torch.Tensor:
        """One MTP forward over this group's rows (`batch.input_ids`: the token after each row's
        position, `hidden`: the hidden state paired with it): the fixed-shape part a CUDA graph
        captures."""
        self.attn_backend.prepare(batch.attn)
        return self.mtp(self.embed_tokens(batch.input_ids), hidden, batch, pool)

    @torch.no_grad()
    def draft_logits(self, out: torch.Tensor, batch: ForwardBatch) -> tuple[torch.Tensor, torch.Tensor]:
        """(logits, the MTP's normed output) of the rows in `batch.logit_idx` of `draft_hidden`'s
        `out`: the normed rows are the hidden state a chain feeds its next step."""
        rows = self.mtp.shared_head_norm(out[batch.logit_idx])
        return self.lm_head_logits(rows, batch.layout), rows

    def weights(self) -> list[Weight]:
        """Where every parameter of this rank comes from in the checkpoint."""
        cfg, topo = self.cfg, self.groups.topo
        head = "model.embed_tokens.weight" if cfg.tie_word_embeddings else "lm_head.weight"
        out = [
            Weight("model.embed_tokens.weight", self.embed_tokens.weight),
            Weight(head, self.lm_head, 0, topo.attn_tp_rank if self.dp_lm_head else topo.rank, pad=True),
            Weight("model.norm.weight", self.norm.weight),
        ]
        for i, layer in enumerate(self.layers):
            out += layer.weights(f"model.layers.{i}", topo)
        if self.mtp is not None:  # DeepSeek's checkpoints put it after the last decoder layer
            prefix = f"model.layers.{cfg.num_layers}"
            out += self.mtp.weights(prefix) + self.mtp.layer.weights(prefix, topo)
        return out

    @property
    def moe_layers(self) -> list[MoE]:
        """The MoE layers, the MTP layer's last."""
        layers = [*self.layers, *([self.mtp.layer] if self.mtp is not None else [])]
        return [layer.mlp for layer in layers if isinstance(layer.mlp, MoE)]

    @property
    def moe_own_rank(self) -> int | None:
        """The attention TP rank when the MoE runs on each rank's own rows (all_to_all), else None."""
        moes = self.moe_layers
        return self.groups.topo.attn_tp_rank if moes and moes[0].on_own_rows else None

    @property
    def kv_layers(self) -> int:
        """Layers that keep KV for every token: the decoder layers and NEXTN's MTP layer."""
        return len(self.layers) + (self.mtp is not None)

    def kv_entry_shapes(self) -> list[tuple[int, ...]]:
        return self.layers[0].self_attn.kv_entry_shapes()

    @property
    def window_layers(self) -> frozenset[int]:
        """Decoder layers with a sliding window (gpt-oss: every other one)."""
        return frozenset(
            i for i, layer in enumerate(self.layers) if getattr(layer.self_attn, "window_size", 0)
        )

    @property
    def window_size(self) -> int:
        """The widest sliding window of its layers (0: none has one)."""
        return max((getattr(layer.self_attn, "window_size", 0) for layer in self.layers), default=0)
