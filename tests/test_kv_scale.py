"""The KV bookkeeping of a GPU-sized pool: host memory and time follow the slots in use, never the
pool's size (a tiny model on an H200 has ~5e8 slots), and eviction never walks the whole tree."""

from __future__ import annotations

import random
import time
import tracemalloc

import pytest

from dpserve.kvcache.allocator import SlotAllocator
from dpserve.kvcache.radix_cache import RadixTree


def _churn(size: int) -> tuple[SlotAllocator, float]:
    """A pool of `size` slots after a few requests and 2,000 decode-like steps, and the seconds taken."""
    begin = time.perf_counter()
    pool = SlotAllocator(size)
    held = [pool.alloc(n) for n in (4096, 1, 7, 300, 1)]
    for slots in held[::2]:
        pool.free(slots)
    for _ in range(2000):  # decode-like churn: one slot per request per step
        pool.free(pool.alloc(1))
    return pool, time.perf_counter() - begin


def test_billion_slot_pool_is_instant_and_small():
    """Time and memory do not grow with the pool's size: a billion slots churn as fast as 10,000
    (best of three, measured side by side: no figure that depends on the machine's speed)."""
    small = min(_churn(10**4)[1] for _ in range(3))
    tracemalloc.start()
    pool, seconds = _churn(10**9)
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    seconds = min(seconds, *(_churn(10**9)[1] for _ in range(2)))
    assert seconds < 3 * small, (seconds, small)  # a per-slot structure: ~10^5 times slower
    assert peak < 2 * 2**20, peak  # the old list of ints: ~36 GB
    assert pool.num_free == 10**9 - 1 - 300


def test_slots_are_handed_out_once_and_reused_first():
    pool = SlotAllocator(10)
    a = pool.alloc(4)
    assert a == [1, 2, 3, 4]
    b = pool.alloc(3)
    assert b == [5, 6, 7]
    pool.free([4, 1, 3, 2])  # freed out of order: still reused before untouched slots
    assert sorted(pool.alloc(4)) == [1, 2, 3, 4] and pool.alloc(3) == [8, 9, 10]
    pool.free(b)
    assert pool.alloc(3) == [5, 6, 7]
    with pytest.raises(RuntimeError, match="KV pool exhausted: asked for 1 slots, 0 free"):
        pool.alloc(1)


def test_random_churn_never_duplicates_a_slot():
    rng = random.Random(0)
    pool, held = SlotAllocator(500), []
    for _ in range(3000):
        if held and (rng.random() < 0.5 or pool.num_free == 0):
            slots = held.pop(rng.randrange(len(held)))
            pool.free(rng.sample(slots, len(slots)) if rng.random() < 0.3 else slots)
        else:
            held.append(pool.alloc(rng.randint(0, min(40, pool.num_free))))
        in_use = [s for slots in held for s in slots]
        assert len(set(in_use)) == len(in_use) and pool.num_free == 500 - len(in_use)
    rest = pool.alloc(pool.num_free)
    assert sorted(rest + in_use) == list(range(1, 501))


def nodes(tree: RadixTree) -> list:
    out, stack = [], list(tree.root.children.values())
    while stack:
        out.append(stack.pop())
        stack += out[-1].children.values()
    return out


def leaves(tree: RadixTree) -> list:
    return [n for n in nodes(tree) if not n.children]


def test_eviction_is_least_recently_used_first():
    rng = random.Random(1)
    tree, locked, next_slot = RadixTree(), [], 1
    for _ in range(400):
        tokens = [rng.randrange(4) for _ in range(rng.randint(1, 12))]
        op = rng.random()
        if op < 0.5:
            values = list(range(next_slot, next_slot + len(tokens)))
            next_slot += len(tokens)
            tree.insert(tokens, values)
        elif op < 0.7:
            _, node, _ = tree.match_prefix(tokens)
            tree.lock(node)
            locked.append(node)
        elif op < 0.8 and locked:
            tree.unlock(locked.pop(rng.randrange(len(locked))))
        else:
            access = {s: n.last_access for n in leaves(tree) if not n.lock for s in n.value}
            want = rng.randint(1, 10)
            before = tree.evictable
            freed = tree.evict(want)
            assert len(freed) >= min(want, before) and tree.evictable == before - len(freed)
            remaining = [n.last_access for n in leaves(tree) if not n.lock]
            # Leaves were popped oldest first (a parent left bare is never older than its child).
            if freed and remaining and all(s in access for s in freed):
                assert max(access[s] for s in freed) <= min(remaining)
        assert tree.size == sum(len(n.key) for n in nodes(tree))
        assert tree.evictable == sum(len(n.key) for n in nodes(tree) if not n.lock)


def test_eviction_cost_does_not_grow_with_the_tree():
    """Evicting 10,000 leaves one at a time costs less than inserting the 20,000 did (measured side by
    side; the old walk visited every node per eviction: 10,000 x 20,000)."""
    tree = RadixTree()
    n = 20_000
    begin = time.perf_counter()
    for i in range(n):  # 20,000 leaves under one shared prefix
        tree.insert([0, 1, 2, i + 3], [4 * i + 1, 4 * i + 2, 4 * i + 3, 4 * i + 4])
    inserting = time.perf_counter() - begin
    begin = time.perf_counter()
    freed = [tree.evict(1) for _ in range(n // 2)]
    seconds = time.perf_counter() - begin
    assert seconds < inserting, (seconds, inserting)
    assert [f[0] for f in freed[:3]] == [4, 8, 12]  # the oldest leaves first, one token each
    assert tree.size == 3 + n - n // 2
