"""Linear layers on the CPU in bfloat16 run on weights packed once for oneDNN: the same bits as
F.linear on the plain weight, at every row count, with the plain weight's storage freed."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from dpserve.layers.linear import Linear, pack_linears_for_cpu

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
