"""Routed experts with fixed shapes: each token does its top_k experts' work, no more, in eager
mode and inside a captured CUDA graph alike.

The (token, k) assignments are sorted by expert into blocks of `block_m` rows, each expert's
rows padded to a whole number of blocks (`moe_align_block_size`). The buffers are sized for the
worst case, rows * top_k + experts * (block_m - 1) rows, so their shapes depend only on the
row count; blocks past the used ones are skipped. A grouped GEMM in two Triton kernels: the
first computes gate and up for a block of rows against its expert's w13 and writes
SiLU(gate) * up; the second multiplies by the expert's w2 and scales by the routing weight. The
top_k results of a token are then summed. (The CPU runs `dpserve.layers.mlp.experts_loop`
instead: Triton's interpreter is too slow to serve.)

Weights follow `dpserve.layers.mlp.MoE`: w13 [experts, 2 * inter, hidden] (gate rows, then up
rows) and w2 [experts, hidden, inter].
"""

from __future__ import annotations

import torch

from dpserve.layers.quant_triton import (
    activations,
    block_k,
    precision,
    scaled_sums,
    tile_step,
    weight_args,
    weight_format,
    zero_sums,
)
from dpserve.triton_setup import tl, triton


def moe_align_block_size(
    topk_ids: torch.Tensor, num_experts: int, block_m: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Sorts the (token, k) assignments by expert into padded blocks of `block_m` rows.

    topk_ids [rows, top_k]: the chosen experts; ids outside [0, num_experts) are dropped (their
    assignment contributes nothing). Returns, with shapes set by rows * top_k alone:
    - sorted_ids [num_blocks * block_m] int64: the flat assignment index (row * top_k + k) of each
      block row, expert by expert in token order; padding rows hold rows * top_k.
    - expert_ids [num_blocks] int64: each block's expert, -1 for unused blocks.
    - num_padded [1] int64: rows in used blocks (the used blocks come first).
    num_blocks = cdiv(rows * top_k + num_experts * (block_m - 1), block_m).
    """
    dev = topk_ids.device
    n = topk_ids.numel()
    num_blocks = triton.cdiv(n + num_experts * (block_m - 1), block_m)
    flat = topk_ids.reshape(-1).long()
    key = torch.where((flat >= 0) & (flat < num_experts), flat, num_experts)  # num_experts: dropped
    counts = torch.zeros(num_experts + 1, dtype=torch.long, device=dev).scatter_add_(
        0, key, torch.ones_like(key)
    )
    padded = torch.cat([(counts[:-1] + block_m - 1) // block_m * block_m, counts[-1:].new_zeros(1)])
    ends = padded.cumsum(0)
    starts = ends - padded
    order = torch.argsort(key, stable=True)
    sorted_key = key[order]
    first = counts.cumsum(0) - counts  # index in `order` of each expert's first assignment
    dest = starts[sorted_key] + torch.arange(n, device=dev) - first[sorted_key]
    dest = torch.where(sorted_key < num_experts, dest, num_blocks * block_m)  # dropped: a spare slot
    sorted_ids = torch.full((num_blocks * block_m + 1,), n, dtype=torch.long, device=dev)
    sorted_ids.scatter_(0, dest, order)
    block_start = torch.arange(num_blocks, device=dev) * block_m
    expert_ids = torch.searchsorted(ends[:-1], block_start, right=True)
    expert_ids = torch.where(expert_ids < num_experts, expert_ids, -1)
    return sorted_ids[:-1], expert_ids, ends[-2:-1].clone()


@triton.jit
def _gate_up_kernel(
    X,
    XScale,
    W13,
    WScale,
    RowBlock,
    ColBlock,
    B13,
    Inter,
    SortedIds,
    ExpertIds,
    NumPadded,
    num_valid,
    hidden,
    inter,
    stride_xm,
    stride_as,
    stride_we,
    stride_wn,
    stride_se,
    stride_s0,
    stride_s1,
    stride_be,
    stride_im,
    alpha,
    limit,
    TOP_K: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    CLAMPED: tl.constexpr,
    WFORMAT: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    PRECISION: tl.constexpr,
    UPCAST: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    if pid_m * BLOCK_M < tl.load(NumPadded):
        e = tl.load(ExpertIds + pid_m).to(tl.int64)
        ids = tl.load(SortedIds + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))
        mask_m = ids < num_valid
        tok = ids // TOP_K
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        mask_n = offs_n < inter
        w_ptr, s_ptr = W13 + e * stride_we, WScale + e * stride_se
        acc_g = zero_sums(BLOCK_M, BLOCK_N, WFORMAT)
        acc_u = zero_sums(BLOCK_M, BLOCK_N, WFORMAT)
        for k0 in range(0, hidden, BLOCK_K):
            offs_k = k0 + tl.arange(0, BLOCK_K)
            mask_k = offs_k < hidden
            a = tl.load(
                X + tok[:, None] * stride_xm + offs_k[None, :],
                mask=mask_m[:, None] & mask_k[None, :],
                other=0,
            )
            acc_g = tile_step(
                acc_g,
                a,
                w_ptr,
                s_ptr,
                RowBlock,
                ColBlock,
                offs_n,
                offs_k,
                mask_n,
                mask_k,
                k0,
                XScale,
                tok,
                mask_m,
                stride_as,
                stride_wn,
                stride_s0,
                stride_s1,
                WFORMAT,
                PRECISION,
                UPCAST,
                BLOCK_K,
            )
            acc_u = tile_step(
                acc_u,
                a,
                w_ptr,
                s_ptr,
                RowBlock,
                ColBlock,
                offs_n + inter,
                offs_k,
                mask_n,
                mask_k,
                k0,
                XScale,
                tok,
                mask_m,
                stride_as,
                stride_wn,
                stride_s0,
                stride_s1,
                WFORMAT,
                PRECISION,
                UPCAST,
                BLOCK_K,
            )
        acc_g = scaled_sums(
            acc_g, XScale, tok, mask_m, stride_as, s_ptr, RowBlock, offs_n, mask_n, stride_s0, WFORMAT
        )
        acc_u = scaled_sums(
            acc_u, XScale, tok, mask_m, stride_as, s_ptr, RowBlock, offs_n + inter, mask_n, stride_s0, WFORMAT
        )
        if HAS_BIAS:
            b_ptr = B13 + e * stride_be + offs_n
            acc_g += tl.load(b_ptr, mask=mask_n, other=0.0).to(tl.float32)[None, :]
            acc_u += tl.load(b_ptr + inter, mask=mask_n, other=0.0).to(tl.float32)[None, :]
        if CLAMPED:  # gpt-oss: (clamp(up) + 1) * g * sigmoid(alpha * g), g = min(gate, limit)
            g = tl.minimum(acc_g, limit)
            u = tl.minimum(tl.maximum(acc_u, -limit), limit)
            h = (u + 1.0) * g / (1.0 + tl.exp(-alpha * g))
        else:
            h = acc_g / (1.0 + tl.exp(-acc_g)) * acc_u
        out_ptr = Inter + ids[:, None] * stride_im + offs_n[None, :]
        tl.store(out_ptr, h.to(Inter.dtype.element_ty), mask=mask_m[:, None] & mask_n[None, :])


@triton.jit
def _down_kernel(
    Inter,
    InterScale,
    W2,
    WScale,
    RowBlock,
    ColBlock,
    B2,
    Out,
    Weights,
    SortedIds,
    ExpertIds,
    NumPadded,
    num_valid,
    hidden,
    inter,
    stride_im,
    stride_as,
    stride_we,
    stride_wn,
    stride_se,
    stride_s0,
    stride_s1,
    stride_be,
    stride_om,
    HAS_BIAS: tl.constexpr,
    WFORMAT: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    PRECISION: tl.constexpr,
    UPCAST: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    if pid_m * BLOCK_M < tl.load(NumPadded):
        e = tl.load(ExpertIds + pid_m).to(tl.int64)
        ids = tl.load(SortedIds + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))
        mask_m = ids < num_valid
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        mask_n = offs_n < hidden
        w_ptr, s_ptr = W2 + e * stride_we, WScale + e * stride_se
        acc = zero_sums(BLOCK_M, BLOCK_N, WFORMAT)
        for k0 in range(0, inter, BLOCK_K):
            offs_k = k0 + tl.arange(0, BLOCK_K)
            mask_k = offs_k < inter
            a = tl.load(
                Inter + ids[:, None] * stride_im + offs_k[None, :],
                mask=mask_m[:, None] & mask_k[None, :],
                other=0,
            )
            acc = tile_step(
                acc,
                a,
                w_ptr,
                s_ptr,
                RowBlock,
                ColBlock,
                offs_n,
                offs_k,
                mask_n,
                mask_k,
                k0,
                InterScale,
                ids,
                mask_m,
                stride_as,
                stride_wn,
                stride_s0,
                stride_s1,
                WFORMAT,
                PRECISION,
                UPCAST,
                BLOCK_K,
            )
        acc = scaled_sums(
            acc, InterScale, ids, mask_m, stride_as, s_ptr, RowBlock, offs_n, mask_n, stride_s0, WFORMAT
        )
        if HAS_BIAS:
            acc += tl.load(B2 + e * stride_be + offs_n, mask=mask_n, other=0.0).to(tl.float32)[None, :]
        acc *= tl.load(Weights + ids, mask=mask_m, other=0.0).to(tl.float32)[:, None]
        out_ptr = Out + ids[:, None] * stride_om + offs_n[None, :]
        tl.store(out_ptr, acc.to(Out.dtype.element_ty), mask=mask_m[:, None] & mask_n[None, :])


def default_block_m(x: torch.Tensor, w13: torch.Tensor, top_k: int) -> int:
    """Rows per expert block: 16 when few assignments per expert (decode), 64 in prefill."""
    return 16 if x.shape[0] * top_k <= 4 * w13.shape[0] else 64


def fused_experts(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    block_m: int | None = None,
    b13: torch.Tensor | None = None,
    b2: torch.Tensor | None = None,
    clamp: tuple[float, float] | None = None,
) -> torch.Tensor:
    """The routed experts' weighted sum for each row, doing only the chosen experts' work.

    x [rows, hidden]; w13 [experts, 2 * inter, hidden] (gate rows, then up rows); w2 [experts,
    hidden, inter]; topk_weights, topk_ids [rows, top_k] from the router (ids outside
    [0, experts) are skipped, e.g. for padded rows). Returns [rows, hidden] in x's dtype:
    sum over k of topk_weights[:, k] * w2[e] @ (SiLU(w13[e, :inter] @ x) * w13[e, inter:] @ x),
    e = topk_ids[:, k]. Every shape depends on rows, top_k and the weights' shapes only (graph
    capturable); interpreted on CPU-only machines. gpt-oss: biases b13 [experts, 2 * inter] and b2
    [experts, hidden] added to the two products, and `clamp` = (alpha, limit) for its clamped
    SwiGLU in place of SiLU (`dpserve.layers.mlp.swiglu_clamped`).
    """
    rows, hidden = x.shape
    num_experts, two_inter, _ = w13.shape
    inter = two_inter // 2
    top_k = topk_ids.shape[1]
    assert w13.shape[2] == hidden and w2.shape == (num_experts, hidden, inter)
    if rows == 0:
        return x.new_zeros(0, hidden)
    block_m = block_m or default_block_m(x, w13, top_k)
    sorted_ids, expert_ids, num_padded = moe_align_block_size(topk_ids, num_experts, block_m)
    routing = (topk_weights, sorted_ids, expert_ids, num_padded, top_k, block_m)
    out = _triton_experts(x, w13, w2, b13, b2, clamp, *routing)
    return out.view(rows, top_k, hidden).sum(1)


def _triton_experts(
    x, w13, w2, b13, b2, clamp, topk_weights, sorted_ids, expert_ids, num_padded, top_k, block_m
):
    rows, hidden = x.shape
    inter = w2.shape[2]
    assert block_m >= 16, "tl.dot needs blocks of at least 16 rows"
    assert x.stride(1) == 1
    n = rows * top_k
    num_blocks = expert_ids.shape[0]
    prec, upcast = precision(x)
    block_n = 64
    h = x.new_empty((n, inter))
    has_bias = b13 is not None
    alpha, limit = clamp or (1.0, 0.0)
    a, a_scale = activations(x, w13)
    w13_args, w2_args = weight_args(w13), weight_args(w2)
    _gate_up_kernel[(num_blocks, triton.cdiv(inter, block_n))](
        a,
        a_scale,
        *w13_args[:4],
        b13 if has_bias else x,
        h,
        sorted_ids,
        expert_ids,
        num_padded,
        n,
        hidden,
        inter,
        a.stride(0),
        a_scale.stride(0),
        *w13_args[4:],
        b13.stride(0) if has_bias else 0,
        h.stride(0),
        alpha,
        limit,
        TOP_K=top_k,
        HAS_BIAS=has_bias,
        CLAMPED=clamp is not None,
        WFORMAT=weight_format(w13),
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_K=block_k(w13),
        PRECISION=prec,
        UPCAST=upcast,
    )
    # Zeroed: assignments to dropped experts are never written and must add nothing.
    out = x.new_zeros((n, hidden))
    h, h_scale = activations(h, w2)
    _down_kernel[(num_blocks, triton.cdiv(hidden, block_n))](
        h,
        h_scale,
        *w2_args[:4],
        b2 if has_bias else x,
        out,
        topk_weights.reshape(-1),
        sorted_ids,
        expert_ids,
        num_padded,
        n,
        hidden,
        inter,
        h.stride(0),
        h_scale.stride(0),
        *w2_args[4:],
        b2.stride(0) if has_bias else 0,
        out.stride(0),
        HAS_BIAS=has_bias,
        WFORMAT=weight_format(w2),
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_K=block_k(w2),
        PRECISION=prec,
        UPCAST=upcast,
    )
    return out
