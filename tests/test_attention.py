"""The attention backends against the SDPA reference: Triton's paged kernels in Triton's interpreter
on the CPU (the same kernels the GPU runs) and the CPU's torch backend; MLA and GQA (and the
multi-head form of MLA prefill: as many KV heads as query heads, values narrower than keys), decode
and extend, mixed lengths, padded rows."""

from __future__ import annotations

import pytest
import torch

from dpserve import cpu_ops
from dpserve.attention.backend import AttentionMetadata
from dpserve.attention.sdpa import SdpaBackend
from dpserve.attention.torch_backend import TorchBackend, _Keys
from dpserve.attention.triton_backend import TritonBackend
from dpserve.attention.triton_kernels import (
    _row_head_offset,
    decode_attention,
    extend_attention,
    launch_config,
)
from dpserve.kvcache.pool import KVPool, take
from dpserve.triton_setup import tl, triton

TOL = dict(atol=1e-4, rtol=1e-4)


def make_meta(seq_lens: list[int], q_lens: list[int], pad: int = 0, width: int = 512, seed: int = 0):
    """A batch of requests (seq_len, q_len) on shuffled pool slots, plus `pad` padded rows
    (row 0, seq_len 1, one token), as the model runner builds it. Returns (meta, num_slots)."""
    g = torch.Generator().manual_seed(seed)
    num_slots = sum(seq_lens) + 8
    perm = torch.randperm(num_slots - 1, generator=g) + 1  # slot 0 is the padding slot
    table = torch.zeros((len(seq_lens) + 3, width), dtype=torch.int32)
    rows = (torch.randperm(len(seq_lens) + 2, generator=g) + 1)[: len(seq_lens)]  # row 0: padding
    used = 0
    for r, n in zip(rows.tolist(), seq_lens, strict=True):
        table[r, :n] = perm[used : used + n].to(torch.int32)
        used += n
    seq = seq_lens + [1] * pad
    q_lens = q_lens + [1] * pad
    meta = AttentionMetadata(
        req_to_token=table,
        table_rows=torch.cat([rows, torch.zeros(pad, dtype=torch.long)]).to(torch.int32),
        seq_lens=torch.tensor(seq, dtype=torch.int32),
        q_start=torch.tensor([0, *q_lens], dtype=torch.int32).cumsum(0, dtype=torch.int32),
        num_tokens=sum(q_lens),
        max_q_len=max(q_lens),
        max_seq_len=max(seq),
        q_lens_host=q_lens,
        seq_lens_host=seq,
    )
    return meta, num_slots


def run_both(fn, meta):
    """Every backend on `meta` against the SDPA reference; returns Triton's output."""
    outs = []
    for backend in (SdpaBackend(), TritonBackend(num_kv_splits=4), TorchBackend()):
        m = AttentionMetadata(**{**meta.__dict__, "state": {}})
        backend.prepare(m)
        outs.append(fn(backend, m))
    ref, *got = outs
    for out in got:
        assert torch.isfinite(out).all()
        torch.testing.assert_close(out, ref, **TOL)
    return got[0]


def scaled(cache_dtype, *values: torch.Tensor) -> list:
    """`values` [slots, ...] written to an 8-bit pool of `cache_dtype` (as they are when None)."""
    if cache_dtype is None:
        return list(values)
    shapes = [tuple(v.shape[1:]) for v in values]
    pool = KVPool(
        1, values[0].shape[0] - 1, shapes, torch.float32, torch.device("cpu"), cache_dtype=cache_dtype
    )
    pool.write(0, torch.arange(values[0].shape[0]), *values)
    return pool.layers[0]


def mla_case(heads, latent, rope, seq_lens, q_lens, pad=0, seed=0, cache_dtype=None):
    meta, num_slots = make_meta(seq_lens, q_lens, pad, seed=seed)
    g = torch.Generator().manual_seed(seed + 1)
    [cache] = scaled(cache_dtype, torch.randn(num_slots, latent + rope, generator=g))
    q = torch.randn(meta.num_tokens, heads, latent + rope, generator=g)
    scale = (latent + rope) ** -0.5
    return run_both(lambda b, m: b.mla(q, cache, m, scale, latent), meta)


