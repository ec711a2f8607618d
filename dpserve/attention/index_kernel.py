"""DeepSeek-V3.2's lightning-indexer scores in Triton, reading the indexer keys from the paged pool
by slot (no gathered [tokens, context, dim] copy, as the torch path makes).

For query t of request r (at position q_pos[t]) and each position j of r's table row:
`index[t, j] = sum_h w[t, h] * relu(scale * q[t, h] . key[table[r, j]])`, -inf where j is past the
query (causal) or past r's length. One program per (query, block of positions): the query's heads
as one [heads, dim] block against the block's keys, one tl.dot, float32 throughout. The grid
depends on the query count and the table's width only, so a captured graph serves any lengths.
"""

from __future__ import annotations

import torch

from dpserve.attention.triton_kernels import _dot_precision, _kv_scales, _load_kv, cache_parts
from dpserve.triton_setup import INTERPRET, tl, triton

BLOCK_N = 32 if INTERPRET else 64  # positions per program


@triton.jit(do_not_specialize=["width"])
def _index_kernel(
    Q,
    W,
    Keys,
    KeyScales,
    Table,
    TokenReq,
    QPos,
    SeqLens,
    Out,
    scale,
    width,
    stride_qt,
    stride_qh,
    stride_wt,
    stride_ks,
    stride_kss,
    stride_tb,
    stride_ot,
    HEADS: tl.constexpr,
    DIM: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr,
    PRECISION: tl.constexpr,
    MANTISSA: tl.constexpr,  # an 8-bit pool's FP8 format (mantissa bits); 0 otherwise
):
    t = tl.program_id(0)
    nb = tl.program_id(1)
    req = tl.load(TokenReq + t).to(tl.int64)
    q_pos = tl.load(QPos + t)
    seq_len = tl.load(SeqLens + req)
    offs_n = nb * BLOCK_N + tl.arange(0, BLOCK_N)
    visible = (offs_n <= q_pos) & (offs_n < seq_len)
    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    mask_h = offs_h < HEADS
    mask_d = offs_d < DIM
    q = tl.load(
        Q + t.to(tl.int64) * stride_qt + offs_h[:, None] * stride_qh + offs_d[None, :],
        mask=mask_h[:, None] & mask_d[None, :],
        other=0.0,
    ).to(tl.float32)
    slots = tl.load(Table + req * stride_tb + offs_n, mask=visible, other=0).to(tl.int64)
    ks = _kv_scales(KeyScales, slots, 0, stride_kss, 0, visible, MANTISSA)[None, :]
    k = _load_kv(
        Keys + slots[None, :] * stride_ks + offs_d[:, None],
        visible[None, :] & mask_d[:, None],
        ks,
        MANTISSA,
        tl.float32,
    ).to(tl.float32)
    scores = tl.maximum(tl.dot(q, k, input_precision=PRECISION) * scale, 0.0)  # [heads, positions]
    w = tl.load(W + t.to(tl.int64) * stride_wt + offs_h, mask=mask_h, other=0.0)
    index = tl.sum(scores * w[:, None], 0)
    tl.store(
        Out + t.to(tl.int64) * stride_ot + offs_n,
        tl.where(visible, index, float("-inf")),
        mask=offs_n < width,
    )


def index_scores(
    q: torch.Tensor,
    weights: torch.Tensor,
    keys: torch.Tensor,
    table: torch.Tensor,
    token_req: torch.Tensor,
    q_pos: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """q [tokens, heads, dim] (float32), weights [tokens, heads] (float32), keys [slots, dim] (the
    pool's indexer cache; an 8-bit pool's `ScaledKV` is read in place), table [requests, width] (pool slots by position), token_req / q_pos
    [tokens], seq_lens [requests]. Returns the index [tokens, width], float32."""
    n, heads, dim = q.shape
    width = table.shape[1]
    precision = _dot_precision(keys.dtype)  # the model's (an 8-bit pool's readers widen to it)
    keys, key_scales, mantissa = cache_parts(keys)
    out = torch.empty(n, width, dtype=torch.float32, device=q.device)
    if n == 0 or width == 0:
        return out
    grid = (n, triton.cdiv(width, BLOCK_N))
    _index_kernel[grid](
        q,
        weights,
        keys,
        key_scales,
        table,
        token_req,
        q_pos,
        seq_lens,
        out,
        scale,
        width,
        q.stride(0),
        q.stride(1),
        weights.stride(0),
        keys.stride(0),
        key_scales.stride(0),
        table.stride(0),
        out.stride(0),
        HEADS=heads,
        DIM=dim,
        BLOCK_H=max(16, triton.next_power_of_2(heads)),
        BLOCK_D=max(16, triton.next_power_of_2(dim)),
        BLOCK_N=BLOCK_N,
        PRECISION=precision,
        MANTISSA=mantissa,
    )
    return out
