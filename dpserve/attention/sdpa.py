"""The reference backend: each request's KV gathered from the pool (`take`: widened from an 8-bit
pool) into a [batch, max_seq_len] grid and PyTorch's scaled_dot_product_attention with a mask (causality and padding)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from dpserve.attention.backend import AttentionBackend, AttentionMetadata
from dpserve.kvcache.pool import take


class SdpaBackend(AttentionBackend):
    graph_max_kv_len = 4096  # a graph's [batch, kv_len] grid is fixed at capture

    def prepare(self, meta: AttentionMetadata) -> None:
        dev = meta.table_rows.device
        q_lens = meta.q_start[1:] - meta.q_start[:-1]
        token_req, token_col = meta.token_rows()
        prefix = (meta.seq_lens - q_lens)[:, None, None]
        q_pos = torch.arange(meta.max_q_len, device=dev)[None, :, None] + prefix
        k_pos = torch.arange(meta.max_seq_len, device=dev)[None, None, :]
        meta.state.update(
            slot_table=meta.req_to_token[meta.table_rows, : meta.max_seq_len].long(),
            mask=((k_pos <= q_pos) & (k_pos < meta.seq_lens[:, None, None])).unsqueeze(1),
            behind=(q_pos - k_pos).unsqueeze(1),  # how far each key is behind each query
            token_req=token_req,
            token_col=token_col,
        )

    def mla(self, q, cache, meta, scale, v_dim):
        kv = take(cache, meta.state["slot_table"]).unsqueeze(1)  # [batch, 1, kv_max, latent + rope]
        return self._attend(q, kv, kv[..., :v_dim], meta, scale)

    def gqa(self, q, k_cache, v_cache, meta, scale, window_size=0, sinks=None):
        table = meta.state["slot_table"]
        k = take(k_cache, table).transpose(1, 2)  # [batch, kv_heads, kv_max, dim]
        return self._attend(q, k, take(v_cache, table).transpose(1, 2), meta, scale, window_size, sinks)

    @staticmethod
    def _attend(
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
        window_size: int = 0,
        sinks: torch.Tensor | None = None,
    ):
        """q [tokens, heads, d] packed into [batch, heads, q_max, d]; k/v [batch, kv_heads, kv_max, d]:
        kv_heads divides heads (grouped-query, or MLA's one latent), never expanded in memory (but
        with sinks, which SDPA does not take)."""
        s = meta.state
        packed = q.new_zeros((meta.batch_size, meta.max_q_len, *q.shape[1:]))
        packed[s["token_req"], s["token_col"]] = q
        mask = s["mask"] & (s["behind"] < window_size) if window_size else s["mask"]
        if sinks is None:
            out = F.scaled_dot_product_attention(
                packed.transpose(1, 2), k, v, attn_mask=mask, scale=scale, enable_gqa=k.shape[1] != q.shape[1]
            )
        else:
            out = attend_with_sinks(packed.transpose(1, 2), k, v, mask, scale, sinks)
        return out.transpose(1, 2)[s["token_req"], s["token_col"]]


def attend_with_sinks(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float, sinks: torch.Tensor
) -> torch.Tensor:
    """Attention whose softmax has one more logit per head, `sinks` [heads], that takes no value:
    q [batch, heads, q_len, d], k/v [batch, kv_heads, kv_len, d], mask [batch, 1, q_len, kv_len]
    (True: attend). A row with every key masked gets zeros, never NaN."""
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    scores = torch.matmul(q, k.transpose(-1, -2)).float().mul_(scale).masked_fill_(~mask, float("-inf"))
    return torch.matmul(softmax_with_sinks(scores, sinks[:, None, None]).to(v.dtype), v)


def softmax_with_sinks(scores: torch.Tensor, sinks: torch.Tensor) -> torch.Tensor:
    """softmax over the last dim of float32 `scores` with one more logit, `sinks` (broadcast to
    scores[..., :1]), that takes no value: its share is dropped, so rows sum to less than 1."""
    sink = sinks.float().expand(*scores.shape[:-1], 1)
    return torch.cat([scores, sink], dim=-1).softmax(-1)[..., :-1]