def gqa_case(
    heads, kv_heads, dim, seq_lens, q_lens, pad=0, seed=0, v_dim=None, window=0, sinks=False, cache_dtype=None
):
    meta, num_slots = make_meta(seq_lens, q_lens, pad, seed=seed)
    g = torch.Generator().manual_seed(seed + 1)
    k, v = scaled(
        cache_dtype,
        torch.randn(num_slots, kv_heads, dim, generator=g),
        torch.randn(num_slots, kv_heads, v_dim or dim, generator=g),
    )
    q = torch.randn(meta.num_tokens, heads, dim, generator=g)
    s = 2 * torch.randn(heads, generator=g) if sinks else None
    return run_both(lambda b, m: b.gqa(q, k, v, m, dim**-0.5, window, s), meta)


DECODE = ([5, 1, 17, 9], [1, 1, 1, 1])
EXTEND = ([7, 3, 20, 1], [7, 2, 5, 1])  # a full prefill, chunks after a prefix, a one-token row


@pytest.mark.parametrize("lens", [DECODE, EXTEND], ids=["decode", "extend"])
@pytest.mark.parametrize("rope", [8, 16])
def test_mla_tiny(lens, rope):
    mla_case(4, 32, rope, *lens, pad=2)  # key dim 40 or 48: 32 + a masked 16-wide remainder


@pytest.mark.parametrize("lens", [DECODE, EXTEND], ids=["decode", "extend"])
def test_mla_deepseek_dims(lens):
    mla_case(16, 512, 64, *lens, pad=1)  # DeepSeek's latent 512 + rope 64, values 512


@pytest.mark.parametrize("lens", [DECODE, EXTEND], ids=["decode", "extend"])
@pytest.mark.parametrize("heads,kv_heads,dim", [(4, 2, 16), (6, 2, 96), (3, 3, 64), (2, 1, 8)])
def test_gqa(lens, heads, kv_heads, dim):
    gqa_case(heads, kv_heads, dim, *lens, pad=2)


@pytest.mark.parametrize("lens", [DECODE, EXTEND], ids=["decode", "extend"])
@pytest.mark.parametrize("window,sinks", [(4, False), (0, True), (6, True)])
def test_gqa_sliding_window_and_sinks(lens, window, sinks):
    """gpt-oss's attention: each query sees its last `window` positions (contexts longer and
    shorter than it, chunks whose queries' windows start apart), and a sink logit per head."""
    gqa_case(8, 2, 32, *lens, pad=2, window=window, sinks=sinks)


@pytest.mark.parametrize("lens", [DECODE, EXTEND], ids=["decode", "extend"])
def test_mla_multi_head_form(lens):
    """MLA prefill in multi-head form: keys of nope + rope dims, values of v dims, one KV head per head."""
    gqa_case(4, 4, 24, *lens, pad=1, v_dim=16)


MIXED = ([30, 5, 12, 40, 3], [1, 5, 1, 9, 1])  # decode rows riding along prefill chunks


@pytest.mark.parametrize("lens", [DECODE, EXTEND, MIXED], ids=["decode", "extend", "mixed"])
@pytest.mark.parametrize("cache_dtype", [torch.float8_e4m3fn, torch.float8_e5m2], ids=["e4m3", "e5m2"])
def test_every_backend_reads_an_8_bit_cache(lens, cache_dtype):
    """An 8-bit pool's codes and scales, read by each backend (Triton's kernels in place, with
    integer-only widening; the CPU kernel; SDPA's gathered grid): MLA's latent + rope under one
    scale per token, GQA with a window and sinks, keys wider than values."""
    mla_case(4, 32, 16, *lens, pad=2, cache_dtype=cache_dtype)
    gqa_case(8, 2, 32, *lens, pad=2, window=6, sinks=True, cache_dtype=cache_dtype)
    gqa_case(6, 2, 96, *lens, pad=1, v_dim=40, cache_dtype=cache_dtype)


def test_mixed_one_and_many_query_requests():
    """The torch backend splits one-query rows from prefill chunks: both parts right, in place."""
    mla_case(4, 32, 16, *MIXED, pad=2)
    gqa_case(6, 2, 16, *MIXED, pad=2)


def test_split_k_long_context():
    mla_case(4, 32, 16, [300, 130], [1, 1], pad=1)  # several 64-token blocks per split
    gqa_case(8, 2, 64, [300, 7], [1, 1])


def test_extend_long_query():
    gqa_case(2, 1, 32, [150, 90], [100, 90], pad=1)  # several query blocks, one full prefill


