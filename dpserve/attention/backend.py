"""The attention interface every backend implements, and the per-step metadata it reads.

A step's batch holds requests with mixed lengths: request b feeds q_len_b new tokens (1 in
decode) at positions seq_len_b - q_len_b .. seq_len_b - 1, and attends to its seq_len_b
cached tokens, found in the KV pool through its row of the request-to-slot table. Every
field is a device tensor, so one captured graph serves any lengths; the model has written
the new tokens' KV to the pool before attention reads it.
"""

from __future__ import annotations

import dataclasses
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from itertools import accumulate

import torch

from dpserve.kvcache.pool import take


@dataclass
class AttentionMetadata:
    req_to_token: torch.Tensor  # [rows, context_len] int32: pool slot of each request's positions
    table_rows: torch.Tensor  # [batch] row of each request (row 0, all zeros, for padded rows)
    seq_lens: torch.Tensor  # [batch] KV tokens of each request, this step's new ones included
    q_start: torch.Tensor  # [batch + 1] first new-token row of each request, cumulative
    num_tokens: int  # new tokens (rows of q)
    max_q_len: int  # bounds on q lengths and seq_lens (fixed in a captured graph)
    max_seq_len: int
    # Host copies of the lengths (eager steps; None in a captured graph): decisions per request
    # without a device sync.
    q_lens_host: list[int] | None = None
    seq_lens_host: list[int] | None = None
    state: dict = field(default_factory=dict)  # what a backend's prepare() derives per forward

    @property
    def batch_size(self) -> int:
        return self.table_rows.shape[0]

    def on_table(self, req_to_token: torch.Tensor) -> AttentionMetadata:
        """The same requests read through another request-to-slot table (the hybrid pool's window
        layers), with a state of their own for the backend's prepare()."""
        return dataclasses.replace(self, req_to_token=req_to_token, state={})

    def token_rows(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(each new token's request, its index among that request's new tokens), on the device."""
        dev = self.table_rows.device
        q_lens = self.q_start[1:] - self.q_start[:-1]
        token_req = torch.repeat_interleave(
            torch.arange(self.batch_size, device=dev), q_lens, output_size=self.num_tokens
        )
        return token_req, torch.arange(self.num_tokens, device=dev) - self.q_start[token_req]

    def select(self, reqs: list[int]) -> tuple[AttentionMetadata, torch.Tensor]:
        """The metadata of requests `reqs` alone, and the rows of their tokens among this batch's."""
        q_lens, seq_lens = self.q_lens_host, self.seq_lens_host
        starts = list(accumulate([0, *q_lens]))
        dev = self.table_rows.device
        idx = torch.tensor(reqs, dtype=torch.long, device=dev)
        sub_q = [q_lens[i] for i in reqs]
        sub = AttentionMetadata(
            self.req_to_token,
            self.table_rows[idx],
            self.seq_lens[idx],
            torch.tensor([0, *accumulate(sub_q)], dtype=torch.int32, device=dev),
            sum(sub_q),
            max(sub_q),
            max(seq_lens[i] for i in reqs),
            sub_q,
            [seq_lens[i] for i in reqs],
        )
        tokens = [t for i in reqs for t in range(starts[i], starts[i + 1])]
        return sub, torch.tensor(tokens, dtype=torch.long, device=dev)


class AttentionBackend(ABC):
    """Attention over the paged KV pool; one instance per model, shared by its layers."""

    # Longest KV a captured decode graph can attend to (None: any, lengths live in device buffers).
    graph_max_kv_len: int | None = None

    def prepare(self, meta: AttentionMetadata) -> None:  # noqa: B027 (optional hook)
        """Derives what the layers share, once per forward (inside a captured graph)."""

    @abstractmethod
    def mla(
        self, q: torch.Tensor, cache: torch.Tensor, meta: AttentionMetadata, scale: float, v_dim: int
    ) -> torch.Tensor:
        """Absorbed MLA: q [tokens, heads, latent + rope] against the cached latent + rope key
        [slots, latent + rope] (one KV head shared by all heads; values are its first v_dim
        columns). Returns [tokens, heads, v_dim]."""

    @abstractmethod
    def gqa(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
        window_size: int = 0,
        sinks: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Grouped-query attention: q [tokens, heads, dim] against k/v [slots, kv_heads, dim].
        `window_size` > 0: each query sees only the last `window_size` positions up to its own (sliding
        window); `sinks` [heads] (float32): a logit per head in the softmax's denominator that
        takes no value (attention sinks)."""

    def index_scores(
        self,
        q: torch.Tensor,
        weights: torch.Tensor,
        keys: torch.Tensor,
        table: torch.Tensor,
        token_req: torch.Tensor,
        q_pos: torch.Tensor,
        seq_lens: torch.Tensor,
        scale: float,
    ) -> torch.Tensor:
        """DeepSeek-V3.2's indexer (models/dsa.py): for query t of request token_req[t] at position
        q_pos[t], and each position j of that request's `table` row (pool slots), `sum_h weights[t,
        h] * relu(scale * q[t, h] . keys[slot])`; -inf past the query or the request's length.
        q [tokens, heads, dim] and weights float32; returns [tokens, table width] float32. Here in
        torch over a gathered copy of the keys; the Triton backend reads them in place."""
        cached = take(keys, table[token_req]).float()  # [tokens, width, dim]
        scores = torch.einsum("thd,tkd->thk", q, cached).mul_(scale).relu_()
        index = torch.einsum("th,thk->tk", weights, scores)
        k_pos = torch.arange(table.shape[1], device=q.device)
        blocked = (k_pos[None, :] > q_pos[:, None]) | (k_pos[None, :] >= seq_lens[token_req, None])
        return index.masked_fill_(blocked, float("-inf"))
