"""The fixed-shape routed-expert path (Triton grouped GEMM in the interpreter) against the
per-expert loop the CPU runs (`dpserve.layers.mlp.experts_loop`)."""

from __future__ import annotations

import functools

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from dpserve import memory
from dpserve.layers.fused_moe import fused_experts, moe_align_block_size
from dpserve.layers.mlp import MoE, MoESpec, swiglu_clamped
from dpserve.layers.mlp import experts_loop as loop_reference
from dpserve.layers.norm import RMSNorm

TOL = dict(atol=1e-5, rtol=1e-5)


def make_case(rows, experts, top_k, hidden, inter, routing, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, hidden, generator=g)
    w13 = torch.randn(experts, 2 * inter, hidden, generator=g) / hidden**0.5
    w2 = torch.randn(experts, hidden, inter, generator=g) / inter**0.5
    if routing == "balanced":
        ids = torch.stack([torch.randperm(experts, generator=g)[:top_k] for _ in range(rows)])
    elif routing == "skewed":  # every token on expert 2 (and, for top_k > 1, spread for the rest)
        ids = torch.stack([torch.cat([torch.tensor([2]), (torch.arange(1, top_k) + 2) % experts])] * rows)
    else:  # padded: the last rows are padding, routed nowhere (ids -1)
        ids = torch.stack([torch.randperm(experts, generator=g)[:top_k] for _ in range(rows)])
        ids[rows // 2 :] = -1
    weights = torch.rand(rows, top_k, generator=g)
    return x, w13, w2, weights, ids


CASES = [
    # rows, experts, top_k, hidden, inter, routing
    (13, 8, 2, 48, 40, "balanced"),  # non-power-of-two dims: masked tiles
    (13, 8, 2, 48, 40, "skewed"),
    (9, 8, 3, 32, 24, "padded"),
    (20, 6, 1, 64, 96, "balanced"),
    (1, 8, 2, 32, 16, "balanced"),
    (1, 4, 1, 16, 16, "skewed"),
    (70, 4, 2, 80, 72, "skewed"),  # one expert's rows over several blocks
]


@pytest.mark.parametrize("case", CASES, ids=[f"{c[0]}x{c[1]}k{c[2]}-{c[5]}" for c in CASES])
def test_fused_experts_equals_loop(case):
    rows, experts, top_k, hidden, inter, routing = case
    x, w13, w2, weights, ids = make_case(*case)
    got = fused_experts(x, w13, w2, weights, ids)
    assert got.shape == x.shape and torch.isfinite(got).all()
    torch.testing.assert_close(got, loop_reference(x, w13, w2, weights, ids), **TOL)


@pytest.mark.parametrize("case", [CASES[0], CASES[2]], ids=str)
def test_fused_experts_with_biases_and_clamped_swiglu(case):
    """gpt-oss's experts: biases on both products and the clamped SwiGLU (its gate and up large
    enough that the clamp at 7 acts), the same as the CPU loop."""
    x, w13, w2, weights, ids = make_case(*case)
    g = torch.Generator().manual_seed(3)
    b13 = torch.randn(w13.shape[0], w13.shape[1], generator=g)
    b2 = torch.randn(w2.shape[0], w2.shape[1], generator=g)
    x = 8 * x
    clamp = (1.702, 7.0)
    act = functools.partial(swiglu_clamped, alpha=clamp[0], limit=clamp[1])
    assert (x @ w13[0].t() + b13[0]).abs().max() > clamp[1]  # the clamp is reached
    got = fused_experts(x, w13, w2, weights, ids, b13=b13, b2=b2, clamp=clamp)
    ref = loop_reference(x, w13, w2, weights, ids, F.linear, act, b13, b2)
    torch.testing.assert_close(got, ref, atol=1e-4, rtol=1e-5)


def test_triton_block_sizes():
    x, w13, w2, weights, ids = make_case(30, 8, 2, 48, 40, "balanced")
    ref = loop_reference(x, w13, w2, weights, ids)
    for block_m in (16, 32):
        torch.testing.assert_close(fused_experts(x, w13, w2, weights, ids, block_m=block_m), ref, **TOL)


def test_align_layout():
    ids = torch.tensor([[1, 3], [1, 0], [3, -1], [1, 1]])
    sorted_ids, expert_ids, num_padded = moe_align_block_size(ids, num_experts=4, block_m=4)
    n = ids.numel()
    # cdiv(rows * top_k + experts * (block_m - 1), block_m) blocks, whatever the routing
    assert expert_ids.shape == (5,) and sorted_ids.shape == (20,)
    assert num_padded.item() == 12  # experts 0, 1, 3: one block each
    assert expert_ids.tolist()[:3] == [0, 1, 3] and set(expert_ids.tolist()[3:]) == {-1}
    blocks = sorted_ids.view(-1, 4)
    assert blocks[0].tolist() == [3, n, n, n]  # assignment 3 = (row 1, k 1) on expert 0
    assert blocks[1].tolist() == [0, 2, 6, 7]  # expert 1, in token order
    assert blocks[2].tolist() == [1, 4, n, n]
    assert (sorted_ids[12:] == n).all()  # the dropped assignment (id -1) appears nowhere


def test_half_precision():
    x, w13, w2, weights, ids = make_case(13, 8, 2, 64, 32, "balanced")
    ref = loop_reference(x, w13, w2, weights, ids)
    for dtype in (torch.float16, torch.bfloat16):
        args = [t.to(dtype) for t in (x, w13, w2, weights)]
        got = fused_experts(*args[:4], ids)
        assert got.dtype == dtype
        torch.testing.assert_close(got.float(), ref, atol=5e-2, rtol=5e-2)


class LargestAllocations(TorchDispatchMode):
    """Records the shape and dtype of every tensor an operator returns."""

    def __init__(self):
        super().__init__()
        self.made: list[tuple[tuple[int, ...], torch.dtype]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else [out]:
            if isinstance(t, torch.Tensor):
                self.made.append((tuple(t.shape), t.dtype))
        return out


def moe_layer(hidden=32, inter=16, experts=8, top_k=2) -> MoE:
    spec = MoESpec(
        num_experts=experts,
        experts_field="n_routed_experts",
        top_k=top_k,
        intermediate_size=inter,
        shared_intermediate_size=inter,
        scoring="sigmoid",
        topk_method="noaux_tc",
        num_groups=4,
        topk_groups=2,
        norm_topk_prob=True,
        scaling=2.5,
    )
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)  # as the engine builds it: the router stays float32
    try:
        moe = MoE(spec, hidden, inter, inter)
    finally:
        torch.set_default_dtype(previous)
    g = torch.Generator().manual_seed(5)
    for p in moe.parameters():
        p.copy_(torch.randn(p.shape, generator=g) / p.shape[-1] ** 0.5)
    return moe


def test_moe_and_norm_take_rows_in_bounded_chunks(monkeypatch):
    """A prefill step's gathered rows go through the router (float32) and the experts, and through
    RMSNorm's float32 statistics, a bounded chunk at a time: no float32 copy of all the rows, and the
    same outputs and expert counts as in one piece."""
    moe, norm = moe_layer(), RMSNorm(32, 1e-6).to(torch.bfloat16)
    norm.weight.uniform_(0.5, 1.5)
    rows = 300
    x = torch.randn(rows, 32, generator=torch.Generator().manual_seed(6)).to(torch.bfloat16)
    real = torch.ones(rows, dtype=torch.long)
    whole_moe, whole_norm = moe(x, None, real), norm(x)
    whole_load = moe.load.clone()
    moe.load.zero_()
    budget = 16384  # 42 rows per chunk: 8 chunks
    monkeypatch.setattr(memory, "ACTIVATION_CHUNK_BYTES", budget)
    assert memory.moe_chunk_rows(32, 16, 2, 8, 2) == 42
    with LargestAllocations() as seen:
        chunked_moe, chunked_norm = moe(x, None, real), norm(x)
    big = [(shape, dtype) for shape, dtype in seen.made if shape and shape[0] == rows]
    assert big and all(dtype == torch.bfloat16 for _, dtype in big), big  # outputs only, no float32 copy
    assert torch.equal(chunked_norm, whole_norm) and torch.equal(moe.load, whole_load)
    torch.testing.assert_close(chunked_moe, whole_moe, atol=2e-2, rtol=2e-2)
