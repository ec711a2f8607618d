"""Grouped-query attention models: Llama (also SmolLM2), Qwen3 and Qwen3-MoE (per-head q/k norm)."""

from __future__ import annotations

import torch
from torch import nn

from dpserve.attention.backend import AttentionBackend
from dpserve.config import EngineConfig
from dpserve.distributed import Groups, Topology
from dpserve.kvcache.pool import KVPool
from dpserve.layers.linear import Linear
from dpserve.layers.norm import RMSNorm
from dpserve.layers.rotary import RotaryEmbedding
from dpserve.models.base import build_mlp
from dpserve.models.batch import ForwardBatch
from dpserve.models.config import ModelConfig
from dpserve.models.loader import Weight


class GQAAttention(nn.Module):
    """Query heads split over ATTN_TP; KV heads split too, or replicated when A > kv heads."""

    def __init__(
        self,
        cfg: ModelConfig,
        topo: Topology,
        layer_id: int,
        backend: AttentionBackend,
        rotary: RotaryEmbedding,
        window_size: int = 0,
    ):
        super().__init__()
        hf = cfg.hf
        family = cfg.declaration
        # Qwen's use_sliding_window (false in its published checkpoints) windows layers by other rules.
        refused = ("mlp_bias", "use_sliding_window") + (() if family.attention_bias else ("attention_bias",))
        for flag in refused:
            if getattr(hf, flag, False):
                raise ValueError(f"{cfg.arch} checkpoints with {flag}=true are not supported")
        bias = family.attention_bias if getattr(hf, "attention_bias", False) else ""
        self.window_size = window_size  # sliding window (0: every position)
        a = topo.attn_tp_size
        self.layer_id, self.topo, self.backend = layer_id, topo, backend
        self.head_dim = head_dim(cfg)
        self.heads = cfg.num_heads // a
        self.kv_heads = max(cfg.num_kv_heads // a, 1)
        # With A > kv heads, rank r holds the one KV head its query heads use.
        self.kv_start = topo.attn_tp_rank * cfg.num_kv_heads // a if a > cfg.num_kv_heads else None
        self.num_kv_heads = cfg.num_kv_heads
        h, d = cfg.hidden_size, self.head_dim
        self.qkv_proj = Linear(h, (self.heads + 2 * self.kv_heads) * d, bias=bool(bias))
        self.o_proj = Linear(self.heads * d, h, bias=bias == "qkvo")
        if self.o_proj.bias is not None:  # row-parallel: attention TP rank 0 alone adds it
            nn.init.zeros_(self.o_proj.bias)
        self.sinks = nn.Parameter(torch.empty(self.heads), requires_grad=False) if family.sinks else None
        self.scale = d**-0.5
        self.rotary = rotary  # one table for the whole model
        qk_norm = family.qk_norm(hf)  # per head, over head_dim, before rotary
        self.q_norm = RMSNorm(d, cfg.rms_norm_eps) if qk_norm else None
        self.k_norm = RMSNorm(d, cfg.rms_norm_eps) if qk_norm else None

    def kv_entry_shapes(self) -> list[tuple[int, ...]]:
        return [(self.kv_heads, self.head_dim), (self.kv_heads, self.head_dim)]

    def forward(self, x: torch.Tensor, batch: ForwardBatch, pool: KVPool) -> torch.Tensor:
        n = x.shape[0]
        if n == 0:
            return x.new_zeros(0, x.shape[1])
        qkv = self.qkv_proj(x).view(n, -1, self.head_dim)
        qk = qkv[:, : self.heads + self.kv_heads]
        if self.q_norm is not None:
            qk = torch.cat([self.q_norm(qk[:, : self.heads]), self.k_norm(qk[:, self.heads :])], dim=1)
        qk = self.rotary(qk, batch.positions)  # one call for both
        q, k = qk.split([self.heads, self.kv_heads], dim=1)
        v = qkv[:, self.heads + self.kv_heads :]
        out = self.attend(q, k, v, batch, pool)
        return self.o_proj(out.reshape(n, -1))

    def attend(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, batch: ForwardBatch, pool: KVPool
    ) -> torch.Tensor:
        """Writes the new keys and values to the pool and attends over it; a window layer of the
        hybrid pool in its own slots."""
        hybrid = self.window_size and batch.window_attn is not None
        pool.write(self.layer_id, batch.out_window_slots if hybrid else batch.out_slots, k, v)
        k_cache, v_cache = pool.layers[self.layer_id]
        meta = batch.window_attn if hybrid else batch.attn
        return self.backend.gqa(q, k_cache, v_cache, meta, self.scale, self.window_size, self.sinks)

    def weights(self, prefix: str) -> list[Weight]:
        """q heads split over ATTN_TP; k/v heads too, or the one KV head this rank's queries use."""
        r = self.topo.attn_tp_rank
        kv_part = r if self.kv_start is None else self.kv_start
        sizes = [self.heads * self.head_dim, *[self.kv_heads * self.head_dim] * 2]
        out = []
        for kind in ("weight", "bias") if self.qkv_proj.bias is not None else ("weight",):
            q, k, v = getattr(self.qkv_proj, kind).split(sizes)
            out += [
                Weight(f"{prefix}.q_proj.{kind}", q, 0, r),
                Weight(f"{prefix}.k_proj.{kind}", k, 0, kv_part),
                Weight(f"{prefix}.v_proj.{kind}", v, 0, kv_part),
            ]
        if self.q_norm is not None:
            out += [
                Weight(f"{prefix}.q_norm.weight", self.q_norm.weight),
                Weight(f"{prefix}.k_norm.weight", self.k_norm.weight),
            ]
        if self.sinks is not None:
            out.append(Weight(f"{prefix}.sinks", self.sinks, 0, r))
        if self.o_proj.bias is not None and r == 0:
            out.append(Weight(f"{prefix}.o_proj.bias", self.o_proj.bias))
        return [*out, Weight(f"{prefix}.o_proj.weight", self.o_proj.weight, 1, r)]


def build_gqa_layers(
    cfg: ModelConfig, groups: Groups, backend: AttentionBackend, options: EngineConfig
) -> list[tuple[nn.Module, nn.Module]]:
    """The decoder layers' (attention, MLP) pairs; with NEXTN the MTP layer's pair last (model layer
    `num_layers`, whose KV lives in a pool of its own: KV layer 0)."""
    rope = dict(cfg.hf.rope_parameters or {})
    d = head_dim(cfg)
    # GLM-4.5 rotates only the first part of each head (partial_rotary_factor 0.5).
    factor = rope.get("partial_rotary_factor") or getattr(cfg.hf, "partial_rotary_factor", None) or 1.0
    rotary = RotaryEmbedding(int(d * factor), cfg.context_len, rope, interleaved=False)
    mtp = options.nextn
    kv_layers = [*range(cfg.num_layers), *([0] if mtp else [])]
    # Sliding-window layers by transformers' layer_types (gpt-oss: every other one).
    types = getattr(cfg.hf, "layer_types", None) or []
    windows = [cfg.hf.sliding_window if t == "sliding_attention" else 0 for t in types]
    return [
        (
            GQAAttention(cfg, groups.topo, kv, backend, rotary, windows[i] if i < len(windows) else 0),
            build_mlp(cfg, groups, options, i),
        )
        for i, kv in enumerate(kv_layers)
    ]


def head_dim(cfg: ModelConfig) -> int:
    return getattr(cfg.hf, "head_dim", None) or cfg.hidden_size // cfg.num_heads
