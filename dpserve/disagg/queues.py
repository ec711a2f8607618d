"""Prefill-decode disaggregation's bookkeeping in a group's scheduler: on the prefill side the
requests done here whose KV waits to be written to the decode side, on the decode side the slots
of ended requests the prefill side may still be writing into."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Generic, TypeVar

from dpserve.messages import Destination, FinishReason

R = TypeVar("R")  # the scheduler's request


class SendQueue(Generic[R]):
    """Prefill side: each held request with the finish reason it reports once its KV is written,
    and where that KV goes, once the decode side said (a destination may come first)."""

    def __init__(self) -> None:
        self._held: dict[str, tuple[R, FinishReason]] = {}
        self._destinations: dict[str, Destination] = {}

    def hold(self, rid: str, req: R, reason: FinishReason) -> None:
        self._held[rid] = (req, reason)

    def set_destination(self, rid: str, dest: Destination) -> None:
        self._destinations[rid] = dest

    def ready(self) -> list[tuple[str, R, Destination]]:
        """The held requests whose destination is known: (rid, request, destination), in order."""
        return [
            (rid, req, self._destinations[rid])
            for rid, (req, _) in self._held.items()
            if rid in self._destinations
        ]

    def pop(self, rid: str) -> tuple[R, FinishReason] | None:
        """Forgets `rid` (held or not) and its destination; returns what was held."""
        self._destinations.pop(rid, None)
        return self._held.pop(rid, None)

    def __len__(self) -> int:
        return len(self._held)


class Limbo:
    """Decode side: the full slots and window slots of ended requests, by id, until the prefill
    side can no longer write into them."""

    def __init__(self) -> None:
        self._slots: dict[str, tuple[list[int], list[int]]] = {}

    def park(self, rid: str, slots: list[int], window_slots: list[int]) -> None:
        self._slots[rid] = (slots, window_slots)

    def take(self, rid: str) -> tuple[list[int], list[int]]:
        return self._slots.pop(rid)

    def __iter__(self) -> Iterator[str]:
        return iter(list(self._slots))
