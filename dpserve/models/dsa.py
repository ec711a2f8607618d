"""DeepSeek-V3.2's sparse attention (DSA): a lightning indexer scores every cached token for each
query, and MLA attends only to the `index_topk` best (docs/design.md, section 13).

The indexer's key (`index_head_dim` values per token) is cached in the paged pool beside the MLA
latent, at the same slot: allocated, freed, retracted and prefix-cached with it. Everything here
runs on device tensors with the step's fixed bounds (k = min(index_topk, max_seq_len)), no host
sync; while no request of the step has more than `index_topk` tokens, every key is selected and
MLAAttention runs its dense path instead (equal, as SGLang does).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from dpserve.attention.backend import AttentionBackend, AttentionMetadata
from dpserve.layers.linear import Linear
from dpserve.layers.rotary import RotaryEmbedding
from dpserve.models.loader import Weight

INDEX_NORM_EPS = 1e-6  # the indexer's LayerNorm on its key
CHUNK_TOKENS = 64  # queries scored and attended at a time: scores are [chunk, heads, max_seq_len]


class Indexer(nn.Module):
    """Scores `sum_h w_h * relu(q_h . k * d^-0.5)` of each query against every cached key; its query
    comes from MLA's q latent (after q_a_layernorm), its key and per-head weights from the layer's
    input. Rotary (not interleaved) on the first rope dims of both. Replicated over attention TP:
    the heads are few and small."""

    def __init__(self, hf, hidden: int, rotary: RotaryEmbedding):
        super().__init__()
        self.heads, self.dim, self.topk = hf.index_n_heads, hf.index_head_dim, hf.index_topk
        self.wq_b = Linear(hf.q_lora_rank, self.heads * self.dim)
        self.wk = Linear(hidden, self.dim)
        self.k_norm_weight = nn.Parameter(torch.empty(self.dim), requires_grad=False)
        self.k_norm_bias = nn.Parameter(torch.empty(self.dim), requires_grad=False)
        # Kept in float32: it weighs the heads' scores, whose sum decides the selection.
        self.weights_proj = nn.Parameter(
            torch.empty(self.heads, hidden, dtype=torch.float32), requires_grad=False
        )
        self.rotary = rotary  # qk_rope_head_dim wide: the rest of each head passes through

    def key(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """The indexer key [tokens, dim] of each new token, to cache."""
        k = F.layer_norm(self.wk(x), (self.dim,), self.k_norm_weight, self.k_norm_bias, INDEX_NORM_EPS)
        return self.rotary(k.unsqueeze(1), positions).squeeze(1)

    def select(
        self,
        x: torch.Tensor,
        q_latent: torch.Tensor,
        positions: torch.Tensor,
        keys: torch.Tensor,
        meta: AttentionMetadata,
        backend: AttentionBackend,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The keys each query attends to: (their pool slots [tokens, k], which are real [tokens,
        k]); `keys` is the pool's indexer cache [slots, dim]; `backend` scores them (a Triton kernel
        on the GPU). k = min(index_topk, max_seq_len)."""
        n = x.shape[0]
        q = self.rotary(self.wq_b(q_latent).view(n, self.heads, self.dim), positions).float().contiguous()
        weights = F.linear(x.float(), self.weights_proj) * self.heads**-0.5  # [tokens, heads]
        table, token_req, q_pos = sparse_layout(meta)
        k = min(self.topk, table.shape[1])
        slots, real = [], []
        for lo in range(0, n, CHUNK_TOKENS):
            rows = slice(lo, lo + CHUNK_TOKENS)
            index = backend.index_scores(
                q[rows],
                weights[rows],
                keys,
                table,
                token_req[rows],
                q_pos[rows],
                meta.seq_lens,
                self.dim**-0.5,
            )
            best, picked = index.topk(k, dim=-1)
            slots.append(table[token_req[rows, None], picked])
            real.append(best > float("-inf"))
        return torch.cat(slots), torch.cat(real)

    def weights(self, prefix: str) -> list[Weight]:
        """Replicated on every rank."""
        return [
            Weight(f"{prefix}.wq_b.weight", self.wq_b.weight),
            Weight(f"{prefix}.wk.weight", self.wk.weight),
            Weight(f"{prefix}.k_norm.weight", self.k_norm_weight),
            Weight(f"{prefix}.k_norm.bias", self.k_norm_bias),
            Weight(f"{prefix}.weights_proj.weight", self.weights_proj),
        ]


def sparse_layout(meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(each request's slot table [batch, max_seq_len], each token's request, each token's position),
    derived once per forward and shared by the layers."""
    if "dsa" not in meta.state:
        q_lens = meta.q_start[1:] - meta.q_start[:-1]
        token_req, col = meta.token_rows()
        q_pos = (meta.seq_lens - q_lens)[token_req] + col
        table = meta.req_to_token[meta.table_rows, : meta.max_seq_len].long()
        meta.state["dsa"] = (table, token_req, q_pos)
    return meta.state["dsa"]


def sparse_metadata(slots: torch.Tensor, real: torch.Tensor) -> AttentionMetadata:
    """The selected keys as attention metadata any backend runs (the paged kernels on a GPU): each
    query its own one-token request whose table row is its `slots` [tokens, k], the real ones first
    (top-k returns them in descending score, -inf last), and whose length counts them."""
    n, k = slots.shape
    dev = slots.device
    steps = torch.arange(n + 1, dtype=torch.int32, device=dev)
    return AttentionMetadata(
        req_to_token=slots.int(),
        table_rows=steps[:-1],
        seq_lens=real.sum(-1, dtype=torch.int32),
        q_start=steps,
        num_tokens=n,
        max_q_len=1,
        max_seq_len=k,
    )
