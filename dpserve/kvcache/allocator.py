"""The host-side free list of a DP group's KV slots, kept by the group leader's scheduler (every
rank of the group then writes the slots it is told into its own pool)."""

from __future__ import annotations


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
