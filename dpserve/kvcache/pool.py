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

    @staticmethod
    def bytes_per_token(num_layers: int, entry_shapes: list[tuple[int, ...]], dtype: torch.dtype) -> int:
        from dpserve.memory import kv_bytes_per_token

        return kv_bytes_per_token(num_layers, entry_shapes, dtype)

    def write(self, layer: int, slots: torch.Tensor, *values: torch.Tensor) -> None:
        for buf, val in zip(self.layers[layer], values, strict=True):
            buf[slots] = val.to(buf.dtype)


class SlotAllocator:
    """Free list of token slots 1..num_tokens (kept by each group's scheduler)."""

    def __init__(self, num_tokens: int):
        self.free_slots = list(range(num_tokens, 0, -1))

    @property
    def num_free(self) -> int:
        return len(self.free_slots)

    def alloc(self, n: int) -> list[int]:
        if n > len(self.free_slots):
            raise RuntimeError(f"KV pool exhausted: asked for {n} slots, {len(self.free_slots)} free")
        out = self.free_slots[-n:][::-1] if n else []
        del self.free_slots[len(self.free_slots) - n :]
        return out

    def free(self, slots: list[int]) -> None:
        self.free_slots.extend(slots)
