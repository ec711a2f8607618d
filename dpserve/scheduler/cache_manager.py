"""A DP group's KV slots as its scheduler hands them out and takes them back.

The scheduler decides who gets memory and when; the cache manager says what each request holds:
the full layers' slots (`allocator`), the prefix cache over them (`tree`: a `NullTree` under
--disable-radix-cache) and the hybrid pool's window slots (`windows`: `NullWindows` without
sliding-window layers or with --disable-hybrid-swa-memory), so no caller asks which of them exist.
A request's KV is its `slots`: the first `cached_len` are in the prefix cache, locked at `node`
(its `dup_slots` are its own copies of tokens another request cached first); it holds the window
slots of its positions from `window_lo`."""

from __future__ import annotations

from dpserve.kvcache.allocator import SlotAllocator
from dpserve.kvcache.radix_cache import Node, NullTree, RadixTree
from dpserve.kvcache.window import NullWindows, WindowSlots
from dpserve.scheduler.request import Req


class CacheManager:
    def __init__(
        self,
        capacity: int,
        radix_cache: bool,
        window_size: int,  # the window layers' width (0: no hybrid pool)
        window_capacity: int,  # their slots
        counters: dict[str, int],  # the group's: evicted cache tokens are counted there
    ):
        self.capacity = capacity
        self.allocator = SlotAllocator(capacity)
        self.tree = RadixTree() if radix_cache else NullTree()
        self.windows = WindowSlots(window_capacity, window_size) if window_size else NullWindows()
        # Window slots no query reads any more: the prefix cache keeps them while room lasts.
        self._let_go = self.windows.keep if radix_cache else self.windows.release
        self.counters = counters

    @property
    def available(self) -> int:
        """Slots a request can get now: free, or held by unlocked cache entries."""
        return self.allocator.num_free + self.tree.evictable

    def alloc(self, n: int) -> list[int]:
        """`n` free slots, evicting unlocked cache entries if the free ones are short."""
        short = n - self.allocator.num_free
        if short > 0:
            self._free_evicted(self.tree.evict(short))
        return self.allocator.alloc(n)

    def flush(self) -> None:
        """Evicts every prefix-cache entry no running request holds."""
        self._free_evicted(self.tree.evict(self.tree.evictable))

    def _free_evicted(self, evicted: list[int]) -> None:
        self.windows.drop(evicted)
        self.allocator.free(evicted)
        self.counters["cache_evicted_tokens"] += len(evicted)

    # --- a request's KV ---------------------------------------------------------------------------

    def match(self, req: Req, recompute_last: bool) -> tuple[list[int], Node | None]:
        """The cached prefix `req` can start on (its slots, and the node it ends at, locked): at least
        one token is left to prefill (its logits give the next token); `recompute_last` (NEXTN) leaves
        the last cached one too, for its hidden state; only as far as the window layers' KV of its last
        tokens is still there."""
        cached, node, _ = self.tree.match_prefix(req.fill_ids[: req.prefill_len - 1])
        if recompute_last:
            cached = cached[:-1]
        usable = self.windows.usable(cached)
        if usable < len(cached):
            cached, node, _ = self.tree.match_prefix(req.fill_ids[:usable])
        self.tree.lock(node)
        return cached, node

    def unlock(self, node: Node | None) -> None:
        """A matched prefix its request will not start on after all."""
        self.tree.unlock(node)

    def start(self, req: Req, cached: list[int], node: Node | None) -> None:
        """`req` (admitted) starts on its matched prefix, and holds the window its first queries read."""
        req.node, req.slots, req.cached_len = node, list(cached), len(cached)
        req.prefix_pending = bool(cached)
        req.window_lo = self.windows.held_from(len(cached))
        self.windows.acquire(req.slots[req.window_lo :])

    def reserve(self, req: Req) -> None:
        """Decode side: slots for `req`'s whole prompt, which the prefill side writes, and the window of
        its last tokens."""
        req.slots = self.alloc(req.prefill_len)
        req.window_lo = self.windows.held_from(req.prefill_len)
        self.windows.acquire(req.slots[req.window_lo :])

    def extend(self, req: Req, n: int) -> tuple[list[int], list[int], list[int]]:
        """`n` slots for `req`'s next tokens; returns what its step writes into its table row: the prefix
        its row lacks (after admission on a cached prefix, or the KV the prefill side wrote), the new
        slots, and the window slots its queries read beyond those already in the row."""
        slots = self.alloc(n)
        pending = req.prefix_pending
        prefix = req.slots[: req.cached_len] if pending else []
        window_slots = self.windows.slots_of(req.slots[req.window_lo : req.cached_len] if pending else [])
        window_slots += self.windows.acquire(slots)
        req.prefix_pending = False
        req.slots += slots
        return prefix, slots, window_slots

    def window_slots(self, req: Req) -> list[int]:
        """The window slots `req` holds (of its positions from `window_lo`); none without the hybrid
        pool. Under disaggregation: the prompt's last W - 1 positions, what the first decode step's
        window queries read, sent by one side and received by the other."""
        return self.windows.slots_of(req.slots[req.window_lo :])

    def free_rejected(self, req: Req, keep: int) -> None:
        """Frees the KV of `req`'s positions from `keep` on (a verify step's rejected drafts)."""
        rejected = req.slots[keep:]
        self.windows.release(rejected)
        self.allocator.free(rejected)
        del req.slots[keep:]

    def trim_windows(self, reqs: list[Req]) -> None:
        """Lets go of the window slots the next queries of the running `reqs` no longer read."""
        for req in reqs:
            if req.table_row > 0:
                self._trim(req, self.windows.held_from(req.kv_len))

    def _trim(self, req: Req, upto: int) -> None:
        if upto > req.window_lo:
            self._let_go(req.slots[req.window_lo : upto])
            req.window_lo = upto

    def cache(self, req: Req) -> None:
        """Puts `req`'s KV into the prefix cache, locked there at its new node instead of its old one."""
        tokens = req.fill_ids[: req.kv_len]
        held = self.tree.insert(tokens, req.slots)
        # Tokens another request inserted meanwhile: the tree keeps its slots, ours are copies.
        req.dup_slots += req.slots[req.cached_len : held]
        _, node, _ = self.tree.match_prefix(tokens)
        self.tree.lock(node)
        self.tree.unlock(req.node)
        req.node, req.cached_len = node, len(tokens)

    def release(self, req: Req) -> None:
        """Gives back `req`'s KV: into the prefix cache (which then may evict it), its own copies freed.
        A position past its last token (overlap scheduling ran a step after its end) is freed."""
        if req.kv_len > req.seq_len:
            self.free_rejected(req, req.seq_len)
        self._trim(req, req.kv_len)
        self.cache(req)
        self.tree.unlock(req.node)
        self.windows.drop(req.dup_slots)
        self.allocator.free(req.dup_slots)

    def free(self, slots: list[int], window: list[int]) -> None:
        """Frees slots no request holds any more (and the window slots held of them)."""
        self.windows.release(window)
        self.allocator.free(slots)

    def stats(self) -> dict[str, int]:
        return {
            "kv_used": self.capacity - self.available,
            "kv_free": self.allocator.num_free,
            "kv_cached": self.tree.size,
            "kv_evictable": self.tree.evictable,
            "kv_window_free": self.windows.num_free,
            "kv_window_cached": self.windows.cached,
            "window_evicted_tokens": self.windows.evicted,
        }
