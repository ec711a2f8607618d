import torch
from torch import nn

from dpserve import cpu_ops
from dpserve.memory import chunk_rows


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim), requires_grad=False)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # The float32 statistics of a bounded chunk of rows at a time (the gathered rows of a long
        # prefill step would otherwise be copied whole in float32, twice).
        step = chunk_rows(2 * 4 * x.shape[-1])
        if x.shape[0] <= step:
            return self._norm(x)
        out = x.new_empty(x.shape, dtype=torch.promote_types(self.weight.dtype, x.dtype))
        for lo in range(0, x.shape[0], step):
            out[lo : lo + step] = self._norm(x[lo : lo + step])
        return out

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == self.weight.dtype and cpu_ops.usable(x):
            return torch.ops.dpserve_cpu.rms_norm(x, self.weight, self.eps)
        return rms_norm(x, self.weight, self.eps)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm as transformers computes it: float32 statistics, the normed rows back in x's dtype."""
    dtype = x.dtype
    x = x.float()
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x.to(dtype)
