"""DeepseekV2/V3: multi-head latent attention (MLA) and routed + shared experts."""

from __future__ import annotations

import torch
from torch import nn

from dpserve.attention.backend import AttentionBackend
from dpserve.distributed import Topology
from dpserve.kvcache.pool import KVPool
from dpserve.layers.linear import Linear
from dpserve.layers.mlp import MLP, MoE
from dpserve.layers.norm import RMSNorm
from dpserve.layers.rotary import RotaryEmbedding, yarn_softmax_scale
from dpserve.models.batch import ForwardBatch
from dpserve.models.checkpoint import CheckpointReader
from dpserve.models.config import ModelConfig

LORA_NORM_EPS = 1e-6  # DeepSeek's q_a/kv_a layernorms use the default epsilon


class MLAAttention(nn.Module):
    """Heads split over ATTN_TP; the cache holds one latent + rope key per token (not split).

    Runs in absorbed form: q_nope is mapped into the latent space with W_UK and the
    attended latent is mapped out with W_UV, so keys and values are never expanded.
    """

    def __init__(
        self,
        cfg: ModelConfig,
        topo: Topology,
        layer_id: int,
        backend: AttentionBackend,
        rotary: RotaryEmbedding,
    ):
        super().__init__()
        hf = cfg.hf
        if getattr(hf, "attention_bias", False):
            raise ValueError("MLA with attention_bias=True is not supported")
        self.layer_id, self.topo, self.backend = layer_id, topo, backend
        self.heads = cfg.num_heads // topo.attn_tp_size
        self.nope, self.rope_dim, self.v_dim = hf.qk_nope_head_dim, hf.qk_rope_head_dim, hf.v_head_dim
        self.rank = hf.kv_lora_rank
        qk_dim = self.nope + self.rope_dim
        h = cfg.hidden_size
        self.q_lora_rank = hf.q_lora_rank
        if self.q_lora_rank:
            self.q_a_proj = Linear(h, self.q_lora_rank)
            self.q_a_layernorm = RMSNorm(self.q_lora_rank, LORA_NORM_EPS)
            self.q_b_proj = Linear(self.q_lora_rank, self.heads * qk_dim)
        else:
            self.q_proj = Linear(h, self.heads * qk_dim)
        self.kv_a_proj_with_mqa = Linear(h, self.rank + self.rope_dim)
        self.kv_a_layernorm = RMSNorm(self.rank, LORA_NORM_EPS)
        self.w_uk = nn.Parameter(torch.empty(self.heads, self.nope, self.rank), requires_grad=False)
        self.w_uv = nn.Parameter(torch.empty(self.heads, self.v_dim, self.rank), requires_grad=False)
        self.o_proj = Linear(self.heads * self.v_dim, h)
        self.scale = qk_dim**-0.5 * yarn_softmax_scale(dict(hf.rope_parameters or {}))
        self.rotary = rotary  # one table for the whole model

    def kv_entry_shapes(self) -> list[tuple[int, ...]]:
        return [(self.rank + self.rope_dim,)]

    def forward(self, x: torch.Tensor, batch: ForwardBatch, pool: KVPool) -> torch.Tensor:
        n = x.shape[0]
        if n == 0:
            return x.new_zeros(0, x.shape[1])
        q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x))) if self.q_lora_rank else self.q_proj(x)
        q_nope, q_pe = q.view(n, self.heads, -1).split([self.nope, self.rope_dim], dim=-1)
        latent, k_pe = self.kv_a_proj_with_mqa(x).split([self.rank, self.rope_dim], dim=-1)
        latent = self.kv_a_layernorm(latent)
        q_pe = self.rotary(q_pe, batch.positions)
        k_pe = self.rotary(k_pe.unsqueeze(1), batch.positions).squeeze(1)
        pool.write(self.layer_id, batch.out_slots, torch.cat([latent, k_pe], dim=-1))
        q_latent = torch.einsum("nhd,hdr->nhr", q_nope, self.w_uk)
        out_latent = self.backend.mla(
            torch.cat([q_latent, q_pe], dim=-1),
            pool.layers[self.layer_id][0],
            batch.attn,
            self.scale,
            self.rank,
        )
        out = torch.einsum("nhr,hvr->nhv", out_latent, self.w_uv).reshape(n, -1)
        return self.o_proj(out)

    def load(self, r: CheckpointReader, prefix: str) -> None:
        shard, count = self.topo.attn_tp_rank, self.topo.attn_tp_size
        if self.q_lora_rank:
            self.q_a_proj.weight.data.copy_(r.get(f"{prefix}.q_a_proj.weight"))
            self.q_a_layernorm.weight.data.copy_(r.get(f"{prefix}.q_a_layernorm.weight"))
            self.q_b_proj.weight.data.copy_(r.get_shard(f"{prefix}.q_b_proj.weight", 0, shard, count))
        else:
            self.q_proj.weight.data.copy_(r.get_shard(f"{prefix}.q_proj.weight", 0, shard, count))
        self.kv_a_proj_with_mqa.weight.data.copy_(r.get(f"{prefix}.kv_a_proj_with_mqa.weight"))
        self.kv_a_layernorm.weight.data.copy_(r.get(f"{prefix}.kv_a_layernorm.weight"))
        kv_b = r.get_shard(f"{prefix}.kv_b_proj.weight", 0, shard, count)
        kv_b = kv_b.view(self.heads, self.nope + self.v_dim, self.rank)
        self.w_uk.data.copy_(kv_b[:, : self.nope])
        self.w_uv.data.copy_(kv_b[:, self.nope :])
        self.o_proj.weight.data.copy_(r.get_shard(f"{prefix}.o_proj.weight", 1, shard, count))


def build_deepseek_layers(
    cfg: ModelConfig, topo: Topology, backend: AttentionBackend, mtp: bool = False
) -> list[tuple[nn.Module, nn.Module]]:
    """The decoder layers' (attention, MLP) pairs; `mtp` appends the MTP layer's pair (model layer
    `num_layers`, whose KV lives in a pool of its own: KV layer 0)."""
    hf = cfg.hf
    if cfg.arch == "DeepseekV3ForCausalLM":
        defaults = {"topk_method": "noaux_tc", "scoring_func": "sigmoid"}
    else:
        defaults = {"topk_method": "greedy", "scoring_func": "softmax"}
    for key, value in defaults.items():
        if getattr(hf, key, None) is None:
            setattr(hf, key, value)
    interleaved = getattr(hf, "rope_interleave", True)
    rope = dict(hf.rope_parameters or {})
    rotary = RotaryEmbedding(hf.qk_rope_head_dim, cfg.context_len, rope, interleaved)
    layers = [_layer(cfg, topo, backend, rotary, i, kv_layer=i) for i in range(cfg.num_layers)]
    if mtp:
        layers.append(_layer(cfg, topo, backend, rotary, cfg.num_layers, kv_layer=0))
    return layers


def _layer(
    cfg: ModelConfig,
    topo: Topology,
    backend: AttentionBackend,
    rotary: RotaryEmbedding,
    index: int,
    kv_layer: int,
) -> tuple[nn.Module, nn.Module]:
    hf, t = cfg.hf, topo.tp_size
    attn = MLAAttention(cfg, topo, kv_layer, backend, rotary)
    if hf.n_routed_experts and index >= hf.first_k_dense_replace:
        shared = hf.moe_intermediate_size * (hf.n_shared_experts or 0)
        return attn, MoE(hf, hf.moe_intermediate_size // t, shared // t)
    return attn, MLP(cfg.hidden_size, hf.intermediate_size // t)
