"""Routing requests across DP groups (or replicas), with load counted by the front end itself.

The load of a group is updated the moment a request is routed to it, not when a worker reports
back, so a burst of requests spreads at once.

    round_robin      groups in turn
    shortest_queue   fewest requests in flight
    minimum_tokens   fewest outstanding tokens: prompt tokens not yet prefilled + the remaining
                     decode budgets (max_new_tokens - generated) of every request in flight
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

LOAD_BALANCE_METHODS = ("minimum_tokens", "shortest_queue", "round_robin")


@dataclass
class _Load:
    group: int
    prompt: int  # prompt tokens still to prefill (all of them until the first token arrives)
    decode: int  # tokens the request may still generate


class Router:
    def __init__(self, num_groups: int, method: str = "minimum_tokens"):
        if method not in LOAD_BALANCE_METHODS:
            raise ValueError(f"load balance method must be one of {LOAD_BALANCE_METHODS}, got {method!r}")
        self.method = method
        self.num_groups = num_groups
        self._turn = itertools.count()
        self._inflight: dict[str, _Load] = {}
        self.outstanding_tokens = [0] * num_groups
        self.requests = [0] * num_groups

    def route(self, rid: str, prompt_tokens: int, max_new_tokens: int, pinned: int | None = None) -> int:
        """Picks the group of a new request (or takes the pinned one) and counts its load there."""
        if pinned is not None:
            self.check_pin(pinned)
            group = pinned
        elif self.method == "round_robin":
            group = next(self._turn) % self.num_groups
        elif self.method == "shortest_queue":
            group = min(range(self.num_groups), key=lambda g: (self.requests[g], self.outstanding_tokens[g]))
        else:
            group = min(range(self.num_groups), key=lambda g: (self.outstanding_tokens[g], self.requests[g]))
        self._inflight[rid] = _Load(group, prompt_tokens, max_new_tokens)
        self.outstanding_tokens[group] += prompt_tokens + max_new_tokens
        self.requests[group] += 1
        return group

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
