"""DeepseekV2/V3: multi-head latent attention (MLA) and routed + shared experts."""

from __future__ import annotations

import dataclasses
from itertools import accumulate

import torch
import torch.nn.functional as F
from torch import nn

from dpserve.attention.backend import AttentionBackend, AttentionMetadata
from dpserve.config import EngineConfig
from dpserve.distributed import Groups, Topology
from dpserve.kvcache.pool import KVPool, take
from dpserve.layers.linear import Linear
from dpserve.layers.norm import RMSNorm
from dpserve.layers.rotary import RotaryEmbedding, yarn_softmax_scale
from dpserve.models.base import build_mlp
from dpserve.models.batch import ForwardBatch
from dpserve.models.config import ModelConfig
from dpserve.models.dsa import Indexer, sparse_metadata
from dpserve.models.loader import Weight

LORA_NORM_EPS = 1e-6  # DeepSeek's q_a/kv_a layernorms use the default epsilon
# Peak FLOP/s over memory bytes/s, what turns bytes into FLOP-equivalents in mha_is_cheaper: about
# 300 for an H100/H200 (989 TFLOP/s bf16, 3.3-4.8 TB/s), about 20 for a few CPU cores.
FLOPS_PER_BYTE = {"gpu": 300, "cpu": 20}


def mha_is_cheaper(
    q: int, kv: int, heads: int, rank: int, rope: int, nope: int, v: int, on_gpu: bool, elem: int = 2
) -> bool:
    """Whether a request with `q` new tokens attending to `kv` keys (its cached prefix and
    itself) costs less in the multi-head form than in the absorbed one: FLOPs of each, plus the
    bytes each moves weighted by the device's FLOPs per byte.

    absorbed: q_nope -> latent (q*nope*rank per head), scores and values over the latent
              (q*kv*(rank + rope) + q*kv*rank), latent -> v (q*rank*v); the kernels read the
              cached latent once per query block of 64.
    multi-head: every key and value expanded from the latent (kv*rank*(nope + v)), then ordinary
              attention (q*kv*(nope + rope) + q*kv*v); the expanded keys and values are written
              and read once.
    """
    flops_abs = 2 * heads * (q * nope * rank + q * kv * (2 * rank + rope) + q * rank * v)
    flops_mha = 2 * heads * (kv * rank * (nope + v) + q * kv * (nope + rope + v))
    bytes_abs = -(-q // 64) * kv * (rank + rope) * elem
    bytes_mha = 2 * kv * heads * (nope + rope + v) * elem + kv * (rank + rope) * elem
    ratio = FLOPS_PER_BYTE["gpu" if on_gpu else "cpu"]
    return flops_mha + ratio * bytes_mha < flops_abs + ratio * bytes_abs


class MLAAttention(nn.Module):
    """Heads split over ATTN_TP; the cache holds one latent + rope key per token (not split).

    Two forms, chosen per request (`mha_is_cheaper`): the absorbed form maps q_nope into the latent
    space with W_UK and the attended latent out with W_UV, so keys and values are never expanded
    (decode, and extends whose cached prefix dominates); the multi-head form expands every key and
    value from the latent through kv_b_proj and runs ordinary causal attention with as many KV
    heads as query heads (prefill, where it needs about a third of the absorbed form's FLOPs).
    """

    def __init__(
        self,
        cfg: ModelConfig,
        topo: Topology,
        layer_id: int,
        backend: AttentionBackend,
        rotary: RotaryEmbedding,
        prefill: str = "auto",
        indexer: Indexer | None = None,
    ):
        super().__init__()
        hf = cfg.hf
        if getattr(hf, "attention_bias", False):
            raise ValueError("MLA with attention_bias=True is not supported")
        self.prefill = prefill  # extend steps' form: auto, absorbed or multi_head
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
        # Keys (nope part) and values from the latent, per head: W_UK rows then W_UV rows.
        self.kv_b_proj = Linear(self.rank, self.heads * (self.nope + self.v_dim), packable=False)  # _absorbed
        self.o_proj = Linear(self.heads * self.v_dim, h)
        self.scale = qk_dim**-0.5 * yarn_softmax_scale(dict(hf.rope_parameters or {}))
        self.rotary = rotary  # one table for the whole model
        self.indexer = indexer  # DeepSeek-V3.2's sparse attention: the keys each query attends to

    def kv_entry_shapes(self) -> list[tuple[int, ...]]:
        latent = (self.rank + self.rope_dim,)
        return [latent] if self.indexer is None else [latent, (self.indexer.dim,)]

    def forward(self, x: torch.Tensor, batch: ForwardBatch, pool: KVPool) -> torch.Tensor:
        n = x.shape[0]
        if n == 0:
            return x.new_zeros(0, x.shape[1])
        q_latent = self.q_a_layernorm(self.q_a_proj(x)) if self.q_lora_rank else None
        q = self.q_b_proj(q_latent) if self.q_lora_rank else self.q_proj(x)
        q_nope, q_pe = q.view(n, self.heads, -1).split([self.nope, self.rope_dim], dim=-1)
        latent, k_pe = self.kv_a_proj_with_mqa(x).split([self.rank, self.rope_dim], dim=-1)
        latent = self.kv_a_layernorm(latent)
        pe = self.rotary(torch.cat([q_pe, k_pe.unsqueeze(1)], dim=1), batch.positions)  # one call for both
        q_pe, k_pe = pe[:, : self.heads], pe[:, self.heads]
        kv = torch.cat([latent, k_pe], dim=-1)
        if self.indexer is None:
            out = self.attend(q_nope, q_pe, kv, batch, pool)
        else:
            out = self.attend_sparse(x, q_latent, q_nope, q_pe, kv, batch, pool)
        return self.o_proj(out.reshape(n, -1))

    def attend_sparse(self, x, q_latent, q_nope, q_pe, kv, batch: ForwardBatch, pool: KVPool) -> torch.Tensor:
        """DeepSeek-V3.2: caches the latent and the indexer key; while every request of the step fits
        in index_topk tokens all keys are selected, the dense forms' result; past it, each query
        attends to the keys the indexer picks, in the absorbed form, by the backend's own MLA (the
        paged kernels on a GPU) over the selection as a batch of one-query requests."""
        pool.write(self.layer_id, batch.out_slots, kv, self.indexer.key(x, batch.positions))
        meta = batch.attn
        if meta.max_seq_len <= self.indexer.topk:
            return self.attend(q_nope, q_pe, kv, batch, pool, written=True)
        slots, real = self.indexer.select(
            x, q_latent, batch.positions, pool.layers[self.layer_id][1], meta, self.backend
        )
        sparse = sparse_metadata(slots, real)
        self.backend.prepare(sparse)
        return self._absorbed(q_nope, q_pe, pool, sparse)

    def attend(
        self,
        q_nope: torch.Tensor,
        q_pe: torch.Tensor,
        kv: torch.Tensor,
        batch: ForwardBatch,
        pool: KVPool,
        written: bool = False,
    ) -> torch.Tensor:
        """Writes the new latents `kv` to the pool (unless `written`) and attends over it: [tokens,
        heads, v_dim]."""
        if not written:
            pool.write(self.layer_id, batch.out_slots, kv)
        split = self._split(batch.attn, kv.is_cuda)
        if split is None:
            return self._absorbed(q_nope, q_pe, pool, batch.attn)
        out = q_nope.new_empty((kv.shape[0], self.heads, self.v_dim))
        (_, mha_tokens, keys_meta, key_slots), rest = split
        q_mha = torch.cat([q_nope[mha_tokens], q_pe[mha_tokens]], dim=-1)
        out[mha_tokens] = self._multi_head(q_mha, pool, keys_meta, key_slots)
        if rest is not None:
            out[rest[1]] = self._absorbed(q_nope[rest[1]], q_pe[rest[1]], pool, rest[0])
        return out

    def _absorbed(
        self, q_nope, q_pe, pool: KVPool, meta: AttentionMetadata, attend_latent=None
    ) -> torch.Tensor:
        """`attend_latent(q_abs)`: the attended latent (default: the backend's MLA over the pool)."""
        w_uk, w_uv = self.kv_b_proj.weight.view(self.heads, -1, self.rank).split([self.nope, self.v_dim], 1)
        q_latent = torch.einsum("nhd,hdr->nhr", q_nope, w_uk)
        q_abs = torch.cat([q_latent, q_pe], dim=-1)
        if attend_latent is None:
            out_latent = self.backend.mla(q_abs, pool.layers[self.layer_id][0], meta, self.scale, self.rank)
        else:
            out_latent = attend_latent(q_abs)
        return torch.einsum("nhr,hvr->nhv", out_latent, w_uv)

    def _multi_head(
        self, q, pool: KVPool, keys_meta: AttentionMetadata, key_slots: torch.Tensor
    ) -> torch.Tensor:
        """q [tokens, heads, nope + rope] of the multi-head requests against every key of theirs,
        expanded from the cached latent (`key_slots`: their pool slots in order); `keys_meta`
        reads those expanded keys as a pool of their own (row 0: padding)."""
        cached = take(pool.layers[self.layer_id][0], key_slots)  # [keys, latent + rope]
        kv = self.kv_b_proj(cached[:, : self.rank]).view(-1, self.heads, self.nope + self.v_dim)
        k_nope, v = kv.split([self.nope, self.v_dim], dim=-1)
        k_pe = cached[:, None, self.rank :].expand(-1, self.heads, -1)
        k = F.pad(torch.cat([k_nope, k_pe], dim=-1), (0, 0, 0, 0, 1, 0))
        return self.backend.gqa(q, k, F.pad(v, (0, 0, 0, 0, 1, 0)), keys_meta, self.scale)

    def _split(self, meta: AttentionMetadata, on_gpu: bool):
        """Once per forward (cached for the other layers): None when every request takes the absorbed
        form, else ((multi-head requests' metadata, their tokens, the metadata reading their expanded
        keys, those keys' slots), (the other requests' metadata, tokens) or None)."""
        if "mla_split" not in meta.state:
            meta.state["mla_split"] = self._plan_split(meta, on_gpu)
        return meta.state["mla_split"]

    def _plan_split(self, meta: AttentionMetadata, on_gpu: bool):
        if meta.max_q_len <= 1 or meta.q_lens_host is None:
            return None
        dims = (self.heads, self.rank, self.rope_dim, self.nope, self.v_dim)
        pairs = list(zip(meta.q_lens_host, meta.seq_lens_host, strict=True))
        if self.prefill == "absorbed":
            return None
        forced = self.prefill == "multi_head"
        mha = [
            i for i, (q, kv) in enumerate(pairs) if q > 1 and (forced or mha_is_cheaper(q, kv, *dims, on_gpu))
        ]
        if not mha:
            return None
        sub, tokens = meta.select(mha)
        kv_lens, dev = sub.seq_lens_host, sub.table_rows.device
        table = sub.req_to_token[sub.table_rows, : sub.max_seq_len]
        key_slots = torch.cat([table[i, :n] for i, n in enumerate(kv_lens)]).long()
        # The expanded keys as a pool of their own: request i's at rows 1 + (keys before it) on.
        first = torch.tensor(list(accumulate([1, *kv_lens[:-1]])), dtype=torch.int32, device=dev)
        positions = torch.arange(sub.max_seq_len, dtype=torch.int32, device=dev)
        own = torch.where(positions[None, :] < sub.seq_lens[:, None], first[:, None] + positions, 0)
        keys_meta = dataclasses.replace(
            sub,
            req_to_token=torch.cat([torch.zeros_like(own[:1]), own]),
            table_rows=torch.arange(1, len(kv_lens) + 1, dtype=torch.int32, device=dev),
            state={},
        )
        self.backend.prepare(keys_meta)
        others = [i for i in range(len(pairs)) if i not in set(mha)]
        rest = meta.select(others) if others else None
        if rest is not None:
            self.backend.prepare(rest[0])
        return (sub, tokens, keys_meta, key_slots), rest

    def weights(self, prefix: str) -> list[Weight]:
        """Query, kv_b and o projections split by heads over ATTN_TP; the latent's replicated."""
        r = self.topo.attn_tp_rank
        if self.q_lora_rank:
            q = [
                Weight(f"{prefix}.q_a_proj.weight", self.q_a_proj.weight),
                Weight(f"{prefix}.q_a_layernorm.weight", self.q_a_layernorm.weight),
                Weight(f"{prefix}.q_b_proj.weight", self.q_b_proj.weight, 0, r),
            ]
        else:
            q = [Weight(f"{prefix}.q_proj.weight", self.q_proj.weight, 0, r)]
        if self.indexer is not None:
            q += self.indexer.weights(f"{prefix}.indexer")
        return [
            *q,
            Weight(f"{prefix}.kv_a_proj_with_mqa.weight", self.kv_a_proj_with_mqa.weight),
            Weight(f"{prefix}.kv_a_layernorm.weight", self.kv_a_layernorm.weight),
            Weight(f"{prefix}.kv_b_proj.weight", self.kv_b_proj.weight, 0, r),
            Weight(f"{prefix}.o_proj.weight", self.o_proj.weight, 1, r),
        ]


def build_deepseek_layers(
    cfg: ModelConfig, groups: Groups, backend: AttentionBackend, options: EngineConfig
) -> list[tuple[nn.Module, nn.Module]]:
    """The decoder layers' (attention, MLP) pairs; with NEXTN the MTP layer's pair last (model layer
    `num_layers`, whose KV lives in a pool of its own: KV layer 0)."""
    hf = cfg.hf
    interleaved = getattr(hf, "rope_interleave", None) is not False  # DeepSeek's default: interleaved
    rope = dict(hf.rope_parameters or {})
    rotary = RotaryEmbedding(hf.qk_rope_head_dim, cfg.context_len, rope, interleaved)
    # V3.2's indexer rotates its first rope dims by the same angles, as halves.
    index_rotary = RotaryEmbedding(hf.qk_rope_head_dim, cfg.context_len, rope, interleaved=False)
    sparse = cfg.declaration.sparse_attention
    mtp, topo = options.nextn, groups.topo
    kv_layers = [*range(cfg.num_layers), *([0] if mtp else [])]  # the MTP layer: KV layer 0 of its pool
    return [
        (
            MLAAttention(
                cfg,
                topo,
                kv,
                backend,
                rotary,
                options.mla_prefill,
                Indexer(hf, cfg.hidden_size, index_rotary) if sparse else None,
            ),
            build_mlp(cfg, groups, options, i),
        )
        for i, kv in enumerate(kv_layers)
    ]
