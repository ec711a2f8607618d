"""The second slot space of the hybrid sliding-window pool (SGLang's hybrid SWA memory), kept by a
DP group's scheduler beside its full-layer SlotAllocator.

A layer with a sliding window of W reads, for a query at position p, only positions (p - W, p]:
once a request has passed a position by W, its window layers never read that position's KV again.
So window layers keep their KV in a pool of their own, usually much smaller than the full layers'
(`--swa-full-tokens-ratio`), and a token has a window slot only while something needs it:

- a running request holds the window slots of its last W - 1 positions (those its next query
  reads) and of the tokens of the step in flight;
- the prefix cache keeps the window slots of the tokens it holds once no request needs them any
  more, as a cache: evicted oldest first when new tokens need room, before anything else waits;
- a token's window slot is found by its full slot (one mapping, whatever holds it), so the radix
  tree stays as it is: a cached prefix is usable as far as its last W - 1 tokens still have window
  slots (`usable`), else only up to the longest shorter prefix whose window survived.

Host structures hold one entry per token with a window slot, never per slot of the pool.
"""

from __future__ import annotations

from collections import OrderedDict

from dpserve.kvcache.allocator import SlotAllocator


class WindowSlots:
    def __init__(self, num_tokens: int, window_size: int):
        self.allocator = SlotAllocator(num_tokens)
        self.num_tokens, self.window_size = num_tokens, window_size
        self._slots: dict[int, list[int]] = {}  # full slot -> [window slot, holders]
        self._cached: OrderedDict[int, None] = OrderedDict()  # full slots the cache holds, oldest first
        self.evicted = 0  # window slots the cache gave up for new tokens

    @property
    def num_free(self) -> int:
        return self.allocator.num_free

    @property
    def cached(self) -> int:
        """Tokens whose window KV the prefix cache holds."""
        return len(self._cached)

    def acquire(self, full: list[int]) -> list[int]:
        """The window slots of tokens by their full slots, held once more: fresh ones for new tokens
        (the cache's oldest give way when the pool is short), the same ones for tokens that have one."""
        new = sum(f not in self._slots for f in full)
        self.reclaim(new - self.allocator.num_free)
        fresh = iter(self.allocator.alloc(new))
        out = []
        for f in full:
            entry = self._slots.get(f)
            if entry is None:
                entry = self._slots[f] = [next(fresh), 0]
            entry[1] += 1
            out.append(entry[0])
        return out

    def slots_of(self, full: list[int]) -> list[int]:
        return [self._slots[f][0] for f in full]

    def release(self, full: list[int]) -> None:
        """Drops one hold of each; a window slot no one holds is free again."""
        freed = []
        for f in full:
            entry = self._slots[f]
            entry[1] -= 1
            if entry[1] == 0:
                freed.append(entry[0])
                del self._slots[f]
        self.allocator.free(freed)

    def keep(self, full: list[int]) -> None:
        """Hands a request's holds over to the prefix cache (which holds each token once)."""
        for f in full:
            if f in self._cached:
                self._cached.move_to_end(f)
                self.release([f])
            else:
                self._cached[f] = None

    def drop(self, full: list[int]) -> None:
        """Tokens whose full slots are freed: the cache lets their window slots go too."""
        gone = [f for f in full if f in self._cached]
        for f in gone:
            del self._cached[f]
        self.release(gone)

    def reclaim(self, n: int) -> None:
        """Lets the cache's oldest window slots go until `n` more are free (or it holds none)."""
        while n > 0 and self._cached:
            f, _ = self._cached.popitem(last=False)
            before = self.allocator.num_free
            self.release([f])
            n -= self.allocator.num_free - before
            self.evicted += 1

    def held_from(self, num_tokens: int) -> int:
        """The first of the positions a request of `num_tokens` tokens holds window slots of: its
        last W - 1, which its next query reads."""
        return max(0, num_tokens - (self.window_size - 1))

    def usable(self, full: list[int]) -> int:
        """The longest prefix of a cached sequence (its full slots `full`) a request can start on:
        one whose last W - 1 tokens all still have window slots."""
        m, tail = len(full), self.window_size - 1
        while m > 0:
            gap = next(
                (i for i in range(m - 1, max(0, m - tail) - 1, -1) if full[i] not in self._slots), None
            )
            if gap is None:
                return m
            m = gap
        return 0


class NullWindows:
    """The window slots of a pool without sliding-window layers (or with --disable-hybrid-swa-memory):
    none are held, every cached prefix is usable whole."""

    window_size = 0
    num_free = cached = evicted = 0

    def acquire(self, full: list[int]) -> list[int]:
        return []

    def slots_of(self, full: list[int]) -> list[int]:
        return []

    def release(self, full: list[int]) -> None:
        pass

    keep = drop = release

    def held_from(self, num_tokens: int) -> int:
        return num_tokens  # nothing is held

    def usable(self, full: list[int]) -> int:
        return len(full)