def test_padded_rows_only():
    out = mla_case(4, 32, 16, [], [], pad=3)
    assert out.shape == (3, 4, 32)


def test_decode_grid_independent_of_lengths():
    """One call serves any lengths: the same buffers with other seq_lens give the right answer."""
    meta, num_slots = make_meta([40, 3], [1, 1])
    cache = torch.randn(num_slots, 48)
    q = torch.randn(2, 4, 48)
    out = torch.empty(2, 4, 32)
    for lens in ([40, 3], [2, 1], [17, 3]):
        meta.seq_lens.copy_(torch.tensor(lens))
        meta.max_seq_len = 40
        decode_attention(
            q,
            cache[:, None],
            cache[:, None, :32],
            meta.req_to_token,
            meta.table_rows,
            meta.seq_lens,
            out,
            0.3,
        )
        ref = SdpaBackend()
        m = AttentionMetadata(**{**meta.__dict__, "state": {}})
        ref.prepare(m)
        torch.testing.assert_close(out, ref.mla(q, cache, m, 0.3, 32), **TOL)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("lens", [DECODE, EXTEND], ids=["decode", "extend"])
def test_half_precision(dtype, lens):
    """Serving dtypes: float32 softmax and accumulation, output in the input dtype."""
    meta, num_slots = make_meta(*lens, pad=1)
    cache = torch.randn(num_slots, 48).to(dtype)
    q = torch.randn(meta.num_tokens, 4, 48).to(dtype)
    outs = []
    for backend in (SdpaBackend(), TritonBackend(), TorchBackend()):
        m = AttentionMetadata(**{**meta.__dict__, "state": {}})
        backend.prepare(m)
        outs.append(backend.mla(q, cache, m, 0.2, 32))
    for out in outs[1:]:
        assert out.dtype == dtype
        torch.testing.assert_close(out.float(), outs[0].float(), atol=3e-2, rtol=3e-2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize(
    "heads,kv_heads,dim,v_dim",
    [(9, 3, 64, 64), (8, 1, 128, 128), (5, 5, 20, 20), (12, 2, 40, 24), (16, 2, 576, 512)],
)
def test_fused_cpu_decode_kernel(dtype, heads, kv_heads, dim, v_dim):
    """dpserve/csrc/cpu_ops.cpp's decode attention and the plain-PyTorch form it replaces (the one
    a machine without a compiler runs) against the float32 SDPA reference: key blocks past the
    first (online softmax), head groups and widths that are not multiples of the vector width,
    values narrower than keys, padded rows."""
    assert cpu_ops.load(), "the fused CPU kernels did not build (a C++ compiler and ninja are needed)"
    meta, num_slots = make_meta([600, 1, 257, 40], [1, 1, 1, 1], pad=2, width=700)
    g = torch.Generator().manual_seed(3)
    k = torch.randn(num_slots, kv_heads, dim, generator=g).to(dtype)
    v = torch.randn(num_slots, kv_heads, v_dim, generator=g).to(dtype)
    q = torch.randn(meta.num_tokens, heads, dim, generator=g).to(dtype)
    scale = dim**-0.5
    ref_backend = SdpaBackend()
    m = AttentionMetadata(**{**meta.__dict__, "state": {}})
    ref_backend.prepare(m)
    ref = ref_backend.gqa(q.float(), k.float(), v.float(), m, scale)
    fused = torch.ops.dpserve_cpu.decode_attention(
        q, k, v, meta.req_to_token, meta.table_rows, meta.seq_lens, scale, v_dim
    )
    matmuls = _Keys(meta).matmuls(q, k, v, v_dim, scale)
    # The fused kernel rounds once, its output; the matmuls round their scores and probabilities too.
    tols = (TOL, TOL) if dtype == torch.float32 else (dict(atol=1e-2, rtol=1e-2), dict(atol=3e-2, rtol=3e-2))
    for out, tol in zip((fused, matmuls), tols, strict=True):
        assert out.dtype == dtype and out.shape == ref.shape
        torch.testing.assert_close(out.float(), ref, **tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("cache_dtype", [torch.float8_e4m3fn, torch.float8_e5m2])
@pytest.mark.parametrize("heads,kv_heads,dim,v_dim", [(9, 3, 64, 64), (12, 2, 40, 24)])
def test_fused_cpu_decode_kernel_reads_an_8_bit_cache(dtype, cache_dtype, heads, kv_heads, dim, v_dim):
    """An 8-bit pool's codes widened inside the fused kernel, each (slot, KV head)'s scales applied
    to its scores and probabilities: as SDPA over the widened cache (what `take` reads), across key
    blocks, for both FP8 formats (every code among the random values' rows)."""
    assert cpu_ops.load()
    meta, num_slots = make_meta([600, 1, 257, 40], [1, 1, 1, 1], pad=2, width=700)
    pool = KVPool(
        1,
        num_slots - 1,
        [(kv_heads, dim), (kv_heads, v_dim)],
        dtype,
        torch.device("cpu"),
        cache_dtype=cache_dtype,
    )
    g = torch.Generator().manual_seed(4)
    slots = torch.arange(num_slots)
    spread = torch.logspace(-2, 1, num_slots)[:, None, None]  # scales over three orders of magnitude
    pool.write(
        0,
        slots,
        torch.randn(num_slots, kv_heads, dim, generator=g) * spread,
        torch.randn(num_slots, kv_heads, v_dim, generator=g),
    )
    k, v = pool.layers[0]
    q = torch.randn(meta.num_tokens, heads, dim, generator=g).to(dtype)
    scale = dim**-0.5
    ref_backend = SdpaBackend()
    m = AttentionMetadata(**{**meta.__dict__, "state": {}})
    ref_backend.prepare(m)
    widened = [c.codes.float() * c.scales for c in (k, v)]
    ref = ref_backend.gqa(q.float(), *widened, m, scale)
    keys = _Keys(meta)
    fused = keys.attend(q, k, v, v_dim, scale)
    assert fused.dtype == dtype and fused.shape == ref.shape
    torch.testing.assert_close(
        fused.float(), ref, **(TOL if dtype == torch.float32 else dict(atol=1e-2, rtol=1e-2))
    )
    if dtype == torch.float32:  # bfloat16 matmuls round scores and probabilities (the test above)
        torch.testing.assert_close(keys.matmuls(q, k, v, v_dim, scale), ref, **TOL)
    # what the other readers widen to (`take`): the codes times their scales, in the model's dtype
    torch.testing.assert_close(take(k, slots), widened[0].to(dtype), rtol=0, atol=0)


@triton.jit
def _offset_probe(Out, b, h, stride_b, stride_h):
    tl.store(Out, _row_head_offset(b + tl.program_id(0), h, stride_b, stride_h))


def test_split_k_scratch_offset_is_int64():
    """The split-K scratch offset of the last request at a batch of 4,097 with MLA's shapes (128
    heads, 8 splits, 512 values) passes 2^31: computed in int32 it would wrap negative."""
    stride_b, stride_h = 128 * 8 * 512, 8 * 512
    out = torch.zeros(1, dtype=torch.int64)
    _offset_probe[(1,)](out, 4096, 127, stride_b, stride_h)
    assert out.item() == 4096 * stride_b + 127 * stride_h > 2**31


H200_SMS = 132


def test_launch_config_on_a_gpu():
    """Split count from the context bound, heads per KV head and SMs; head blocks sized to the group."""
    mla = dict(heads=128, kv_heads=1, lk=576, device="cuda", num_sms=H200_SMS)
    one = launch_config("decode", batch=1, max_seq_len=4096, **mla)
    # 8 programs of 16 heads: 33 splits would fill two waves, 32 (a split per 4 blocks of 32 keys) cap it.
    assert (one.grid, one.block_h, one.heads_per_prog, one.block_n) == ((1, 8, 32), 16, 16, 32)
    assert launch_config("decode", batch=4, max_seq_len=1 << 17, **mla).num_splits == 9  # cdiv(264, 32)
    assert launch_config("decode", batch=256, max_seq_len=1 << 17, **mla).grid == (256, 8, 1)
    assert launch_config("decode", batch=1, max_seq_len=100, **mla).num_splits == 1
    assert launch_config("decode", batch=1, max_seq_len=4096, num_splits=8, **mla).grid == (1, 8, 8)
    g40 = launch_config(
        "decode", batch=2, heads=80, kv_heads=2, lk=128, max_seq_len=8192, device="cuda", num_sms=64
    )
    assert (g40.grid, g40.block_h, g40.heads_per_prog, g40.block_n) == ((2, 6, 11), 16, 16, 64)
    for group, block_h, block_n in ((1, 1, 64), (2, 2, 32), (3, 4, 16), (8, 8, 8)):
        gqa = launch_config(
            "decode", batch=1, heads=group * 4, kv_heads=4, lk=128, max_seq_len=64, device="cuda", num_sms=8
        )
        assert (gqa.block_h, gqa.heads_per_prog, gqa.block_n, gqa.grid[1]) == (block_h, group, block_n, 4)
    ext = launch_config("extend", batch=3, max_seq_len=4096, max_q_len=100, **mla)
    assert (ext.grid, ext.block_m, ext.block_n, ext.num_warps) == ((3, 128, 7), 16, 32, 8)
    ext = launch_config(
        "extend", batch=3, heads=8, kv_heads=8, lk=128, max_seq_len=64, max_q_len=100, device="cuda"
    )
    assert (ext.grid, ext.block_m, ext.block_n, ext.num_warps) == ((3, 8, 2), 64, 64, 4)


def test_launch_config_in_the_interpreter():
    """Big key blocks and at most 2 splits there (each program costs milliseconds)."""
    dec = launch_config(
        "decode", batch=1, heads=128, kv_heads=1, lk=576, max_seq_len=4096, device="interpret"
    )
    assert (dec.grid, dec.block_n) == ((1, 8, 2), 64)
    ext = launch_config(
        "extend", batch=1, heads=4, kv_heads=1, lk=576, max_seq_len=64, max_q_len=40, device="interpret"
    )
    assert (ext.grid, ext.block_m, ext.block_n) == ((1, 4, 2), 32, 64)


@pytest.mark.parametrize(
    "heads,kv_heads,lk,lv,lens",
    [
        (128, 1, 576, 512, ([300, 45], [1, 1])),  # DeepSeek-V3 at attention TP 1: MLA, 128 heads per KV head
        (128, 1, 576, 512, ([40, 9], [6, 9])),
        (40, 1, 128, 128, ([300, 45], [1, 1])),  # 40 heads per KV head: 16 + 16 + 8 per program
        (40, 1, 128, 128, ([40, 9], [6, 9])),
        (8, 2, 128, 128, ([300, 45], [1, 1])),  # 4 per KV head: no tl.dot, 16 keys per iteration
        (4, 4, 64, 64, ([300, 45], [1, 1])),  # MHA
    ],
    ids=["mla128-decode", "mla128-extend", "gqa40-decode", "gqa40-extend", "gqa4-decode", "mha-decode"],
)
def test_kernels_at_gpu_launch(heads, kv_heads, lk, lv, lens):
    """The kernels with the block sizes, splits and grid a GPU (132 SMs) would use, in the interpreter,
    against SDPA."""
    meta, num_slots = make_meta(*lens)
    g = torch.Generator().manual_seed(3)
    if kv_heads == 1 and lk != lv:  # MLA: values are the first lv columns of the latent
        k = torch.randn(num_slots, 1, lk, generator=g)
        v = k[:, :, :lv]
    else:
        k, v = (
            torch.randn(num_slots, kv_heads, lk, generator=g),
            torch.randn(num_slots, kv_heads, lv, generator=g),
        )
    q = torch.randn(meta.num_tokens, heads, lk, generator=g)
    out = torch.empty(meta.num_tokens, heads, lv)
    args = (q, k, v, meta.req_to_token, meta.table_rows, meta.seq_lens)
    shape = dict(
        batch=meta.batch_size, heads=heads, kv_heads=kv_heads, lk=lk, device="cuda", num_sms=H200_SMS
    )
    if meta.max_q_len == 1:
        launch = launch_config("decode", max_seq_len=meta.max_seq_len, **shape)
        assert launch.num_splits == 3 if heads == 128 else launch.num_splits > 1  # splits really merge
        decode_attention(*args, out, lk**-0.5, launch=launch)
    else:
        launch = launch_config("extend", max_seq_len=meta.max_seq_len, max_q_len=meta.max_q_len, **shape)
        extend_attention(*args, meta.q_start, out, lk**-0.5, meta.max_q_len, launch=launch)
    ref = SdpaBackend()
    m = AttentionMetadata(**{**meta.__dict__, "state": {}})
    ref.prepare(m)
    if kv_heads == 1 and lk != lv:
        expected = ref.mla(q, k[:, 0], m, lk**-0.5, lv)
    else:
        expected = ref.gqa(q, k, v, m, lk**-0.5)
    torch.testing.assert_close(out, expected, **TOL)
