"""Triton GEMMs for 8-bit weights (`dpserve.layers.quant`): a linear layer's here, and the fused
MoE's (`dpserve.layers.fused_moe`) through the same tile helpers.

- Block FP8, weight-only: a tile of codes widened with integer ops (`widen_fp8`, so every GPU,
  sm80 without FP8 conversions included, and the interpreter run it), times each element's block
  scale looked up through the row and column block tables (a rank's part may start inside a block:
  any TP split), rounded to the activations' dtype, then an ordinary dot summed in float32: the
  values of the plain form `quant.fp8_linear`.
- W8A8-INT8: activations quantized per row (`quant.quantize_rows_int8`, the CPU's codes), int8 x
  int8 dots summed exactly in int32, then each row's activation scale and each output column's
  weight scale applied in float32: the CPU kernels' bits.

- Block FP8 with FP8 dots (DeepSeek's w8a8 recipe, on GPUs with FP8 dots: `QuantizedWeight.group`
  set at load): activations quantized per 1 x group columns (`quant.quantize_groups_fp8`), a tile
  of K = one column block, its FP8 dot summed in float32 and times the row's group scale and the
  column's block scale.

`WFORMAT` (a kernel's constexpr) says which: 0 weights as stored in the model's dtype, 1 block
FP8 weight-only, 2 int8, 3 block FP8 with FP8 dots.
"""

from __future__ import annotations

import torch

from dpserve.layers.quant import FP8, INT8, QuantizedWeight, quantize_groups_fp8, quantize_rows_int8
from dpserve.triton_setup import INTERPRET, tl, triton, widen_fp8

BLOCK_K = 64  # int8 dots need K >= 32


def weight_format(w: torch.Tensor | QuantizedWeight) -> int:
    """WFORMAT of a weight: 0 as stored, 1 block FP8 weight-only, 2 int8, 3 block FP8 with FP8 dots."""
    if not isinstance(w, QuantizedWeight):
        return 0
    if w.q.dtype == INT8:
        return 2
    return 3 if w.group else 1


def block_k(w: torch.Tensor | QuantizedWeight) -> int:
    """A tile's K: one activation group (one column block) under FP8 dots."""
    return w.group if weight_format(w) == 3 else BLOCK_K


def weight_args(w: torch.Tensor | QuantizedWeight) -> tuple:
    """What a kernel reads of a weight ([n, k], or [experts, n, k]): codes (FP8 as uint8), scales,
    row and column blocks, then the strides of an expert's and a row's codes and of an expert's, a
    row block's and a column block's scales. A plain weight stands in for the tables it does not
    have (never read)."""
    if not isinstance(w, QuantizedWeight):
        assert w.stride(-1) == 1
        return w, w, w, w, *w.stride()[:-1], 0, 0, 0
    codes = w.q.view(torch.uint8) if w.q.dtype == FP8 else w.q  # bit patterns: see group_dot
    assert codes.stride(-1) == 1
    scale_strides = w.scale.stride() if w.scale.dim() == 3 else (0, *w.scale.stride())
    return codes, w.scale, w.row_block, w.col_block, *codes.stride()[:-1], *scale_strides


def precision(x: torch.Tensor) -> tuple[str, bool]:
    """(the dots' input precision, whether tiles are widened to float32 first: the interpreter's
    bfloat16 dot is wrong)."""
    return ("ieee" if x.dtype == torch.float32 else "tf32"), INTERPRET and x.dtype == torch.bfloat16


@triton.jit
def zero_sums(BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, WFORMAT: tl.constexpr):
    """A tile's sums: int32 for int8 dots, float32 otherwise."""
    if WFORMAT == 2:
        return tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.int32)
    else:
        return tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)


