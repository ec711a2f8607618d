"""Rotary position embeddings, including DeepSeek's YaRN scaling."""

from __future__ import annotations

import math

import torch
from torch import nn

from dpserve import cpu_ops


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def yarn_softmax_scale(rope: dict) -> float:
    """The extra factor DeepSeek's YaRN applies to the attention softmax scale."""
    if rope.get("rope_type", "default") != "yarn" or not rope.get("mscale_all_dim"):
        return 1.0
    return _yarn_mscale(rope["factor"], rope["mscale_all_dim"]) ** 2


def _inv_freq(dim: int, rope: dict, max_positions: int) -> tuple[torch.Tensor, float]:
    base = rope.get("rope_theta", 10000.0)
    pos_freqs = base ** (torch.arange(0, dim, 2, dtype=torch.float) / dim)
    rope_type = rope.get("rope_type", "default")
    if rope_type == "default":
        return 1.0 / pos_freqs, 1.0
    if rope_type != "yarn":
        raise ValueError(f"unsupported rope_type {rope_type!r}")
    factor = rope.get("factor") or max_positions / rope["original_max_position_embeddings"]
    orig = rope["original_max_position_embeddings"]
    beta_fast, beta_slow = rope.get("beta_fast") or 32, rope.get("beta_slow") or 1
    mscale, mscale_all = rope.get("mscale"), rope.get("mscale_all_dim")
    attention_factor = rope.get("attention_factor")
    if attention_factor is None:
        if mscale and mscale_all:
            attention_factor = _yarn_mscale(factor, mscale) / _yarn_mscale(factor, mscale_all)
        else:
            attention_factor = _yarn_mscale(factor)

    def correction_dim(rotations: float) -> float:
        return dim * math.log(orig / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if rope.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    extrapolation = 1 - ramp
    inv = (1.0 / (factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation
    return inv, attention_factor


class RotaryEmbedding(nn.Module):
    """Applies RoPE to [tokens, heads, dim] tensors (queries and keys in one call where they can).

    interleaved=True rotates adjacent pairs (x0, x1), (x2, x3)... as DeepSeek checkpoints do;
    False rotates the two halves (x[:d/2], x[d/2:]) as Llama does. A head wider than `dim` has only
    its first `dim` values rotated (partial rotary), the rest passed through.
    """

    def __init__(self, dim: int, max_positions: int, rope: dict, interleaved: bool):
        super().__init__()
        inv_freq, attention_factor = _inv_freq(dim, rope, max_positions)
        freqs = torch.outer(torch.arange(max_positions, dtype=torch.float), inv_freq)
        # cos | sin of each position, computed in float32 and kept in the model's dtype (the default
        # one while the model is built): one lookup per call, the same bits as casting at each call.
        cos_sin = torch.cat((freqs.cos(), freqs.sin()), dim=-1) * attention_factor
        self.register_buffer("cos_sin", cos_sin.to(torch.get_default_dtype()), persistent=False)
        self.interleaved = interleaved

    def forward(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        dim = self.cos_sin.shape[-1]
        if x.shape[-1] > dim:
            return torch.cat([self._rotate(x[..., :dim], positions), x[..., dim:]], dim=-1)
        return self._rotate(x, positions)

    def _rotate(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        if x.dtype == self.cos_sin.dtype and x.stride(-1) == 1 and cpu_ops.usable(x):
            return torch.ops.dpserve_cpu.rotary(x, self.cos_sin, positions, self.interleaved)
        return rotate(x, self.cos_sin, positions, self.interleaved)


def rotate(
    x: torch.Tensor, cos_sin: torch.Tensor, positions: torch.Tensor, interleaved: bool
) -> torch.Tensor:
    """x [tokens, heads, dim] rotated at `positions` by a [max_positions, dim] table of cos | sin."""
    cos, sin = cos_sin[positions].unsqueeze(1).to(x.dtype).chunk(2, dim=-1)
    if interleaved:
        x1, x2 = x[..., 0::2], x[..., 1::2]
        return torch.stack((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).flatten(-2)
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
