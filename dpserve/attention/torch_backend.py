"""The CPU backend: plain PyTorch, each kind of request by what was measured fastest for it
(docs/benchmarks.md, "Attention on the CPU"):

- one query (decode rows, a verify step's rows, padded rows): two batched matmuls over the row's
  gathered keys, the query heads of each KV head together (MLA: every head on the one latent),
  softmax in float32. PyTorch's SDPA kernel pays a fixed cost per (request, head) for a single
  query, its bfloat16 path is slower still, and at MLA's 576-wide heads it is two orders slower.
- several queries (prefill chunks): SDPA's flash kernel, as the sdpa backend runs it, over those
  requests only, so decode rows riding along an extend step are not padded to the chunk's length.
"""

from __future__ import annotations

import torch

from dpserve.attention.backend import AttentionMetadata
from dpserve.attention.sdpa import SdpaBackend, gather


class TorchBackend(SdpaBackend):
    graph_max_kv_len = None  # its padded steps run eagerly: no grid fixed at capture

    def prepare(self, meta: AttentionMetadata) -> None:
        s = meta.state
        if meta.max_q_len <= 1:  # every row one query (decode, padded) or none (idle): no split
            s["one"], s["many"] = (None, *_keys(meta)), None
            return
        q_lens = meta.q_lens_host
        one = [i for i, n in enumerate(q_lens) if n == 1]
        many = [i for i, n in enumerate(q_lens) if n > 1]
        sub, tokens = meta.select(many)
        super().prepare(sub)  # SDPA's state for the multi-query requests
        s["many"] = (sub, tokens)
        s["one"] = None
        if one:
            sub_one, tokens_one = meta.select(one)
            s["one"] = (tokens_one, *_keys(sub_one))

    def mla(self, q, cache, meta, scale, v_dim):
        kv = cache.unsqueeze(1)  # the latent: one KV head, values its first v_dim columns
        return self._split(
            q,
            meta,
            v_dim,
            lambda q_one, one: _one_query(q_one, kv, None, v_dim, one[1], one[2], scale),
            lambda q_many, sub: super(TorchBackend, self).mla(q_many, cache, sub, scale, v_dim),
        )

    def gqa(self, q, k_cache, v_cache, meta, scale):
        v_dim = v_cache.shape[-1]
        return self._split(
            q,
            meta,
            v_dim,
            lambda q_one, one: _one_query(q_one, k_cache, v_cache, v_dim, one[1], one[2], scale),
            lambda q_many, sub: super(TorchBackend, self).gqa(q_many, k_cache, v_cache, sub, scale),
        )

    @staticmethod
    def _split(q, meta, v_dim, one_query, many_queries) -> torch.Tensor:
        """One-query rows by `one_query`, the rest by `many_queries` (the reference backend on just
        those requests), written back in the batch's row order."""
        one, many = meta.state["one"], meta.state["many"]
        if many is None:
            return one_query(q, one)
        out = q.new_empty((*q.shape[:2], v_dim))
        sub, tokens = many
        out[tokens] = many_queries(q[tokens], sub)
        if one is not None:
            out[one[0]] = one_query(q[one[0]], one)
        return out


def _keys(meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
    """Each request's slot table [batch, max_seq_len] and which of its keys are real."""
    table = meta.req_to_token[meta.req_idx, : meta.max_seq_len]
    valid = torch.arange(meta.max_seq_len, device=table.device)[None, :] < meta.seq_lens[:, None]
    return table, valid


def _one_query(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor | None,
    v_dim: int,
    table: torch.Tensor,
    valid: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Each row's one query q [n, heads, d] against its keys `table` [n, kv_len] (`valid` marks
    the real ones) in caches [slots, kv_heads, d]; values from `v_cache`, or (MLA) the keys' first
    `v_dim` columns. The heads of a KV head share one [n, group, d] x [n, d, kv_len] matmul."""
    k = gather(k_cache, table)  # [n, kv_len, kv_heads, d]
    v = k[..., :v_dim] if v_cache is None else gather(v_cache, table)
    kv_heads = k.shape[2]
    group = q.shape[1] // kv_heads
    outs = []
    for h in range(kv_heads):
        qh = q[:, h * group : (h + 1) * group]
        scores = torch.bmm(qh, k[:, :, h].transpose(1, 2)).float() * scale  # [n, group, kv_len]
        scores.masked_fill_(~valid[:, None, :], float("-inf"))
        probs = scores.softmax(-1).to(v.dtype)
        outs.append(torch.bmm(probs, v[:, :, h]))  # [n, group, v_dim]
    return outs[0] if kv_heads == 1 else torch.cat(outs, dim=1)
