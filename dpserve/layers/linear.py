"""A weight-only linear layer; sharding is decided by whoever loads the weight."""

import torch
import torch.nn.functional as F
from torch import nn

from dpserve.cpu_ops import onednn_packs, pack, packed_linear
from dpserve.layers.quant import add_weight, building_spec, quantized_linear, quantized_weight


class Linear(nn.Module):
    def __init__(self, in_features: int, out_features: int, bias: bool = False, packable: bool = True):
        """`packable`: False for a layer whose weight is read as a tensor (MLA's kv_b_proj, absorbed):
        it stays in the model's dtype when the checkpoint is quantized (widened at load)."""
        super().__init__()
        add_weight(self, "weight", (out_features, in_features), building_spec() if packable else None)
        self.bias = nn.Parameter(torch.empty(out_features), requires_grad=False) if bias else None
        self.packable = packable
        self.packed: torch.Tensor | None = None  # the weight in oneDNN's layout (pack_for_cpu)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed is not None:
            return packed_linear(x, self.packed, self.bias)
        if self.weight_scale is not None:  # 8-bit (`dpserve.layers.quant`)
            w = quantized_weight(self, "weight")
            if x.is_cuda:
                from dpserve.layers.quant_triton import linear  # Triton, imported where it runs

                return linear(x, w, self.bias)
            return quantized_linear(x, w, self.bias)
        return F.linear(x, self.weight, self.bias)

    def packs(self, dtype: torch.dtype, device_type: str) -> bool:
        """Whether `pack_for_cpu` packs this layer's weight when it has this dtype and device."""
        return self.packable and onednn_packs(dtype, device_type)

    def pack_for_cpu(self) -> bool:
        """Reorders a bfloat16 CPU weight once into oneDNN's blocked layout and frees the original:
        F.linear reorders it on every call, which at decode's few rows costs as much as the GEMM
        (docs/benchmarks.md, "Prepacked weights"). Results are the same bits. False when not packed
        (another device or dtype, no native bfloat16, or a weight read as a tensor)."""
        w = self.weight
        if w is None or not self.packs(w.dtype, w.device.type):
            return False
        self.packed = pack(w)
        self.weight = None  # its storage goes: the packed copy replaces it
        return True


def pack_linears_for_cpu(model: nn.Module) -> int:
    """Packs every packable Linear of `model` and every MoE layer's experts (anything with a
    `pack_for_cpu`, after the weights are loaded); returns how many modules were packed."""
    return sum(m.pack_for_cpu() for m in model.modules() if hasattr(m, "pack_for_cpu"))
