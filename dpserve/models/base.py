"""The decoder stack shared by every model: embedding, layers, final norm, LM head."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn
from tqdm import tqdm

from dpserve.attention.backend import AttentionBackend
from dpserve.distributed import Groups, Topology
from dpserve.kvcache.pool import KVPool
from dpserve.layers.dp_attention import DPAttentionComm, DPStep
from dpserve.layers.mlp import MLP, MoE
from dpserve.layers.norm import RMSNorm
from dpserve.models.batch import ForwardBatch
from dpserve.models.checkpoint import CheckpointReader
from dpserve.models.config import ModelConfig

if TYPE_CHECKING:
    from dpserve.models.mtp import MTPLayer


class DecoderLayer(nn.Module):
    """Attention on local rows, DP gather, MLP/MoE on global rows, DP scatter."""

    def __init__(self, cfg: ModelConfig, attn: nn.Module, mlp: MLP | MoE, comm: DPAttentionComm):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = attn
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = mlp
        self.comm = comm

    def forward(self, hidden: torch.Tensor, batch: ForwardBatch, pool: KVPool) -> torch.Tensor:
        attn_partial = self.self_attn(self.input_layernorm(hidden), batch, pool)
        global_rows, residual = self.comm.gather(attn_partial, hidden, batch.step, batch.row_index)
        mlp_partial = self.mlp(self.post_attention_layernorm(global_rows))
        return self.comm.scatter(mlp_partial, residual, batch.step, batch.row_index)

    def load(self, r: CheckpointReader, prefix: str, topo: Topology) -> None:
        self.input_layernorm.weight.data.copy_(r.get(f"{prefix}.input_layernorm.weight"))
        self.post_attention_layernorm.weight.data.copy_(r.get(f"{prefix}.post_attention_layernorm.weight"))
        self.self_attn.load(r, f"{prefix}.self_attn")
        self.mlp.load(r, f"{prefix}.mlp", topo.rank, topo.tp_size)


class CausalLM(nn.Module):
    """Replicated embedding; LM head vocabulary-parallel over WORLD (vocab padded, never cut)."""

    def __init__(
        self,
        cfg: ModelConfig,
        groups: Groups,
        comm: DPAttentionComm,
        layers: list[DecoderLayer],
        backend: AttentionBackend,
        mtp: MTPLayer | None = None,
    ):
        super().__init__()
        self.cfg, self.groups, self.comm, self.attn_backend = cfg, groups, comm, backend
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.embed_tokens.weight.requires_grad_(False)
        self.layers = nn.ModuleList(layers)
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        t = groups.topo.tp_size
        self.vocab_shard = -(-cfg.vocab_size // t)
        self.lm_head = nn.Parameter(torch.empty(self.vocab_shard, cfg.hidden_size), requires_grad=False)
        self.mtp = mtp  # the NEXTN draft layer, when speculation asks for it

    @torch.no_grad()
    def forward(self, batch: ForwardBatch, pool: KVPool) -> torch.Tensor:
        """Returns the full-vocabulary logits (float32) of this group's rows to sample."""
        return self.compute_logits(self.forward_hidden(batch, pool), batch)

    @torch.no_grad()
    def forward_hidden(self, batch: ForwardBatch, pool: KVPool) -> torch.Tensor:
        """Embedding and decoder layers: the fixed-shape part a CUDA graph captures."""
        self.attn_backend.prepare(batch.attn)
        hidden = self.embed_tokens(batch.input_ids)
        for layer in self.layers:
            hidden = layer(hidden, batch, pool)
        return hidden

    @torch.no_grad()
    def compute_logits(self, hidden: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        """Final norm and the vocabulary-parallel LM head on the rows to sample."""
        return self.lm_head_logits(self.norm(hidden[batch.logit_idx]), batch.step)

    def lm_head_logits(self, rows: torch.Tensor, step: DPStep) -> torch.Tensor:
        """Full-vocabulary logits (float32) of this group's normed `rows` (`step.logit_rows` of them)."""
        rows = self.comm.gather_logit_rows(rows, step)
        shard = F.linear(rows, self.lm_head).float()  # [every group's rows, vocab_shard]
        return self.comm.scatter_logits(shard, step)[:, : self.cfg.vocab_size]

    @torch.no_grad()
    def draft(
        self, hidden: torch.Tensor, batch: ForwardBatch, pool: KVPool
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One MTP step over this group's rows (`batch.input_ids`: the token after each row's
        position, `hidden`: the hidden state paired with it); returns (logits, the MTP's normed
        output) of the rows in `batch.logit_idx`, the hidden state a chain feeds its next step."""
        self.attn_backend.prepare(batch.attn)
        out = self.mtp(self.embed_tokens(batch.input_ids), hidden, batch, pool)
        rows = self.mtp.shared_head_norm(out[batch.logit_idx])
        return self.lm_head_logits(rows, batch.step), rows

    def load_weights(self, r: CheckpointReader, show_progress: bool) -> None:
        cfg, topo = self.cfg, self.groups.topo
        self.embed_tokens.weight.data.copy_(r.get("model.embed_tokens.weight"))
        head = "model.embed_tokens.weight" if cfg.tie_word_embeddings else "lm_head.weight"
        start = topo.rank * self.vocab_shard
        self.lm_head.data.copy_(r.get_rows(head, start, start + self.vocab_shard))
        self.norm.weight.data.copy_(r.get("model.norm.weight"))
        layers = tqdm(
            list(enumerate(self.layers)), desc="Loading weights", unit="layer", disable=not show_progress
        )
        for i, layer in layers:
            layer.load(r, f"model.layers.{i}", topo)
        if self.mtp is not None:  # DeepSeek's checkpoints put it after the last decoder layer
            self.mtp.load(r, f"model.layers.{cfg.num_layers}", topo)

    @property
    def kv_layers(self) -> int:
        """Layers that keep KV for every token: the decoder layers and NEXTN's MTP layer."""
        return len(self.layers) + (self.mtp is not None)

    def kv_entry_shapes(self) -> list[tuple[int, ...]]:
        return self.layers[0].self_attn.kv_entry_shapes()
