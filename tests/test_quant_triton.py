"""The GPU's kernels for 8-bit weights (`dpserve.layers.quant_triton`, the fused MoE's quantized
forms), in Triton's interpreter, against the CPU's plain PyTorch forms they must equal: block FP8
weight-only (a rank's part starting inside a block, in rows and columns; gate and up parts of w13
each with their own first block) and W8A8-INT8 (activations quantized per row)."""

from __future__ import annotations

import dataclasses
import functools

import pytest
import torch

from dpserve.layers import quant_triton
from dpserve.layers.fused_moe import fused_experts
from dpserve.layers.mlp import experts_loop, silu_and_mul, swiglu_clamped
from dpserve.layers.quant import (
    PER_ROW,
    QuantizedWeight,
    QuantSpec,
    fp8_linear,
    int8_linear,
    quantize,
    quantize_groups_fp8,
)

FP8_BLOCK = (16, 32)  # small blocks, so that the tiles (64 wide) cross several


def part_of(w: torch.Tensor, spec: QuantSpec, rows: list[range], cols: range) -> QuantizedWeight:
    """`w` quantized whole as a checkpoint stores it, then a rank's part as the loader keeps it:
    the rows of each range in `rows` one after another (a fused parameter's parts: gate | up),
    the columns of `cols`, and the scales of every block they touch."""
    q, scale = quantize(w, spec)
    b0, b1 = spec.block
    row_ids = torch.tensor([r for part in rows for r in part])
    col_ids = torch.tensor(list(cols))
    row_block = row_ids // b0
    col_block = col_ids // b1 if b1 != PER_ROW else torch.zeros_like(col_ids)
    return QuantizedWeight(q[row_ids][:, col_ids].contiguous(), scale, row_block, col_block)