@triton.jit
def weight_tile(
    W,
    WScale,
    RowBlock,
    ColBlock,
    offs_n,
    offs_k,
    mask_n,
    mask_k,
    stride_wn,
    stride_s0,
    stride_s1,
    WFORMAT: tl.constexpr,
):
    """The [BLOCK_K, BLOCK_N] tile of W.T (W [N, K], rows `stride_wn` apart; W and WScale at the
    expert's): as stored (WFORMAT 0), FP8 codes widened times their blocks' scales in float32 (1),
    int8 codes (2, scaled after the sums)."""
    mask = mask_k[:, None] & mask_n[None, :]
    w = tl.load(W + offs_n[None, :].to(tl.int64) * stride_wn + offs_k[:, None], mask=mask, other=0)
    if WFORMAT == 1:
        rb = tl.load(RowBlock + offs_n, mask=mask_n, other=0)
        cb = tl.load(ColBlock + offs_k, mask=mask_k, other=0)
        s = tl.load(WScale + rb[None, :] * stride_s0 + cb[:, None] * stride_s1, mask=mask, other=0.0)
        w = widen_fp8(w, 3) * s
    return w


@triton.jit
def tile_dot(sums, a, w, WFORMAT: tl.constexpr, PRECISION: tl.constexpr, UPCAST: tl.constexpr):
    """sums + a @ w: int8 codes summed exactly in int32 (WFORMAT 2); otherwise w rounded to a's
    dtype (the model's, as the plain form dequantizes) and summed in float32."""
    if WFORMAT == 2:
        return sums + tl.dot(a, w, out_dtype=tl.int32)
    else:
        w = w.to(a.dtype)
        if UPCAST:
            a = a.to(tl.float32)
            w = w.to(tl.float32)
        return sums + tl.dot(a, w, input_precision=PRECISION)


