"""The host-side free list of a DP group's KV slots, kept by the group leader's scheduler (every
rank of the group then writes the slots it is told into its own pool)."""

from __future__ import annotations

from array import array


class SlotAllocator:
    """Free slots 1..num_tokens as a stack of runs [start, end): its size follows how fragmented
    the slots in use have made the pool, never the pool's size (a GPU pool holds ~10^9 slots)."""

    def __init__(self, num_tokens: int):
        # Two flat arrays, not tuples: a fragmented pool costs 16 bytes per run.
        self._starts = array("q", [1] if num_tokens else [])
        self._ends = array("q", [num_tokens + 1] if num_tokens else [])
        self.num_free = num_tokens

    def alloc(self, n: int) -> list[int]:
        if n > self.num_free:
            raise RuntimeError(f"KV pool exhausted: asked for {n} slots, {self.num_free} free")
        out: list[int] = []
        while len(out) < n:
            start, end = self._starts[-1], self._ends[-1]
            take = min(n - len(out), end - start)
            out.extend(range(start, start + take))
            if start + take == end:
                self._starts.pop()
                self._ends.pop()
            else:
                self._starts[-1] = start + take
        self.num_free -= n
        return out

    def free(self, slots: list[int]) -> None:
        """Returns `slots` to the top of the stack, so that the next alloc reuses them (in order)."""
        runs: list[tuple[int, int]] = []
        for slot in slots:
            if runs and runs[-1][1] == slot:
                runs[-1] = (runs[-1][0], slot + 1)
            else:
                runs.append((slot, slot + 1))
        for start, end in reversed(runs):
            if self._starts and self._starts[-1] == end:  # the freed run continues the top one
                self._starts[-1] = start
            else:
                self._starts.append(start)
                self._ends.append(end)
        self.num_free += len(slots)
