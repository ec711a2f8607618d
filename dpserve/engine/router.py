"""Routing requests across DP groups (or replicas), with load counted by the front end itself.

The load of a group is updated the moment a request is routed to it, not when a worker reports
back, so a burst of requests spreads at once. Every method picks among the groups with a free
running slot (fewer requests in flight than --max-running-requests gives a group) while any has
one: no request waits behind a full group while another could start it, whatever its prefix.

    cache_aware      the group whose prefix cache most likely holds the prompt's beginning, by an
                     approximate radix tree of the token ids sent to each group (bounded, LRU);
                     below `cache_threshold` of the prompt matched, or when the groups' loads
                     drift apart (max - min > balance_abs_threshold tokens and max >
                     balance_rel_threshold * min), the least-loaded group (as minimum_tokens)
    minimum_tokens   fewest outstanding tokens: prompt tokens not yet prefilled + the remaining
                     decode budgets (max_new_tokens - generated) of every request in flight
    shortest_queue   fewest requests in flight
    round_robin      groups in turn
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

from dpserve.config import EngineConfig
from dpserve.kvcache.radix_cache import RadixTree


@dataclass
class _Load:
    group: int
    prompt: int  # prompt tokens still to prefill (all of them until the first token arrives)
    decode: int  # tokens the request may still generate


class Router:
    """Routes by `cfg.load_balance_method` and its cache_aware thresholds (EngineConfig fields)."""

    def __init__(self, cfg: EngineConfig):
        self.cfg, self.method, self.num_groups = cfg, cfg.load_balance_method, cfg.dp_size
        self.trees = [RadixTree() for _ in range(self.num_groups)] if self.method == "cache_aware" else []
        self._turn = itertools.count()
        self._inflight: dict[str, _Load] = {}
        self.outstanding_tokens = [0] * self.num_groups
        self.requests = [0] * self.num_groups
        self.running_per_group = cfg.running_per_group

    def route(self, rid: str, input_ids: list[int], max_new_tokens: int, pinned: int | None = None) -> int:
        """Picks the group of a new request (or takes the pinned one) and counts its load there."""
        if pinned is not None:
            self.check_pin(pinned)
            group = pinned
        else:
            groups = self._open()
            if self.method == "cache_aware":
                group = self._cache_aware(input_ids, groups)
            elif self.method == "round_robin":
                group = next(g for g in (t % self.num_groups for t in self._turn) if g in groups)
            elif self.method == "shortest_queue":
                group = min(groups, key=lambda g: (self.requests[g], self.outstanding_tokens[g]))
            else:
                group = self._least_loaded(groups)
        if self.trees:
            tree = self.trees[group]
            tree.insert(input_ids)
            if tree.size > self.cfg.max_tree_size:
                tree.evict(tree.size - self.cfg.max_tree_size)
        self._inflight[rid] = _Load(group, len(input_ids), max_new_tokens)
        self.outstanding_tokens[group] += len(input_ids) + max_new_tokens
        self.requests[group] += 1
        return group

    def _open(self) -> list[int]:
        """The groups with a free running slot; all of them when none has (the request queues)."""
        free = [g for g in range(self.num_groups) if self.requests[g] < self.running_per_group]
        return free or list(range(self.num_groups))

    def _least_loaded(self, groups: list[int]) -> int:
        return min(groups, key=lambda g: (self.outstanding_tokens[g], self.requests[g]))

    def _cache_aware(self, input_ids: list[int], groups: list[int]) -> int:
        p, loads = self.cfg, self.outstanding_tokens
        low, high = min(loads), max(loads)
        if high - low > p.balance_abs_threshold and high > p.balance_rel_threshold * low:
            return self._least_loaded(groups)
        matched = {g: self.trees[g].match_prefix(input_ids)[2] for g in groups}
        best = max(groups, key=lambda g: (matched[g], -loads[g], -self.requests[g]))
        if matched[best] > 0 and matched[best] >= p.cache_threshold * len(input_ids):
            return best
        return self._least_loaded(groups)

    def flush(self) -> None:
        """Forgets what was sent where (the groups' prefix caches were flushed)."""
        self.trees = [RadixTree() for _ in self.trees]

    def check_pin(self, pinned: int) -> None:
        if not 0 <= pinned < self.num_groups:
            raise ValueError(f"data_parallel_rank={pinned} is outside [0, {self.num_groups})")

    def on_token(self, rid: str) -> None:
        """A request produced a token: its prompt is prefilled and its decode budget shrinks."""
        load = self._inflight.get(rid)
        if load is None:
            return
        spent = load.prompt + min(load.decode, 1)
        self.outstanding_tokens[load.group] -= spent
        load.prompt, load.decode = 0, load.decode - min(load.decode, 1)

    def on_finish(self, rid: str) -> None:
        load = self._inflight.pop(rid, None)
        if load is None:
            return
        self.outstanding_tokens[load.group] -= load.prompt + load.decode
        self.requests[load.group] -= 1