@triton.jit
def group_dot(
    sums,
    a,
    w,
    AScale,
    a_rows,
    mask_m,
    stride_as,
    k0,
    WScale,
    RowBlock,
    ColBlock,
    offs_n,
    mask_n,
    stride_s0,
    stride_s1,
    BLOCK_K: tl.constexpr,
):
    """sums + the FP8 dot of one column block (WFORMAT 3) times each row's scale for that group and
    each column's scale for that block."""
    a_s = tl.load(AScale + a_rows * stride_as + k0 // BLOCK_K, mask=mask_m, other=0.0)
    rb = tl.load(RowBlock + offs_n, mask=mask_n, other=0)
    w_s = tl.load(WScale + rb * stride_s0 + tl.load(ColBlock + k0) * stride_s1, mask=mask_n, other=0.0)
    # The codes travel as uint8 (a masked load's zero is an integer) and are bitcast for the dot.
    dot = tl.dot(a.to(tl.float8e4nv, bitcast=True), w.to(tl.float8e4nv, bitcast=True))
    return sums + dot * a_s[:, None] * w_s[None, :]


@triton.jit
def tile_step(
    sums,
    a,
    W,
    WScale,
    RowBlock,
    ColBlock,
    offs_n,
    offs_k,
    mask_n,
    mask_k,
    k0,
    AScale,
    a_rows,
    mask_m,
    stride_as,
    stride_wn,
    stride_s0,
    stride_s1,
    WFORMAT: tl.constexpr,
    PRECISION: tl.constexpr,
    UPCAST: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """One K step of a GEMM over an 8-bit (or plain) weight: the W.T tile at (offs_k, offs_n) in its
    form (`weight_tile`) and its dot with `a`, summed into `sums` (`group_dot` under FP8 dots,
    `tile_dot` otherwise). The linear kernel and both fused MoE kernels take their steps here."""
    w = weight_tile(
        W,
        WScale,
        RowBlock,
        ColBlock,
        offs_n,
        offs_k,
        mask_n,
        mask_k,
        stride_wn,
        stride_s0,
        stride_s1,
        WFORMAT,
    )
    if WFORMAT == 3:
        return group_dot(
            sums,
            a,
            w,
            AScale,
            a_rows,
            mask_m,
            stride_as,
            k0,
            WScale,
            RowBlock,
            ColBlock,
            offs_n,
            mask_n,
            stride_s0,
            stride_s1,
            BLOCK_K,
        )
    else:
        return tile_dot(sums, a, w, WFORMAT, PRECISION, UPCAST)


@triton.jit
def scaled_sums(
    sums,
    AScale,
    a_rows,
    mask_m,
    stride_as,
    WScale,
    RowBlock,
    offs_n,
    mask_n,
    stride_s0,
    WFORMAT: tl.constexpr,
):
    """The sums in float32: int8's times each row's activation scale, then each column's weight
    scale (the CPU's order); the others as they are."""
    if WFORMAT == 2:
        xs = tl.load(AScale + a_rows * stride_as, mask=mask_m, other=0.0)
        rb = tl.load(RowBlock + offs_n, mask=mask_n, other=0)
        ws = tl.load(WScale + rb * stride_s0, mask=mask_n, other=0.0)
        return sums.to(tl.float32) * xs[:, None] * ws[None, :]
    else:
        return sums


@triton.jit
def _linear_kernel(
    X,
    XScale,
    W,
    WScale,
    RowBlock,
    ColBlock,
    Bias,
    Out,
    M,
    N,
    K,
    stride_xm,
    stride_as,
    stride_wn,
    stride_s0,
    stride_s1,
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
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_m = offs_m < M
    mask_n = offs_n < N
    sums = zero_sums(BLOCK_M, BLOCK_N, WFORMAT)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        mask_k = offs_k < K
        a = tl.load(
            X + offs_m[:, None].to(tl.int64) * stride_xm + offs_k[None, :],
            mask=mask_m[:, None] & mask_k[None, :],
            other=0,
        )
        sums = tile_step(
            sums,
            a,
            W,
            WScale,
            RowBlock,
            ColBlock,
            offs_n,
            offs_k,
            mask_n,
            mask_k,
            k0,
            XScale,
            offs_m,
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
    out = scaled_sums(
        sums, XScale, offs_m, mask_m, stride_as, WScale, RowBlock, offs_n, mask_n, stride_s0, WFORMAT
    )
    if HAS_BIAS:
        out += tl.load(Bias + offs_n, mask=mask_n, other=0.0).to(tl.float32)[None, :]
    out_ptr = Out + offs_m[:, None].to(tl.int64) * stride_om + offs_n[None, :]
    tl.store(out_ptr, out.to(Out.dtype.element_ty), mask=mask_m[:, None] & mask_n[None, :])


def activations(x: torch.Tensor, w: torch.Tensor | QuantizedWeight) -> tuple[torch.Tensor, torch.Tensor]:
    """(what a kernel reads as A, its scales): int8 codes and per-row scales for an int8 weight, FP8
    codes and per-group scales under FP8 dots; x itself (scales never read) for the others."""
    wformat = weight_format(w)
    if wformat == 2:
        return quantize_rows_int8(x)
    if wformat == 3:
        codes, scale = quantize_groups_fp8(x, w.group)
        return codes.view(torch.uint8), scale
    return x, x


def linear(x: torch.Tensor, w: QuantizedWeight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x @ W.T + bias for an 8-bit W ([n, k]), in x's dtype, with the kernel above."""
    lead, k = x.shape[:-1], x.shape[-1]
    x2 = x.reshape(-1, k)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    n, m = w.q.shape[0], x2.shape[0]
    out = x.new_empty(m, n)
    if m == 0:
        return out.view(*lead, n)
    a, a_scale = activations(x2, w)
    codes, scale, row_block, col_block, stride_wn, _, stride_s0, stride_s1 = weight_args(w)
    prec, upcast = precision(x)
    block_m = 16 if m <= 16 else 64
    block_n = 64
    _linear_kernel[(triton.cdiv(m, block_m), triton.cdiv(n, block_n))](
        a,
        a_scale,
        codes,
        scale,
        row_block,
        col_block,
        bias if bias is not None else x2,
        out,
        m,
        n,
        k,
        a.stride(0),
        a_scale.stride(0),
        stride_wn,
        stride_s0,
        stride_s1,
        out.stride(0),
        HAS_BIAS=bias is not None,
        WFORMAT=weight_format(w),
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_K=block_k(w),
        PRECISION=prec,
        UPCAST=upcast,
    )
    return out.view(*lead, n)
