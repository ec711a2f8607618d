"""The GPU backend: Triton paged-attention kernels reading the KV pool through the
request-to-slot table (see `triton_kernels`). Also runs on the CPU in Triton's interpreter."""

from __future__ import annotations

import dataclasses

import torch

from dpserve.attention.backend import AttentionBackend, AttentionMetadata
from dpserve.attention.index_kernel import index_scores
from dpserve.attention.triton_kernels import decode_attention, extend_attention
from dpserve.kvcache.pool import ScaledKV


def one_kv_head(cache: torch.Tensor | ScaledKV, width: int | None = None) -> torch.Tensor | ScaledKV:
    """MLA's cache [slots, latent + rope] as one KV head, [slots, 1, width] (its first `width`
    columns; all by default): views, an 8-bit cache's codes and scales alike."""
    if isinstance(cache, ScaledKV):
        return dataclasses.replace(cache, codes=cache.codes[:, None, :width], scales=cache.scales[:, None])
    return cache[:, None, :width]


class TritonBackend(AttentionBackend):
    """Decode kernel (split-K) when every request feeds exactly one token, extend kernel otherwise.

    num_kv_splits: context slices per request in decode; by default `launch_config` chooses them
    from the step's longest context, heads per KV head and the device's SMs."""

    def __init__(self, num_kv_splits: int | None = None):
        self.num_kv_splits = num_kv_splits

    def mla(self, q, cache, meta, scale, v_dim):
        return self._attend(q, one_kv_head(cache), one_kv_head(cache, v_dim), meta, scale)

    def gqa(self, q, k_cache, v_cache, meta, scale, window_size=0, sinks=None):
        return self._attend(q, k_cache, v_cache, meta, scale, window_size, sinks)

    index_scores = staticmethod(index_scores)  # the indexer's kernel, reading keys by slot

    def _attend(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
        window_size: int = 0,
        sinks: torch.Tensor | None = None,
    ) -> torch.Tensor:
        out = q.new_empty((q.shape[0], q.shape[1], v.shape[-1]))
        common = (q, k, v, meta.req_to_token, meta.table_rows, meta.seq_lens)
        # Both are ints fixed per step (and per captured graph): one token per request exactly.
        if meta.max_q_len == 1 and meta.num_tokens == meta.batch_size:
            return decode_attention(
                *common,
                out,
                scale,
                num_kv_splits=self.num_kv_splits,
                max_seq_len=meta.max_seq_len,
                window_size=window_size,
                sinks=sinks,
            )
        return extend_attention(
            *common, meta.q_start, out, scale, meta.max_q_len, window_size=window_size, sinks=sinks
        )
