"""The paged token pool of one rank: per layer, one row of KV values per token slot.

Slot 0 is never handed out: padded rows write there, so they never touch a real request. With the
hybrid sliding-window pool, the window layers have rows for `window_tokens` slots of their own (a
second slot space: `kvcache/window.py`), the other layers for `num_tokens`.
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
        window_layers: frozenset[int] = frozenset(),
        window_tokens: int = 0,
    ):
        self.num_tokens, self.window_tokens = num_tokens, window_tokens
        self.layers = [
            [
                torch.zeros(
                    (window_tokens if i in window_layers else num_tokens) + 1,
                    *shape,
                    dtype=dtype,
                    device=device,
                )
                for shape in entry_shapes
            ]
            for i in range(num_layers)
        ]

    def write(self, layer: int, slots: torch.Tensor, *values: torch.Tensor) -> None:
        for buf, val in zip(self.layers[layer], values, strict=True):
            buf[slots] = val.to(buf.dtype)
