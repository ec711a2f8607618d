"""The paged token pool of one rank: per layer, one row of KV values per token slot.

Slot 0 is never handed out: padded rows write there, so they never touch a real request. With the
hybrid sliding-window pool, the window layers have rows for `window_tokens` slots of their own (a
second slot space: `kvcache/window.py`), the other layers for `num_tokens`.

An 8-bit pool (`--kv-cache-dtype fp8_e4m3 / fp8_e5m2`) stores each entry as `ScaledKV`: FP8 codes
and a float32 scale per token and KV head (per row of the entry's last dimension), computed from the
values as they are written, so no calibration is needed and nothing saturates. The scales are
buffers of the pool like the codes: prefix-cache hits, retraction and PD transfer carry them with
their tokens. Readers widen through `take`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

# The 8-bit pools' FP8 formats, by their mantissa bits (what a kernel needs to widen a code).
FP8_KV_MANTISSA = {torch.float8_e4m3fn: 3, torch.float8_e5m2: 2}


@dataclass(frozen=True)
class ScaledKV:
    """One 8-bit pool entry: `codes` [slots, ..., d] (FP8) times `scales` [slots, ..., 1] (float32),
    read as `dtype` (the model's)."""

    codes: torch.Tensor
    scales: torch.Tensor
    dtype: torch.dtype

    @property
    def shape(self) -> torch.Size:
        return self.codes.shape

    def write(self, slots: torch.Tensor, values: torch.Tensor) -> None:
        x = values.float()
        # The largest magnitude of each row becomes the format's largest code; an all-zero row gets
        # a scale of 1 (its codes are zeros either way).
        amax = x.abs().amax(-1, keepdim=True)
        scales = torch.where(amax > 0, amax / torch.finfo(self.codes.dtype).max, 1.0)
        self.codes[slots] = (x / scales).to(self.codes.dtype)
        self.scales[slots] = scales


def take(cache: torch.Tensor | ScaledKV, index: torch.Tensor, width: int | None = None) -> torch.Tensor:
    """cache[index] along the slots, widened to the model's dtype: [*index.shape, *cache.shape[1:]].
    With `width`, the cache is read as rows of `width` elements (slot * kv_heads + head for a GQA
    cache): [*index.shape, width]. index_select on flattened rows: ~10x faster on the CPU than
    advanced indexing."""
    shape = (width,) if width else tuple(cache.shape[1:])
    n, flat = math.prod(shape), index.reshape(-1)
    if isinstance(cache, ScaledKV):
        codes = cache.codes.reshape(-1, n).index_select(0, flat)
        scales = cache.scales.reshape(-1, n // shape[-1]).index_select(0, flat)
        rows = (codes.view(-1, shape[-1]).float() * scales.view(-1, 1)).to(cache.dtype)
    else:
        rows = cache.reshape(-1, n).index_select(0, flat)
    return rows.view(*index.shape, *shape)


def entry_bytes(shape: tuple[int, ...], dtype: torch.dtype) -> int:
    """Bytes one token's entry of `shape` takes in a pool of `dtype` (an 8-bit one's scales too)."""
    elems = math.prod(shape)
    if dtype in FP8_KV_MANTISSA:
        return elems + 4 * (elems // shape[-1])
    return elems * dtype.itemsize


class KVPool:
    def __init__(
        self,
        num_layers: int,
        num_tokens: int,
        entry_shapes: list[tuple[int, ...]],
        dtype: torch.dtype,
        device: torch.device,
        window_layers: frozenset[int] = frozenset(),
        window_tokens: int = 0,
        cache_dtype: torch.dtype | None = None,
    ):
        """`dtype`: the model's, what readers get; `cache_dtype`: what the pool stores (default:
        `dtype`; FP8 stores `ScaledKV` entries)."""
        self.num_tokens, self.window_tokens = num_tokens, window_tokens
        cache_dtype = cache_dtype or dtype

        def entry(rows: int, shape: tuple[int, ...]) -> torch.Tensor | ScaledKV:
            codes = torch.zeros(rows, *shape, dtype=cache_dtype, device=device)
            if cache_dtype not in FP8_KV_MANTISSA:
                return codes
            scales = torch.zeros(rows, *shape[:-1], 1, dtype=torch.float32, device=device)
            return ScaledKV(codes, scales, dtype)

        self.layers = [
            [entry((window_tokens if i in window_layers else num_tokens) + 1, s) for s in entry_shapes]
            for i in range(num_layers)
        ]

    def buffers(self, layer: int | None = None) -> list[torch.Tensor]:
        """The tensors holding a layer's entries (codes and scales for an 8-bit pool), or every
        layer's in order (None): what a KV transfer moves, row by row."""
        layers = self.layers if layer is None else [self.layers[layer]]
        out = []
        for entry in (e for entries in layers for e in entries):
            out += [entry.codes, entry.scales] if isinstance(entry, ScaledKV) else [entry]
        return out

    def write(self, layer: int, slots: torch.Tensor, *values: torch.Tensor) -> None:
        for entry, val in zip(self.layers[layer], values, strict=True):
            if isinstance(entry, ScaledKV):
                entry.write(slots, val)
            else:
                entry[slots] = val.to(entry.dtype)