def plain(x: torch.Tensor, w: QuantizedWeight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """The CPU's plain PyTorch forms (whose bits the fused CPU kernels give)."""
    if w.q.dtype == torch.int8:
        return int8_linear(x, w.q, w.scale[w.row_block, 0], bias)
    return fp8_linear(x, w, bias)


SPECS = {"fp8": QuantSpec("fp8", FP8_BLOCK), "w8a8_int8": QuantSpec("w8a8_int8", (1, PER_ROW))}


@pytest.mark.parametrize("method", SPECS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_linear_equals_the_plain_form(method, dtype):
    """Rows 5..99 and columns 7..199 of a 100 x 200 weight (both starting inside a block), at 1, 3
    and 40 tokens (one and several row tiles), with a bias; a token of zeros."""
    g = torch.Generator().manual_seed(0)
    w = torch.randn(100, 200, generator=g)
    part = part_of(w, SPECS[method], [range(5, 100)], range(7, 200))
    bias = torch.randn(95, generator=g)
    for tokens in (1, 3, 40):
        x = torch.randn(tokens, 193, generator=g).to(dtype)
        x[tokens // 2] = 0
        got = quant_triton.linear(x, part, bias.to(dtype))  # a Linear's bias: the model's dtype
        want = plain(x, part, bias.to(dtype))
        assert got.dtype == dtype and got.shape == want.shape
        # float32: int8's sums are exact and scaled in the CPU's order, FP8's float32 sums in
        # another order; bfloat16: the plain form rounds its product and its bias sum apart, so
        # two roundings of the largest output apart.
        if dtype == torch.float32:
            tol = dict(rtol=0, atol=0) if method == "w8a8_int8" else dict(rtol=1e-5, atol=1e-5)
        else:
            tol = dict(rtol=0, atol=2 * torch.finfo(dtype).eps * want.float().abs().max().item())
        torch.testing.assert_close(got, want, **tol)


def moe_weights(spec: QuantSpec, experts: int, hidden: int, inter: int, first: int, g: torch.Generator):
    """Stacked experts' w13 and w2 as a TP rank holds them: of each expert's whole intermediate
    rows (2 x 96), the part [first, first + inter) of the gate and of the up rows, and w2's
    columns of the same part: parts that start inside a block."""
    whole = 96
    w13 = torch.randn(experts, 2 * whole, hidden, generator=g) / hidden**0.5
    w2 = torch.randn(experts, hidden, whole, generator=g) / whole**0.5
    part = range(first, first + inter)
    gate_up = [part, range(whole + first, whole + first + inter)]
    p13 = [part_of(w, spec, gate_up, range(hidden)) for w in w13]
    p2 = [part_of(w, spec, [range(hidden)], part) for w in w2]

    def stack(parts: list[QuantizedWeight]) -> QuantizedWeight:
        return QuantizedWeight(
            torch.stack([p.q for p in parts]),
            torch.stack([p.scale for p in parts]),
            parts[0].row_block,
            parts[0].col_block,
        )

    return stack(p13), stack(p2)


@pytest.mark.parametrize("method", SPECS)
def test_fused_moe_equals_the_experts_loop(method):
    """Eight experts, 70 intermediate rows of each from row 9 (a TP part inside a block), 24 rows
    with top 3 (an expert of another rank, -1, skipped); then gpt-oss's biases and clamped SwiGLU."""
    g = torch.Generator().manual_seed(1)
    experts, hidden, inter, rows, top_k = 8, 80, 70, 24, 3
    w13, w2 = moe_weights(SPECS[method], experts, hidden, inter, 9, g)
    x = torch.randn(rows, hidden, generator=g)
    weights = torch.rand(rows, top_k, generator=g)
    ids = torch.stack([torch.randperm(experts + 2, generator=g)[:top_k] for _ in range(rows)])
    ids = torch.where(ids < experts, ids, -1)
    want = experts_loop(x, w13, w2, weights, ids, plain, silu_and_mul)
    torch.testing.assert_close(fused_experts(x, w13, w2, weights, ids), want, rtol=2e-5, atol=2e-5)
    b13, b2 = torch.randn(experts, 2 * inter, generator=g), torch.randn(experts, hidden, generator=g)
    act = functools.partial(swiglu_clamped, alpha=1.702, limit=7.0)
    want = experts_loop(x, w13, w2, weights, ids, plain, act, b13, b2)
    got = fused_experts(x, w13, w2, weights, ids, b13=b13, b2=b2, clamp=(1.702, 7.0))
    torch.testing.assert_close(got, want, rtol=2e-5, atol=2e-5)


# FP8 dots (DeepSeek's w8a8 recipe: GPUs from sm89, where the loader sets QuantizedWeight.group) ---


def fp8_dots_reference(x: torch.Tensor, w: QuantizedWeight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """The recipe computed apart, in float64: each 1 x group of x's columns quantized to FP8 (its
    largest magnitude mapped to 448), its dot with W's codes times its scale and its block's."""
    out = torch.zeros(x.shape[0], w.q.shape[0], dtype=torch.float64)
    for g0 in range(0, x.shape[1], w.group):
        xg = x[:, g0 : g0 + w.group].float()
        xs = xg.abs().amax(-1, keepdim=True).clamp(min=1e-10) / 448
        xq = (xg / xs).to(torch.float8_e4m3fn).double()
        ws = w.scale[w.row_block, w.col_block[g0]].double()
        out += (xq @ w.q[:, g0 : g0 + w.group].double().T) * xs.double() * ws
    return (out + (0 if bias is None else bias.double())).to(x.dtype)


def either(x: torch.Tensor, w: QuantizedWeight, bias: torch.Tensor | None = None) -> torch.Tensor:
    return fp8_dots_reference(x, w, bias) if w.group else plain(x, w, bias)


def test_fp8_dots_follow_deepseeks_w8a8_recipe():
    """Rows 5..99 and columns 32..199 of a 100 x 200 weight in 16 x 32 blocks (columns from a block
    boundary, rows inside one, a ragged last group), at 1 and 40 tokens with a bias and a token of
    zeros; then the fused MoE with both weights under FP8 dots (the intermediate part on a block
    boundary), and with w2 weight-only beside them (its part inside a block, as the loader keeps it)."""
    g = torch.Generator().manual_seed(3)
    spec = SPECS["fp8"]
    part = dataclasses.replace(
        part_of(torch.randn(100, 200, generator=g), spec, [range(5, 100)], range(32, 200)), group=32
    )
    bias = torch.randn(95, generator=g)
    for tokens in (1, 40):
        x = torch.randn(tokens, 168, generator=g)
        x[tokens // 2] = 0
        want = fp8_dots_reference(x, part, bias)
        torch.testing.assert_close(quant_triton.linear(x, part, bias), want, rtol=1e-5, atol=1e-5)
    experts, hidden, rows, top_k = 8, 96, 24, 3
    x = torch.randn(rows, hidden, generator=g)
    weights = torch.rand(rows, top_k, generator=g)
    ids = torch.stack([torch.randperm(experts, generator=g)[:top_k] for _ in range(rows)])
    for first, inter in ((32, 64), (9, 70)):
        w13, w2 = moe_weights(spec, experts, hidden, inter, first, g)
        w13 = dataclasses.replace(w13, group=32)
        w2 = dataclasses.replace(w2, group=32 if first % 32 == 0 else 0)
        want = experts_loop(x, w13, w2, weights, ids, either, silu_and_mul)
        torch.testing.assert_close(fused_experts(x, w13, w2, weights, ids), want, rtol=1e-5, atol=1e-5)


def test_fp8_activation_groups():
    """quant.quantize_groups_fp8: each group's largest magnitude becomes 448, every value within half
    an FP8 step (e4m3: 3 mantissa bits) of codes x scale, a group of zeros scale 1e-10 / 448 and codes
    0, a ragged last group."""
    x = torch.randn(3, 70) * torch.tensor([1e-3, 1.0, 1e3])[:, None]
    x[1, 64:] = 0
    codes, scale = quantize_groups_fp8(x, 32)
    assert codes.dtype == torch.float8_e4m3fn and codes.shape == (3, 70) and scale.shape == (3, 3)
    groups = [slice(0, 32), slice(32, 64), slice(64, 70)]
    for j, cols in enumerate(groups):
        amax = x[:, cols].abs().amax(-1)
        torch.testing.assert_close(scale[:, j], amax.clamp(min=1e-10) / 448)
        back = codes[:, cols].float() * scale[:, j : j + 1]
        assert ((back - x[:, cols]).abs() <= x[:, cols].abs() * 2**-4 + 1e-30).all()
    assert codes[1, 64:].float().eq(0).all() and codes.float().abs().amax(-1).eq(448).all()


def test_the_kernels_read_nothing_back_for_captured_graphs():
    """Every 8-bit form through the GEMM and the fused MoE (activation quantizers included) under
    tests/test_sync_free.py's check: no op whose result the host must see, no host data copied in."""
    from test_sync_free import forbid_host_syncs

    g = torch.Generator().manual_seed(4)
    x = torch.randn(5, 96, generator=g)
    weights = torch.rand(5, 2, generator=g)
    ids = torch.tensor([[0, 3], [1, -1], [2, 3], [0, 1], [3, 2]])
    for method, group in (("fp8", 0), ("w8a8_int8", 0), ("fp8", 32)):
        w13, w2 = moe_weights(SPECS[method], 4, 96, 64, 32, g)
        w13, w2 = dataclasses.replace(w13, group=group), dataclasses.replace(w2, group=group)
        with forbid_host_syncs():
            quant_triton.linear(x, w13[0])
            fused_experts(x, w13, w2, weights, ids)
