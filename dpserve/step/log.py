"""The step log: one record per forward step a group leader ran, the accounting behind the
benchmarks (`Engine.get_step_logs`), kept until the front end asks for it."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, replace

import torch

from dpserve.messages import Rebalance
from dpserve.step.records import BatchKind, PaddingMode

STEP_LOG_LEN = 100_000


@dataclass(frozen=True)
class StepRecord:
    """One forward step as a group leader saw it."""

    kind: BatchKind  # the largest over the groups
    local_mode: BatchKind  # this group's kind (the step log's field name since its first release)
    padding_mode: PaddingMode
    tokens: tuple[int, ...]  # real tokens of every DP group
    mlp_rows: int  # rows the MoE/MLP processed (real + padding)
    seconds: float  # the whole step: scheduling, inputs, forward, sampling
    real_rows: int  # real tokens of all groups (the MoE rows without padding)
    padded: bool  # padded to a decode bucket (a CUDA graph replay on GPU); False: unpadded, eager
    retractions: int = 0  # requests this group retracted to make room for the step
    slots_written: int = 0  # request-to-slot table entries this group wrote (host work of the step)
    forward_seconds: float = 0.0  # the model's share of `seconds` (without drafting); the rest is host work
    draft_seconds: float = 0.0  # NEXTN: the MTP forwards after the step (part of `seconds`)
    draft_padded: int = 0  # NEXTN: how many of those ran padded (a CUDA graph replay on GPU)
    expert_imbalance: float = 1.0  # MoE rows of the busiest rank over the mean rank's (1: balanced)
    comm_bytes: int = 0  # bytes the leader sent in the step's forward (collectives; NEXTN's drafts not)
    logit_rows: tuple[int, ...] = ()  # rows sampled by every DP group (what the LM head moves)
    rebalance: Rebalance | None = None  # --enable-eplb: the rebalance that ended after this step
    # Host time taking its samples into the requests (process_samples, the report's tokens): under
    # overlap scheduling beside the next step's forward, otherwise part of `seconds`.
    process_seconds: float = 0.0
    # Overlap scheduling: decode tokens it took from the step before's samples on the device.
    pending_tokens: int = 0


class StepLog:
    """The records since the front end last asked. A MoE step's record waits for its expert
    imbalance, whose copy to the host is queued with it and read at the next record (after the
    next step's sampling sync: reading it at once would be a second sync per step)."""

    def __init__(self) -> None:
        self.records: deque[StepRecord] = deque(maxlen=STEP_LOG_LEN)
        self._pending: tuple[StepRecord, torch.Tensor, torch.cuda.Event | None] | None = None

    def append(
        self, record: StepRecord, imbalance: tuple[torch.Tensor, torch.cuda.Event | None] | None = None
    ) -> float | None:
        """Logs `record` (with its imbalance's host copy and the event that says it is there, for a
        MoE step); returns the imbalance of the MoE step it completes, if any."""
        done = self.complete()
        if imbalance is None:
            self.records.append(record)
        else:
            self._pending = (record, *imbalance)
        return done

    def complete(self) -> float | None:
        """Logs the pending MoE step with its imbalance; returns that imbalance (None: none pending)."""
        if self._pending is None:
            return None
        record, imbalance, done = self._pending
        if done is not None:
            done.synchronize()  # done long ago, unless the log is asked for right after its step
        record = replace(record, expert_imbalance=float(imbalance))
        self.records.append(record)
        self._pending = None
        return record.expert_imbalance

    def take(self) -> list[StepRecord]:
        """Every logged record (`complete` the pending one first), then forgotten."""
        out = list(self.records)
        self.records.clear()
        return out
