"""The paged token pool of one rank: per layer, one row of KV values per token slot.

Slot 0 is never handed out: padded rows write there, so they never touch a real request.
"""

from __future__ import annotations

import torch


class KVPool:
    def __init__(
        self,
        num_layers: int,
        num_tokens: int,
        entry_shapes: list[tuple[int, ...]],
        dtype: torch.dtype,
        device: torch.device,
    ):
        self.num_tokens = num_tokens
        self.layers = [
            [torch.zeros(num_tokens + 1, *shape, dtype=dtype, device=device) for shape in entry_shapes]
            for _ in range(num_layers)
        ]

    def write(self, layer: int, slots: torch.Tensor, *values: torch.Tensor) -> None:
        for buf, val in zip(self.layers[layer], values, strict=True):
            buf[slots] = val.to(buf.dtype)
