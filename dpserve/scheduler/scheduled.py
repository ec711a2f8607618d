"""What one `Scheduler.schedule()` call decided, and where that step's results go back in.

The step object, not positions in the scheduler's own lists, ties a forward's samples to the
requests that asked for them: `Scheduler.process_samples(step, ...)` and `Scheduler.sent(step, ...)`
take it, so the scheduler may schedule the next step before this one's results are in."""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property

from dpserve.messages import RequestOutput
from dpserve.scheduler.request import Req
from dpserve.step.records import GroupBatch


@dataclass
class ScheduledStep:
    batch: GroupBatch = field(default_factory=GroupBatch)  # what every rank of the group runs
    reqs: list[Req] = field(default_factory=list)  # the batch's requests, in its order
    prefilled: list[Req] = field(default_factory=list)  # those that prefill (into the prefix cache after)
    sends: list[str] = field(default_factory=list)  # prefill side: requests whose KV the step writes out
    reserved: list[Req] = field(default_factory=list)  # decode side: admitted awaiting the prefill's KV
    admitted: list[tuple[str, int]] = field(default_factory=list)  # (rid, cached prompt tokens), new ones
    failed: list[RequestOutput] = field(
        default_factory=list
    )  # outputs of requests it ended (grammar did not compile)
    retractions: int = 0  # requests retracted to make room for it

    @cached_property
    def sampled(self) -> list[Req]:
        """Its requests that sample, in the order of its logits rows (read once its batch is
        formed: by the sampler's inputs, the penalty counts and `process_samples`)."""
        return [r for r, part in zip(self.reqs, self.batch.reqs, strict=True) if part.sample]
