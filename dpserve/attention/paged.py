"""Attention over the paged token pool, for a batch of requests with mixed lengths.

Every request contributes q_len new tokens (q_len = 1 in decode) and attends to its
kv_len cached tokens (prefix + new), gathered from the pool by slot index. Requests are
laid out in a [batch, q_max] grid; the mask applies causality and hides padding.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass
class AttentionMetadata:
    slot_table: torch.Tensor  # [batch, kv_max] pool slots of each request's tokens (0 = padding)
    mask: torch.Tensor  # [batch, 1, q_max, kv_max] True where a query may attend a key
    token_req: torch.Tensor  # [tokens] request index of each new token
    token_col: torch.Tensor  # [tokens] position of the token inside its request's new tokens
    q_max: int

    @classmethod
    def build(cls, q_lens: list[int], kv_slots: list[list[int]], device: torch.device) -> AttentionMetadata:
        kv_lens = [len(s) for s in kv_slots]
        batch, q_max, kv_max = len(q_lens), max(q_lens, default=0), max(kv_lens, default=0)
        table = torch.zeros(batch, kv_max, dtype=torch.long)
        for i, slots in enumerate(kv_slots):
            table[i, : len(slots)] = torch.tensor(slots, dtype=torch.long)
        q_lens_t = torch.tensor(q_lens, dtype=torch.long)
        kv_lens_t = torch.tensor(kv_lens, dtype=torch.long)
        prefix = (kv_lens_t - q_lens_t)[:, None, None]
        q_pos = torch.arange(q_max)[None, :, None] + prefix
        k_pos = torch.arange(kv_max)[None, None, :]
        mask = (k_pos <= q_pos) & (k_pos < kv_lens_t[:, None, None])
        token_req = torch.repeat_interleave(torch.arange(batch), q_lens_t)
        starts = torch.cumsum(q_lens_t, 0) - q_lens_t
        token_col = torch.arange(int(q_lens_t.sum())) - torch.repeat_interleave(starts, q_lens_t)
        return cls(
            table.to(device), mask.unsqueeze(1).to(device), token_req.to(device), token_col.to(device), q_max
        )

    def pack(self, x: torch.Tensor) -> torch.Tensor:
        """[tokens, ...] -> [batch, q_max, ...] (zero-filled padding)."""
        out = x.new_zeros((self.slot_table.shape[0], self.q_max, *x.shape[1:]))
        out[self.token_req, self.token_col] = x
        return out

    def unpack(self, x: torch.Tensor) -> torch.Tensor:
        return x[self.token_req, self.token_col]


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata, scale: float):
    """q [batch, heads, q_max, d] against k [batch, kv_heads, kv_max, d], v [..., dv]; kv_heads
    divides heads (grouped-query, or one shared latent for MLA), never expanded in memory."""
    return F.scaled_dot_product_attention(
        q, k, v, attn_mask=meta.mask, scale=scale, enable_gqa=k.shape[1] != q.shape[1]
    )


def mla_attention(
    q_latent: torch.Tensor, latent_cache: torch.Tensor, meta: AttentionMetadata, scale: float, rank: int
) -> torch.Tensor:
    """Absorbed MLA: q_latent [tokens, heads, rank + rope] against the cached latent
    [slots, rank + rope]; returns the attended latent [tokens, heads, rank]."""
    kv = latent_cache[meta.slot_table].unsqueeze(1)  # [batch, 1, kv_max, rank + rope]
    q = meta.pack(q_latent).transpose(1, 2)  # [batch, heads, q_max, rank + rope]
    out = _attend(q, kv, kv[..., :rank], meta, scale)
    return meta.unpack(out.transpose(1, 2))


def mha_attention(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata, scale: float
) -> torch.Tensor:
    """GQA: q [tokens, heads, dim] against cached k/v [slots, kv_heads, dim]."""
    k = k_cache[meta.slot_table].transpose(1, 2)  # [batch, kv_heads, kv_max, dim]
    v = v_cache[meta.slot_table].transpose(1, 2)
    out = _attend(meta.pack(q).transpose(1, 2), k, v, meta, scale)
    return meta.unpack(out.transpose(1, 2))
