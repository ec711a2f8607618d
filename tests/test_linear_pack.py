"""Linear layers and MoE experts on the CPU in bfloat16 run on weights packed once for oneDNN: the
same bits as F.linear on the plain weights, at every row count, with the plain weights' storage freed."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from dpserve.layers.linear import Linear, pack_linears_for_cpu
from dpserve.layers.mlp import MoE, MoESpec

pytestmark = pytest.mark.skipif(
    not torch.ops.mkldnn._is_mkldnn_bf16_supported(), reason="this CPU has no oneDNN bfloat16"
)


def linear(bias: bool, dtype: torch.dtype = torch.bfloat16, packable: bool = True) -> Linear:
    layer = Linear(96, 160, bias=bias, packable=packable)
    g = torch.Generator().manual_seed(3)
    layer.weight.data = torch.randn(160, 96, generator=g).to(dtype)
    if bias:
        layer.bias.data = torch.randn(160, generator=g).to(dtype)
    return layer


@pytest.mark.parametrize("bias", [False, True])
def test_packed_linear_gives_the_same_bits(bias):
    layer = linear(bias)
    weight = layer.weight.detach().clone()
    inputs = [torch.randn(rows, 96).to(torch.bfloat16) for rows in (0, 1, 16, 64, 300)]
    inputs += [torch.randn(3, 5, 96).to(torch.bfloat16), torch.randn(8, 200).to(torch.bfloat16)[:, 7:103]]
    expected = [F.linear(x, weight, layer.bias) for x in inputs]
    assert layer.pack_for_cpu() and layer.weight is None and layer.packed is not None
    for x, want in zip(inputs, expected, strict=True):
        assert torch.equal(layer(x), want), x.shape


def test_only_packable_bfloat16_cpu_layers_are_packed():
    model = torch.nn.ModuleList([linear(False), linear(False, torch.float32), linear(False, packable=False)])
    assert pack_linears_for_cpu(model) == 1
    assert model[0].weight is None and model[1].weight is not None and model[2].weight is not None


def moe(dtype: torch.dtype = torch.bfloat16) -> MoE:
    spec = MoESpec(
        num_experts=6,
        experts_field="n_routed_experts",
        top_k=2,
        intermediate_size=40,
        shared_intermediate_size=24,
        scoring="softmax",
        topk_method="greedy",
    )
    layer = MoE(spec, 96, intermediate_local=40, shared_local=24)
    g = torch.Generator().manual_seed(5)
    for p in layer.parameters():
        p.data = (torch.randn(p.shape, generator=g) / 8).to(torch.float32 if p is layer.gate else dtype)
    return layer


def test_packed_experts_give_the_same_bits():
    """Every local expert is packed (with the shared experts' linears), the stacked weights freed,
    and the layer's output is unchanged at every row count, several experts per row."""
    layer = moe()
    inputs = [torch.randn(rows, 96).to(torch.bfloat16) for rows in (0, 1, 5, 64)]
    expected = [layer(x) for x in inputs]
    assert pack_linears_for_cpu(layer) == 3  # the experts, the shared experts' gate_up and down
    assert layer.w13 is None and layer.w2 is None and [len(p) for p in layer.packed] == [6, 6]
    for x, want in zip(inputs, expected, strict=True):
        assert torch.equal(layer(x), want), x.shape


def test_float32_experts_are_not_packed():
    layer = moe(torch.float32)
    assert not layer.pack_for_cpu() and layer.packed is None and layer.w13 is not None
