"""DeepSeek's multi-token prediction (MTP, NextN) layer, which GLM-4.5 shares: the draft model of
NEXTN speculation.

Row p pairs the main model's hidden state at position p (after its final norm) with the token at
p + 1 and predicts the token at p + 2: `eh_proj(cat(enorm(embed(x_{p+1})), hnorm(h_p)))`, one
decoder layer (the family's attention + MoE under DP attention, like every layer), then `shared_head.norm` and the
main model's LM head. Chained steps feed the previous step's normed output as the hidden state.
"""

from __future__ import annotations

import torch
from torch import nn

from dpserve.kvcache.pool import KVPool
from dpserve.layers.linear import Linear
from dpserve.layers.norm import RMSNorm
from dpserve.models.batch import ForwardBatch
from dpserve.models.config import ModelConfig
from dpserve.models.loader import Weight


class MTPLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: nn.Module):
        super().__init__()
        h, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.enorm = RMSNorm(h, eps)
        self.hnorm = RMSNorm(h, eps)
        self.eh_proj = Linear(2 * h, h)
        self.layer = layer  # a DecoderLayer
        self.shared_head_norm = RMSNorm(h, eps)

    def forward(
        self, embedded: torch.Tensor, hidden: torch.Tensor, batch: ForwardBatch, pool: KVPool
    ) -> torch.Tensor:
        """`embedded`: embeddings of the rows' next tokens; `hidden`: the paired hidden states.
        Returns the layer's output rows (before `shared_head_norm`)."""
        x = self.eh_proj(torch.cat([self.enorm(embedded), self.hnorm(hidden)], dim=-1))
        return self.layer(x, batch, pool)

    def weights(self, prefix: str) -> list[Weight]:
        """Its own tensors (the decoder layer's come from the layer's table)."""
        return [
            Weight(f"{prefix}.enorm.weight", self.enorm.weight),
            Weight(f"{prefix}.hnorm.weight", self.hnorm.weight),
            Weight(f"{prefix}.eh_proj.weight", self.eh_proj.weight),
            Weight(f"{prefix}.shared_head.norm.weight", self.shared_head_norm.weight),
        ]
