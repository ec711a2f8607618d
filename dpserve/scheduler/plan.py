"""The step plan: what a group leader's scheduler decides and broadcasts to its group."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class StepPlan:
    mode: str = "idle"  # "extend", "decode" or "idle"
    rids: list[str] = field(default_factory=list)
    new_tokens: list[list[int]] = field(default_factory=list)  # per request
    new_slots: list[list[int]] = field(default_factory=list)  # KV slots for those tokens
    sample: list[bool] = field(default_factory=list)  # whether a token is sampled for the request
    freed: list[str] = field(default_factory=list)  # requests whose slots are released
    shutdown: bool = False

    @property
    def num_tokens(self) -> int:
        return sum(len(t) for t in self.new_tokens)

    @property
    def num_samples(self) -> int:
        return sum(self.sample)


class RequestSlots:
    """rid -> KV slots of its tokens, kept identically on every rank of a group."""

    def __init__(self) -> None:
        self.slots: dict[str, list[int]] = {}

    def apply(self, plan: StepPlan) -> None:
        for rid in plan.freed:
            self.slots.pop(rid, None)
        for rid, new in zip(plan.rids, plan.new_slots, strict=True):
            self.slots.setdefault(rid, []).extend(new)
