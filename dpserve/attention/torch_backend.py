"""The CPU backend: plain PyTorch, each kind of request by what was measured fastest for it
(docs/benchmarks.md, "Attention on the CPU"):

- one query (decode rows, a verify step's rows, padded rows): grouped-query attention by the fused
  kernel of dpserve/csrc/cpu_ops.cpp where it is built; MLA, and GQA without it, by two batched
  matmuls in all, over (row, KV head) pairs, the query heads of a KV head together (MLA: every head
  on the one latent), softmax in float32. The keys are gathered already grouped by KV head, so every matmul operand is
  contiguous: a bfloat16 bmm on the CPU costs ~20 us a call whatever its size, and several times
  more on strided operands. PyTorch's SDPA kernel is erratic for a single query (two orders slower
  with one KV head, MLA's included).
- several queries (prefill chunks): SDPA's flash kernel, as the sdpa backend runs it, over those
  requests only, so decode rows riding along an extend step are not padded to the chunk's length.
"""

from __future__ import annotations

import functools

import torch

from dpserve import cpu_ops
from dpserve.attention.backend import AttentionMetadata
from dpserve.attention.sdpa import SdpaBackend, softmax_with_sinks
from dpserve.kvcache.pool import ScaledKV, take


class TorchBackend(SdpaBackend):
    graph_max_kv_len = None  # its padded steps run eagerly: no grid fixed at capture

    def prepare(self, meta: AttentionMetadata) -> None:
        s = meta.state
        if meta.max_q_len <= 1:  # every row one query (decode, padded) or none (idle): no split
            s["one"], s["many"] = (None, _Keys(meta)), None
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
            s["one"] = (tokens_one, _Keys(sub_one))

    def mla(self, q, cache, meta, scale, v_dim):
        return self._split(
            q,
            meta,
            v_dim,
            lambda q_one, one: one[1].attend(q_one, cache, None, v_dim, scale),
            lambda q_many, sub: super(TorchBackend, self).mla(q_many, cache, sub, scale, v_dim),
        )

    def gqa(self, q, k_cache, v_cache, meta, scale, window_size=0, sinks=None):
        v_dim = v_cache.shape[-1]
        return self._split(
            q,
            meta,
            v_dim,
            lambda q_one, one: one[1].attend(q_one, k_cache, v_cache, v_dim, scale, window_size, sinks),
            lambda q_many, sub: super(TorchBackend, self).gqa(
                q_many, k_cache, v_cache, sub, scale, window_size, sinks
            ),
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


class _Keys:
    """The keys of one-query rows: each row's slots, and which of its key columns are padding.
    Shared by every layer of a forward."""

    def __init__(self, meta: AttentionMetadata):
        self.meta = meta
        self._rows: dict[int, torch.Tensor] = {}

    @functools.cached_property
    def table(self) -> torch.Tensor:
        m = self.meta
        return m.req_to_token[m.table_rows, : m.max_seq_len].long()  # [n, kv_len]

    @functools.cached_property
    def padding(self) -> torch.Tensor:
        cols = torch.arange(self.meta.max_seq_len, device=self.table.device)
        return cols[None, :] >= self.meta.seq_lens[:, None]

    def rows(self, kv_heads: int) -> torch.Tensor:
        """Rows of a [slots * kv_heads, d] view of a cache, grouped by (row, KV head): [n, kv_heads,
        kv_len]; computed by the first layer that asks."""
        if kv_heads not in self._rows:
            heads = torch.arange(kv_heads, device=self.table.device)
            self._rows[kv_heads] = self.table[:, None, :] * kv_heads + heads[None, :, None]
        return self._rows[kv_heads]

    def attend(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor | None,
        v_dim: int,
        scale: float,
        window_size: int = 0,
        sinks: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Each row's one query q [n, heads, d] against its keys in caches [slots, kv_heads, d] (MLA:
        [slots, d], one KV head); values from `v_cache`, or (MLA) the keys' first `v_dim` columns. Grouped-query attention
        runs the fused CPU kernel where it is built (no gathered copy of the keys, an 8-bit cache's
        codes widened as they are read; not for sliding windows or sinks); MLA's many heads on one latent are a matrix product, faster on oneDNN's
        kernels from batch 16 on (measured)."""
        if v_cache is not None and not window_size and sinks is None and cpu_ops.usable(q):
            m = self.meta
            caches, scales = (k_cache, v_cache), (None, None)
            if isinstance(k_cache, ScaledKV):  # FP8 codes, widened inside the kernel
                caches, scales = (k_cache.codes, v_cache.codes), (k_cache.scales, v_cache.scales)
            return torch.ops.dpserve_cpu.decode_attention(
                q, *caches, m.req_to_token, m.table_rows, m.seq_lens, scale, v_dim, *scales
            )
        return self.matmuls(q, k_cache, v_cache, v_dim, scale, window_size, sinks)

    def matmuls(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor | None,
        v_dim: int,
        scale: float,
        window_size: int = 0,
        sinks: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """`attend` in two batched matmuls over (row, KV head) pairs."""
        n, heads, d = q.shape
        kv_heads = k_cache.shape[1] if len(k_cache.shape) == 3 else 1
        rows = self.rows(kv_heads).reshape(-1)
        pairs = n * kv_heads  # (row, KV head): one matmul each, the KV head's query heads together
        k = take(k_cache, rows, d).view(pairs, -1, d)
        scores = torch.bmm(q.reshape(pairs, heads // kv_heads, d), k.transpose(1, 2)).view(n, heads, -1)
        scores = scores.float().mul_(scale).masked_fill_(self.padding[:, None, :], float("-inf"))
        if window_size:  # the query sits at seq_len - 1: keys before seq_len - window_size are out of sight
            cols = torch.arange(scores.shape[-1], device=scores.device)
            scores.masked_fill_(
                (cols[None, :] < self.meta.seq_lens[:, None] - window_size)[:, None, :], float("-inf")
            )
        probs = scores.softmax(-1) if sinks is None else softmax_with_sinks(scores, sinks[:, None])
        probs = probs.to(q.dtype).reshape(pairs, heads // kv_heads, -1)
        if v_cache is None:  # all the latent's columns: faster than a matmul on a strided slice
            return torch.bmm(probs, k)[..., :v_dim].reshape(n, heads, v_dim)
        v = take(v_cache, rows, v_dim).view(pairs, -1, v_dim)
        return torch.bmm(probs, v).view(n, heads, v_dim)
