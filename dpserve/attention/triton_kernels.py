"""Paged attention kernels in Triton, reading the KV pool by slot index (no gathered copy).

Request b of a step owns row `table_rows[b]` of the request-to-slot table: its token at position p
lives in pool slot `req_to_token[table_rows[b], p]`. It has `seq_lens[b]` tokens in the pool, the
last q_len of them new this step (the model writes their KV before attention runs).

- `decode_attention`: one query token per request, split-K (flash-decoding): each of
  `num_kv_splits` programs per (request, head block) reduces a slice of the context to a partial
  output and its log-sum-exp; a second kernel merges the slices. Query heads sharing one KV head
  are processed together (up to 16 per program), so MLA (one latent KV head for every query head) reads
  each KV entry once per head block rather than once per head.
- `extend_attention`: any number of new tokens per request (prefill, chunked prefill, prefix
  cache hits), causal over the cached prefix and the new tokens.

Caches are [slots, kv_heads, dim] tensors with any strides, so MLA passes views of one latent
pool: `k = cache[:, None, :]` (latent + rope) and `v = cache[:, None, :v_dim]`. Head dims need
not be powers of two (576 = 512 + 64, or 48 = 32 + 16): the key dim is split into a power-of-two
part and a masked remainder, the value dim is padded with masks.

Grids and buffers depend only on the batch size, head counts and the int bounds passed in, never
on the lengths' values, so a captured CUDA graph serves any lengths up to the table's width.
`launch_config` alone chooses block sizes, split count and grid, for the GPU or the interpreter:
tests call it with the GPU's choices and run them in the interpreter. Constexprs (block sizes
included) come from head counts and dims only: the split count, which follows the step's longest
context, is a runtime argument, so a new context length never compiles a new kernel.
Softmax statistics and accumulators are float32 whatever the input dtype.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cache
from typing import Literal

import torch

from dpserve.kvcache.pool import FP8_KV_MANTISSA, ScaledKV
from dpserve.triton_setup import INTERPRET, tl, triton, widen_fp8


def _split_dim(d: int) -> tuple[int, int]:
    """A key dim as two power-of-two blocks (the second masked, 0 when not needed), each at least 16
    (the smallest tl.dot on a GPU): 576 -> (512, 64), 40 -> (32, 16), 8 -> (16, 0)."""
    main = max(16, 1 << (d.bit_length() - 1))
    rest = d - main
    return main, (max(16, triton.next_power_of_2(rest)) if rest > 0 else 0)


def _block_dv(d: int) -> int:
    return max(16, triton.next_power_of_2(d))


def _upcast(dtype: torch.dtype) -> bool:
    # Triton's interpreter multiplies bfloat16 matrices wrongly (3.9): it gets float32 operands.
    return INTERPRET and dtype == torch.bfloat16


@dataclass(frozen=True)
class Launch:
    """How one kernel call runs: its grid, block sizes and, in decode, heads per program and splits."""

    grid: tuple[int, int, int]
    block_n: int  # keys per loop iteration
    block_m: int = 0  # extend: query rows per program
    block_h: int = 0  # decode: head rows per program (power of two; a tl.dot from 16 on)
    heads_per_prog: int = 0  # decode: real heads among them
    num_splits: int = 1  # decode: context slices reduced in parallel
    num_warps: int = 4
    num_stages: int = 2


@cache
def _device_sms() -> int:
    return torch.cuda.get_device_properties(torch.cuda.current_device()).multi_processor_count


def launch_config(
    kind: Literal["decode", "extend"],
    *,
    batch: int,
    heads: int,
    kv_heads: int,
    lk: int,
    max_seq_len: int,
    max_q_len: int = 1,
    device: Literal["cuda", "interpret"] = "interpret" if INTERPRET else "cuda",
    num_sms: int | None = None,
    num_splits: int | None = None,
) -> Launch:
    """The launch of `decode_attention` or `extend_attention` for these shapes and bounds.

    Decode: a program takes up to 16 query heads of one KV head, as many as the group holds (a
    one-head group runs without tl.dot, whose rows start at 16, and takes fewer keys per iteration
    the more heads it has, to bound its registers); the context is cut into enough splits for about
    two programs per SM (`num_sms`: the current device's when None), one per 4 key blocks of
    `max_seq_len` at most, unless `num_splits` is given. The interpreter keeps big key blocks and at
    most 2 splits (each program costs milliseconds there). Only ints enter, so the launch of a
    captured graph stays valid for any lengths within its bounds."""
    block_d, block_dpe = _split_dim(lk)
    gpu = device == "cuda"
    if kind == "extend":
        block_m = (16 if lk > 256 else 64) if gpu else 32
        block_n = (32 if lk > 256 else 64) if gpu else 64
        grid = (batch, heads, triton.cdiv(max_q_len, block_m))
        return Launch(grid, block_n, block_m=block_m, num_warps=4 if lk <= 128 else 8, num_stages=1)
    group = heads // kv_heads
    per_prog = min(16, group)
    block_h = triton.next_power_of_2(per_prog)
    progs_per_kv = triton.cdiv(group, per_prog)
    if not gpu:
        block_n = 64
    elif block_h >= 16:
        block_n = 32 if lk > 256 else 64
    else:  # broadcast products of block_h x dim x block_n in registers: about 8K of them
        block_n = min(64, max(8, 1 << (max(1, 8192 // (block_h * (block_d + block_dpe))).bit_length() - 1)))
    if num_splits is None:
        num_splits = choose_num_splits(
            max_seq_len, block_n, batch * kv_heads * progs_per_kv, device=device, num_sms=num_sms
        )
    grid = (batch, kv_heads * progs_per_kv, num_splits)
    return Launch(grid, block_n, block_h=block_h, heads_per_prog=per_prog, num_splits=num_splits)


def choose_num_splits(
    max_seq_len: int,
    block_n: int,
    programs: int,
    *,
    device: Literal["cuda", "interpret"],
    num_sms: int | None = None,
) -> int:
    """Context slices per request in decode: at most one per 4 key blocks of `max_seq_len`, and on
    a GPU enough for about two waves of programs over its SMs (`programs`: those of one slice,
    requests x head blocks); the interpreter takes at most 2 (each program costs milliseconds)."""
    by_length = max(1, triton.cdiv(max_seq_len, 4 * block_n))
    if device != "cuda":
        return min(by_length, 2)
    return min(by_length, max(1, triton.cdiv(2 * (num_sms or _device_sms()), programs)))


def _dot_precision(dtype: torch.dtype) -> str:
    # float32 inputs keep float32 products on the GPU (tf32 would cost ~1e-3 relative error).
    return "ieee" if dtype == torch.float32 else "tf32"


@triton.jit
def _mm(a, b, USE_DOT: tl.constexpr, PRECISION: tl.constexpr):
    """a @ b with float32 accumulation: tl.dot from 16 rows of a, broadcast products below."""
    if USE_DOT:
        return tl.dot(a, b, input_precision=PRECISION)
    else:
        return tl.sum(a.to(tl.float32)[:, :, None] * b.to(tl.float32)[None, :, :], 1)


@triton.jit
def _row_head_offset(b, h, stride_b, stride_h):
    """Offset of (request b, heads h) in a [batch, heads, ...] buffer, in int64: the split-K scratch
    holds batch x heads x splits x dv floats, past 2^31 from a batch of 4,097 at MLA's shapes
    (128 heads, 8 splits, 512 values), while program ids and strides arrive as int32."""
    return b.to(tl.int64) * stride_b + h * stride_h


@triton.jit
def _mid_offset(b, heads, split, num_splits, NUM_HEADS: tl.constexpr, ROW: tl.constexpr):
    """Offset of (request b, heads, split) in the contiguous [batch, NUM_HEADS, num_splits, ROW]
    split-K scratch. Its strides are computed here rather than passed: as ints they would vary with
    the split count and Triton would compile a variant per divisibility (ROW, a constexpr, keeps
    the stores' alignment known)."""
    return _row_head_offset(b, heads, NUM_HEADS * num_splits * ROW, num_splits * ROW) + split * ROW


@triton.jit
def _window_start(seq_len, window_size):
    """The first position a sliding window of `window_size` (0: none) leaves in sight of the query at
    position seq_len - 1."""
    return tl.where(window_size > 0, tl.maximum(seq_len - window_size, 0), 0)


@triton.jit
def _add_sink(l_i, m_i, sink):
    """A softmax's sum l_i (in the frame of its running max m_i) with one more logit, `sink`, that
    takes no value (attention sinks): returns (alpha, l) in the new frame, the accumulator to be
    multiplied by alpha."""
    m_new = tl.maximum(m_i, sink)
    alpha = tl.exp(m_i - m_new)
    return alpha, l_i * alpha + tl.exp(sink - m_new)


@triton.jit
def _kv_scales(Scales, slots, kv_head, stride_s, stride_h, mask, MANTISSA: tl.constexpr):
    """The scales of a block's slots in an 8-bit pool (MANTISSA > 0); ones otherwise (never read)."""
    if MANTISSA > 0:
        return tl.load(Scales + slots * stride_s + kv_head * stride_h, mask=mask, other=0.0)
    else:
        return tl.full(slots.shape, 1.0, tl.float32)


@triton.jit
def _load_kv(ptr, mask, scales, MANTISSA: tl.constexpr, DTYPE: tl.constexpr):
    """A tile of the pool as stored, or an 8-bit pool's codes widened and times `scales` (already
    broadcast to the tile's shape), rounded to DTYPE (the model's) as `kvcache.pool.take` reads them."""
    if MANTISSA > 0:
        return (widen_fp8(tl.load(ptr, mask=mask, other=0), MANTISSA) * scales).to(DTYPE)
    else:
        return tl.load(ptr, mask=mask, other=0.0)


def cache_parts(cache: torch.Tensor | ScaledKV) -> tuple[torch.Tensor, torch.Tensor, int]:
    """(what a kernel reads, its scales, MANTISSA): an 8-bit pool's codes as uint8 beside its scales
    [slots, kv_heads, 1] and their format's mantissa bits; any other cache beside itself (unread) and 0."""
    if isinstance(cache, ScaledKV):
        return cache.codes.view(torch.uint8), cache.scales, FP8_KV_MANTISSA[cache.codes.dtype]
    return cache, cache, 0


# num_splits follows the step's longest context: a runtime int, never specialized on (value 1,
# divisibility by 16), so every context length runs the same compiled kernel.
@triton.jit(do_not_specialize=["num_splits", "window_size"])
def _decode_split_kernel(
    Q,
    K,
    V,
    KScale,
    VScale,
    ReqToToken,
    ReqIdx,
    SeqLens,
    MidO,
    MidLse,
    scale,
    num_splits,
    window_size,
    stride_qb,
    stride_qh,
    stride_ks,
    stride_kh,
    stride_vs,
    stride_vh,
    stride_kss,
    stride_ksh,
    stride_vss,
    stride_vsh,
    stride_rt,
    NUM_HEADS: tl.constexpr,
    GROUP: tl.constexpr,  # query heads per KV head
    HEADS_PER_PROG: tl.constexpr,  # min(16, GROUP)
    PROGS_PER_KV: tl.constexpr,  # cdiv(GROUP, HEADS_PER_PROG)
    LK: tl.constexpr,
    LV: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_DPE: tl.constexpr,
    BLOCK_DV: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_H: tl.constexpr,
    USE_DOT: tl.constexpr,  # BLOCK_H >= 16
    PRECISION: tl.constexpr,
    UPCAST: tl.constexpr,
    MANTISSA: tl.constexpr,  # 8-bit pools: the FP8 format's mantissa bits; 0 otherwise
):
    b = tl.program_id(0)
    hp = tl.program_id(1)
    split = tl.program_id(2)
    kv_head = hp // PROGS_PER_KV
    offs_g = (hp % PROGS_PER_KV) * HEADS_PER_PROG + tl.arange(0, BLOCK_H)  # head within its group
    mask_h = (tl.arange(0, BLOCK_H) < HEADS_PER_PROG) & (offs_g < GROUP)
    heads = kv_head * GROUP + offs_g

    seq_len = tl.load(SeqLens + b)
    row = tl.load(ReqIdx + b).to(tl.int64)
    first = _window_start(seq_len, window_size)  # the split-K slices cover [first, seq_len)
    split_len = tl.cdiv(seq_len - first, num_splits)
    start = first + split * split_len
    end = tl.minimum(start + split_len, seq_len)

    offs_d = tl.arange(0, BLOCK_D)
    mask_d = offs_d < LK
    offs_dv = tl.arange(0, BLOCK_DV)
    mask_dv = offs_dv < LV
    q_ptr = Q + b * stride_qb + heads[:, None] * stride_qh
    q = tl.load(q_ptr + offs_d[None, :], mask=mask_h[:, None] & mask_d[None, :], other=0.0)
    DTYPE = Q.dtype.element_ty
    if BLOCK_DPE > 0:
        offs_dpe = BLOCK_D + tl.arange(0, BLOCK_DPE)
        mask_dpe = offs_dpe < LK
        qpe = tl.load(q_ptr + offs_dpe[None, :], mask=mask_h[:, None] & mask_dpe[None, :], other=0.0)
        if UPCAST:
            qpe = qpe.to(tl.float32)
    if UPCAST:
        q = q.to(tl.float32)

    m_i = tl.full([BLOCK_H], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_DV], dtype=tl.float32)
    if end > start:
        for n0 in range(start, end, BLOCK_N):
            offs_n = n0 + tl.arange(0, BLOCK_N)
            mask_n = offs_n < end
            slots = tl.load(ReqToToken + row * stride_rt + offs_n, mask=mask_n, other=0).to(tl.int64)
            k_ptr = K + slots[None, :] * stride_ks + kv_head * stride_kh
            ks = _kv_scales(KScale, slots, kv_head, stride_kss, stride_ksh, mask_n, MANTISSA)[None, :]
            k = _load_kv(k_ptr + offs_d[:, None], mask_n[None, :] & mask_d[:, None], ks, MANTISSA, DTYPE)
            if UPCAST:
                k = k.to(tl.float32)
            qk = _mm(q, k, USE_DOT, PRECISION)
            if BLOCK_DPE > 0:
                kpe = _load_kv(
                    k_ptr + offs_dpe[:, None], mask_n[None, :] & mask_dpe[:, None], ks, MANTISSA, DTYPE
                )
                if UPCAST:
                    kpe = kpe.to(tl.float32)
                qk += _mm(qpe, kpe, USE_DOT, PRECISION)
            qk = tl.where(mask_h[:, None] & mask_n[None, :], qk * scale, float("-inf"))
            v_ptr = V + slots[:, None] * stride_vs + kv_head * stride_vh
            vs = _kv_scales(VScale, slots, kv_head, stride_vss, stride_vsh, mask_n, MANTISSA)[:, None]
            v = _load_kv(v_ptr + offs_dv[None, :], mask_n[:, None] & mask_dv[None, :], vs, MANTISSA, DTYPE)
            if UPCAST:
                v = v.to(tl.float32)
            m_new = tl.maximum(m_i, tl.max(qk, 1))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # masked heads: all -inf
            alpha = tl.exp(m_i - m_safe)
            p = tl.exp(qk - m_safe[:, None])
            acc = acc * alpha[:, None] + _mm(p.to(v.dtype), v, USE_DOT, PRECISION)
            l_i = l_i * alpha + tl.sum(p, 1)
            m_i = m_new
        out_ptr = MidO + _mid_offset(b, heads[:, None], split, num_splits, NUM_HEADS, LV)
        safe_l = tl.where(l_i > 0, l_i, 1.0)
        tl.store(out_ptr + offs_dv[None, :], acc / safe_l[:, None], mask=mask_h[:, None] & mask_dv[None, :])
        lse = tl.where(l_i > 0, m_i + tl.log(safe_l), float("-inf"))
        tl.store(MidLse + _mid_offset(b, heads, split, num_splits, NUM_HEADS, 1), lse, mask=mask_h)


@triton.jit(do_not_specialize=["num_splits", "window_size"])
def _decode_reduce_kernel(
    MidO,
    MidLse,
    SeqLens,
    Sinks,
    Out,
    num_splits,
    window_size,
    stride_ob,
    stride_oh,
    NUM_HEADS: tl.constexpr,
    LV: tl.constexpr,
    BLOCK_DV: tl.constexpr,
    HAS_SINKS: tl.constexpr,
):
    b = tl.program_id(0)
    h = tl.program_id(1)
    seq_len = tl.load(SeqLens + b)
    seq_len = seq_len - _window_start(seq_len, window_size)  # the keys the slices cover
    split_len = tl.cdiv(seq_len, num_splits)
    offs_dv = tl.arange(0, BLOCK_DV)
    mask_dv = offs_dv < LV
    m_i = float("-inf")
    l_i = 0.0
    acc = tl.zeros([BLOCK_DV], dtype=tl.float32)
    for s in range(num_splits):  # a runtime bound: one compiled kernel for every split count
        if s * split_len < seq_len:  # empty slices wrote nothing
            lse = tl.load(MidLse + _mid_offset(b, h, s, num_splits, NUM_HEADS, 1))
            o = tl.load(
                MidO + _mid_offset(b, h, s, num_splits, NUM_HEADS, LV) + offs_dv, mask=mask_dv, other=0.0
            )
            m_new = tl.maximum(m_i, lse)
            alpha = tl.exp(m_i - m_new)
            w = tl.exp(lse - m_new)
            acc = acc * alpha + w * o
            l_i = l_i * alpha + w
            m_i = m_new
    if HAS_SINKS:
        alpha, l_i = _add_sink(l_i, m_i, tl.load(Sinks + h).to(tl.float32))
        acc = acc * alpha
    safe_l = tl.where(l_i > 0, l_i, 1.0)
    tl.store(
        Out + b * stride_ob + h * stride_oh + offs_dv, (acc / safe_l).to(Out.dtype.element_ty), mask=mask_dv
    )


def decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    req_to_token: torch.Tensor,
    table_rows: torch.Tensor,
    seq_lens: torch.Tensor,
    out: torch.Tensor,
    scale: float,
    num_kv_splits: int | None = None,
    max_seq_len: int | None = None,
    launch: Launch | None = None,
    window_size: int = 0,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention of one new token per request against its whole context in the paged pool (its
    last `window_size` positions when > 0; `sinks` [heads]: a logit per head with no value).

    q [batch, heads, dk]; k_cache [slots, kv_heads, dk] and v_cache [slots, kv_heads, dv] (any
    strides, last dim contiguous; MLA passes views of one cache); req_to_token [rows, width]
    int32; table_rows, seq_lens [batch] int (seq_lens count the new token; padded rows use row 0 and
    seq_len 1); out [batch, heads, dv], written and returned. heads must be a multiple of kv_heads.
    The context is cut into slices reduced in parallel, then merged: `launch` (by default
    `launch_config` for max_seq_len, the table's width when None, and num_kv_splits) sets their
    number and the grid; the grid and the float32 scratch ([batch, heads, splits, dv]) depend only
    on the shapes and these bounds. The split count is a runtime argument of both kernels: in a
    captured graph it is the one chosen at capture (for the graph's bound), with its scratch.
    """
    batch, heads, lk = q.shape
    (k_cache, k_scales, mantissa), (v_cache, v_scales, _) = cache_parts(k_cache), cache_parts(v_cache)
    kv_heads, lv = k_cache.shape[1], v_cache.shape[2]
    assert heads % kv_heads == 0 and k_cache.shape[2] == lk and out.shape == (batch, heads, lv)
    assert q.stride(2) == 1 and k_cache.stride(2) == 1 and v_cache.stride(2) == 1 and out.stride(2) == 1
    if batch == 0:
        return out
    if launch is None:
        launch = launch_config(
            "decode",
            batch=batch,
            heads=heads,
            kv_heads=kv_heads,
            lk=lk,
            max_seq_len=max_seq_len or req_to_token.shape[1],
            num_splits=num_kv_splits,
        )
    splits = launch.num_splits
    block_d, block_dpe = _split_dim(lk)
    mid_o = torch.empty((batch, heads, splits, lv), dtype=torch.float32, device=q.device)
    mid_lse = torch.empty((batch, heads, splits), dtype=torch.float32, device=q.device)
    _decode_split_kernel[launch.grid](
        q,
        k_cache,
        v_cache,
        k_scales,
        v_scales,
        req_to_token,
        table_rows,
        seq_lens,
        mid_o,
        mid_lse,
        scale,
        splits,
        window_size,
        q.stride(0),
        q.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        v_cache.stride(0),
        v_cache.stride(1),
        k_scales.stride(0),
        k_scales.stride(1),
        v_scales.stride(0),
        v_scales.stride(1),
        req_to_token.stride(0),
        NUM_HEADS=heads,
        GROUP=heads // kv_heads,
        HEADS_PER_PROG=launch.heads_per_prog,
        PROGS_PER_KV=launch.grid[1] // kv_heads,
        LK=lk,
        LV=lv,
        BLOCK_D=block_d,
        BLOCK_DPE=block_dpe,
        BLOCK_DV=_block_dv(lv),
        BLOCK_N=launch.block_n,
        BLOCK_H=launch.block_h,
        USE_DOT=launch.block_h >= 16,
        PRECISION=_dot_precision(q.dtype),
        UPCAST=_upcast(q.dtype),
        MANTISSA=mantissa,
        num_warps=launch.num_warps,
        num_stages=launch.num_stages,
    )
    _decode_reduce_kernel[(batch, heads)](
        mid_o,
        mid_lse,
        seq_lens,
        sinks if sinks is not None else mid_lse,
        out,
        splits,
        window_size,
        out.stride(0),
        out.stride(1),
        NUM_HEADS=heads,
        LV=lv,
        BLOCK_DV=_block_dv(lv),
        HAS_SINKS=sinks is not None,
        num_warps=4,
    )
    return out


@triton.jit(do_not_specialize=["window_size"])
def _extend_kernel(
    Q,
    K,
    V,
    KScale,
    VScale,
    Out,
    ReqToToken,
    ReqIdx,
    SeqLens,
    QStart,
    Sinks,
    scale,
    window_size,
    stride_qt,
    stride_qh,
    stride_ks,
    stride_kh,
    stride_vs,
    stride_vh,
    stride_kss,
    stride_ksh,
    stride_vss,
    stride_vsh,
    stride_ot,
    stride_oh,
    stride_rt,
    GROUP: tl.constexpr,
    LK: tl.constexpr,
    LV: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_DPE: tl.constexpr,
    BLOCK_DV: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    PRECISION: tl.constexpr,
    UPCAST: tl.constexpr,
    HAS_SINKS: tl.constexpr,
    MANTISSA: tl.constexpr,
):
    b = tl.program_id(0)
    h = tl.program_id(1)
    mb = tl.program_id(2)
    q_first = tl.load(QStart + b)
    q_len = tl.load(QStart + b + 1) - q_first
    if mb * BLOCK_M < q_len:
        seq_len = tl.load(SeqLens + b)
        prefix = seq_len - q_len
        row = tl.load(ReqIdx + b).to(tl.int64)
        kv_head = h // GROUP
        offs_m = mb * BLOCK_M + tl.arange(0, BLOCK_M)
        mask_m = offs_m < q_len
        q_pos = prefix + offs_m  # each query's position: it sees keys at positions <= q_pos

        offs_d = tl.arange(0, BLOCK_D)
        mask_d = offs_d < LK
        offs_dv = tl.arange(0, BLOCK_DV)
        mask_dv = offs_dv < LV
        q_ptr = Q + (q_first + offs_m[:, None]).to(tl.int64) * stride_qt + h * stride_qh
        q = tl.load(q_ptr + offs_d[None, :], mask=mask_m[:, None] & mask_d[None, :], other=0.0)
        DTYPE = Q.dtype.element_ty
        if BLOCK_DPE > 0:
            offs_dpe = BLOCK_D + tl.arange(0, BLOCK_DPE)
            mask_dpe = offs_dpe < LK
            qpe = tl.load(q_ptr + offs_dpe[None, :], mask=mask_m[:, None] & mask_dpe[None, :], other=0.0)
            if UPCAST:
                qpe = qpe.to(tl.float32)
        if UPCAST:
            q = q.to(tl.float32)

        m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
        l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
        acc = tl.zeros([BLOCK_M, BLOCK_DV], dtype=tl.float32)
        end = tl.minimum(seq_len, prefix + (mb + 1) * BLOCK_M)  # causal: nothing past the last query
        # A sliding window: nothing before the first query's window_size either (whole key blocks).
        first = _window_start(prefix + mb * BLOCK_M + 1, window_size) // BLOCK_N * BLOCK_N
        for n0 in range(first, end, BLOCK_N):
            offs_n = n0 + tl.arange(0, BLOCK_N)
            mask_n = offs_n < end
            slots = tl.load(ReqToToken + row * stride_rt + offs_n, mask=mask_n, other=0).to(tl.int64)
            k_ptr = K + slots[None, :] * stride_ks + kv_head * stride_kh
            ks = _kv_scales(KScale, slots, kv_head, stride_kss, stride_ksh, mask_n, MANTISSA)[None, :]
            k = _load_kv(k_ptr + offs_d[:, None], mask_n[None, :] & mask_d[:, None], ks, MANTISSA, DTYPE)
            if UPCAST:
                k = k.to(tl.float32)
            qk = tl.dot(q, k, input_precision=PRECISION)
            if BLOCK_DPE > 0:
                kpe = _load_kv(
                    k_ptr + offs_dpe[:, None], mask_n[None, :] & mask_dpe[:, None], ks, MANTISSA, DTYPE
                )
                if UPCAST:
                    kpe = kpe.to(tl.float32)
                qk += tl.dot(qpe, kpe, input_precision=PRECISION)
            visible = mask_n[None, :] & (offs_n[None, :] <= q_pos[:, None])
            if window_size > 0:
                visible = visible & (offs_n[None, :] > q_pos[:, None] - window_size)
            qk = tl.where(visible, qk * scale, float("-inf"))
            v_ptr = V + slots[:, None] * stride_vs + kv_head * stride_vh
            vs = _kv_scales(VScale, slots, kv_head, stride_vss, stride_vsh, mask_n, MANTISSA)[:, None]
            v = _load_kv(v_ptr + offs_dv[None, :], mask_n[:, None] & mask_dv[None, :], vs, MANTISSA, DTYPE)
            if UPCAST:
                v = v.to(tl.float32)
            # A window can hide a whole block from a row: its max stays -inf, its terms 0.
            m_new = tl.maximum(m_i, tl.max(qk, 1))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
            alpha = tl.exp(m_i - m_safe)
            p = tl.exp(qk - m_safe[:, None])
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
            l_i = l_i * alpha + tl.sum(p, 1)
            m_i = m_new
        if HAS_SINKS:
            alpha, l_i = _add_sink(l_i, m_i, tl.load(Sinks + h).to(tl.float32))
            acc = acc * alpha[:, None]
        safe_l = tl.where(l_i > 0, l_i, 1.0)
        out_ptr = Out + (q_first + offs_m[:, None]).to(tl.int64) * stride_ot + h * stride_oh
        tl.store(
            out_ptr + offs_dv[None, :],
            (acc / safe_l[:, None]).to(Out.dtype.element_ty),
            mask=mask_m[:, None] & mask_dv[None, :],
        )


def extend_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    req_to_token: torch.Tensor,
    table_rows: torch.Tensor,
    seq_lens: torch.Tensor,
    q_start: torch.Tensor,
    out: torch.Tensor,
    scale: float,
    max_q_len: int,
    launch: Launch | None = None,
    window_size: int = 0,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal attention of each request's new tokens against its prefix and themselves (each
    query its last `window_size` positions when > 0; `sinks` [heads]: a logit per head with no value).

    q [tokens, heads, dk] packs the requests' new tokens; request b owns rows
    q_start[b] .. q_start[b + 1] - 1 (q_len of them), at positions seq_len - q_len .. seq_len - 1,
    and attends to every position up to its own, all read from the pool through
    req_to_token[table_rows[b]] (the new tokens' KV is already written). k_cache, v_cache, out and
    the other arguments are as in `decode_attention`, with out [tokens, heads, dv]. max_q_len
    bounds every q_len; it and the shapes alone set the grid (requests with fewer new tokens exit
    early), so a captured graph serves any lengths within the bounds. Rows of q past the last
    request's are left unwritten. `launch`: `launch_config`'s by default.
    """
    tokens, heads, lk = q.shape
    batch = table_rows.shape[0]
    (k_cache, k_scales, mantissa), (v_cache, v_scales, _) = cache_parts(k_cache), cache_parts(v_cache)
    kv_heads, lv = k_cache.shape[1], v_cache.shape[2]
    assert heads % kv_heads == 0 and k_cache.shape[2] == lk and out.shape == (tokens, heads, lv)
    assert q.stride(2) == 1 and k_cache.stride(2) == 1 and v_cache.stride(2) == 1 and out.stride(2) == 1
    if batch == 0 or max_q_len == 0:
        return out
    if launch is None:
        launch = launch_config(
            "extend",
            batch=batch,
            heads=heads,
            kv_heads=kv_heads,
            lk=lk,
            max_seq_len=req_to_token.shape[1],
            max_q_len=max_q_len,
        )
    block_d, block_dpe = _split_dim(lk)
    _extend_kernel[launch.grid](
        q,
        k_cache,
        v_cache,
        k_scales,
        v_scales,
        out,
        req_to_token,
        table_rows,
        seq_lens,
        q_start,
        sinks if sinks is not None else q,
        scale,
        window_size,
        q.stride(0),
        q.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        v_cache.stride(0),
        v_cache.stride(1),
        k_scales.stride(0),
        k_scales.stride(1),
        v_scales.stride(0),
        v_scales.stride(1),
        out.stride(0),
        out.stride(1),
        req_to_token.stride(0),
        GROUP=heads // kv_heads,
        LK=lk,
        LV=lv,
        BLOCK_D=block_d,
        BLOCK_DPE=block_dpe,
        BLOCK_DV=_block_dv(lv),
        BLOCK_M=launch.block_m,
        BLOCK_N=launch.block_n,
        PRECISION=_dot_precision(q.dtype),
        UPCAST=_upcast(q.dtype),
        HAS_SINKS=sinks is not None,
        MANTISSA=mantissa,
        num_warps=launch.num_warps,
        num_stages=launch.num_stages,
    )
    return out
