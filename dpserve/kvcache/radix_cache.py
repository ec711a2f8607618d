"""A token-level radix tree (page size 1), as SGLang's radix cache.

Each edge holds a run of token ids and, in a DP group's KV cache, the pool slots of their KV.
Requests lock the path they use (lock counts up to the root); unlocked leaves are evicted least
recently used first, taken from a heap of candidate leaves kept as the tree changes (an eviction
never walks the tree, which can hold a whole GPU pool's tokens). The router keeps the same tree without slots, as an approximate record of
what each group holds.
"""

from __future__ import annotations

import heapq
import itertools


class Node:
    __slots__ = ("children", "parent", "key", "value", "lock", "last_access")

    def __init__(self, parent: Node | None, key: list[int], value: list[int] | None, now: int):
        self.children: dict[int, Node] = {}
        self.parent = parent
        self.key = key
        self.value = value  # pool slots of the key's tokens (None in the router's tree)
        self.lock = 0  # requests using this node (or a descendant)
        self.last_access = now


def _common_len(key: list[int], tokens: list[int], start: int) -> int:
    """How many leading tokens of `key` equal tokens[start:]."""
    n = min(len(key), len(tokens) - start)
    for i in range(n):
        if key[i] != tokens[start + i]:
            return i
    return n


def _stale(entry: tuple[int, int, Node]) -> bool:
    """Whether a heap entry's leaf was evicted, grew children, got locked or was touched since."""
    access, _, node = entry
    return node.parent is None or bool(node.children) or node.lock > 0 or node.last_access != access


class RadixTree:
    def __init__(self) -> None:
        self._clock = itertools.count(1)  # logical time: LRU order without wall-clock ties
        self.root = Node(None, [], [], 0)
        self.root.lock = 1  # never evicted
        self.size = 0  # tokens held
        self.evictable = 0  # tokens in unlocked nodes
        # Candidate leaves (last_access, tiebreak, node); entries go stale when the node is touched,
        # locked, grows children or is evicted, and are skipped when popped.
        self._leaves: list[tuple[int, int, Node]] = []
        self._tiebreak = itertools.count()
        self._num_nodes = 0

    def match_prefix(self, tokens: list[int]) -> tuple[list[int], Node, int]:
        """The longest held prefix of `tokens`: (its slots, the node it ends at, its length).
        A partly matched edge is split so that the returned node covers exactly the match."""
        now = next(self._clock)
        node, slots, i = self.root, [], 0
        while i < len(tokens):
            child = node.children.get(tokens[i])
            if child is None:
                break
            n = _common_len(child.key, tokens, i)
            if n < len(child.key):
                child = self._split(child, n)
            child.last_access = now
            if child.value is not None:
                slots += child.value
            node, i = child, i + n
        self._candidate(node)
        return slots, node, i

    def insert(self, tokens: list[int], values: list[int] | None = None) -> int:
        """Adds `tokens` (with their slots); returns how many leading tokens were already held,
        whose `values` the caller still owns (the tree keeps its own slots for them)."""
        now = next(self._clock)
        node, i = self.root, 0
        while i < len(tokens):
            child = node.children.get(tokens[i])
            if child is None:
                value = None if values is None else list(values[i:])
                leaf = node.children[tokens[i]] = Node(node, list(tokens[i:]), value, now)
                self._num_nodes += 1
                self.size += len(tokens) - i
                self.evictable += len(tokens) - i
                self._candidate(leaf)
                return i
            n = _common_len(child.key, tokens, i)
            if n < len(child.key):
                child = self._split(child, n)
            child.last_access = now
            node, i = child, i + n
        self._candidate(node)
        return i

    def lock(self, node: Node) -> None:
        while node is not None:
            if node.lock == 0:
                self.evictable -= len(node.key)
            node.lock += 1
            node = node.parent

    def unlock(self, node: Node) -> None:
        while node is not None:
            node.lock -= 1
            if node.lock == 0:
                self.evictable += len(node.key)
                self._candidate(node)
            node = node.parent

    def evict(self, num_tokens: int) -> list[int]:
        """Removes unlocked leaves, least recently used first, until `num_tokens` tokens are gone
        (or nothing evictable is left); returns the removed slots."""
        freed: list[int] = []
        removed = 0
        while removed < num_tokens and self._leaves:
            entry = heapq.heappop(self._leaves)
            if _stale(entry):
                continue
            leaf = entry[2]
            parent = leaf.parent
            del parent.children[leaf.key[0]]
            leaf.parent = None
            self._num_nodes -= 1
            removed += len(leaf.key)
            self.size -= len(leaf.key)
            self.evictable -= len(leaf.key)
            if leaf.value is not None:
                freed += leaf.value
            self._candidate(parent)
        return freed

    def _candidate(self, node: Node) -> None:
        """Pushes `node` if it is an evictable leaf now; rebuilds the heap when stale entries
        outnumber the nodes, so it stays proportional to the tree."""
        if node.children or node.lock or node.parent is None:
            return
        heapq.heappush(self._leaves, (node.last_access, next(self._tiebreak), node))
        if len(self._leaves) > 2 * self._num_nodes + 64:
            self._leaves = [e for e in self._leaves if not _stale(e)]
            heapq.heapify(self._leaves)

    def _split(self, child: Node, n: int) -> Node:
        """Cuts `child`'s edge after n tokens; returns the new upper node."""
        value = None if child.value is None else child.value[:n]
        mid = Node(child.parent, child.key[:n], value, child.last_access)
        mid.lock = child.lock
        mid.children = {child.key[n]: child}
        child.parent.children[child.key[0]] = mid
        child.key = child.key[n:]
        child.value = None if child.value is None else child.value[n:]
        child.parent = mid
        self._num_nodes += 1
        return mid


class NullTree:
    """The prefix cache of a group run with --disable-radix-cache: it matches and keeps nothing, so
    whoever inserts tokens still owns every slot of them."""

    size = 0
    evictable = 0

    def match_prefix(self, tokens: list[int]) -> tuple[list[int], None, int]:
        return [], None, 0

    def insert(self, tokens: list[int], values: list[int] | None = None) -> int:
        return len(tokens)  # as if all were held already: the caller keeps their slots

    def lock(self, node: None) -> None:
        pass

    def unlock(self, node: None) -> None:
        pass

    def evict(self, num_tokens: int) -> list[int]:
        return []
