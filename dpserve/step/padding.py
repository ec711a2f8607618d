"""The policy every rank derives a step's layout by (docs/design.md, section 4): padding mode, bucket,
whether a group's batch can be padded at all.

Every rank calls `PaddingPolicy.layout` with the same exchanged per-group sizes and the same
cost model (rank 0's calibration, broadcast at start-up), so every rank derives the same
mode and bucket without exchanging anything else.

`auto` compares, per step, what each mode's collectives and MoE/MLP work cost at the step's
size. Both are measured together at start-up, on the real process groups: a few padded
steps with every row padding, per mode and size (the DP gathers and scatters over WORLD
and ATTN_TP, the MoE on the gathered rows, and attention on the padded local rows), run
exactly as decode steps run (CUDA graph replays where captured). Timing the collectives in
place rather than alone matters: on a shared CPU a collective costs mostly the wait for
the slowest peer, which an isolated loop of all-reduces hides.
"""

from __future__ import annotations

import bisect
import logging
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
from tqdm import tqdm

from dpserve.distributed import Topology, broadcast_object
from dpserve.step.records import BatchKind, GroupBatch, GroupSizes, PaddingMode, StepLayout, round_up

logger = logging.getLogger(__name__)

CALIBRATION_SIZES = (1, 2, 4, 8, 16, 32, 64, 128)  # sum_len global rows; max_len rows per group
CALIBRATION_REPS = 5  # timed runs per mode and size (median)


@dataclass(frozen=True)
class Curve:
    """Seconds against rows: linear between measured points, extended along the end segments."""

    rows: tuple[float, ...]
    seconds: tuple[float, ...]

    def __call__(self, rows: float) -> float:
        x, y = self.rows, self.seconds
        if len(x) == 1:
            return y[0]
        i = min(max(bisect.bisect_left(x, rows), 1), len(x) - 1)
        slope = (y[i] - y[i - 1]) / (x[i] - x[i - 1])
        return max(y[i - 1] + slope * (rows - x[i - 1]), 0.0)

    def __str__(self) -> str:
        return " ".join(f"{r:g}:{s * 1e3:.2f}ms" for r, s in zip(self.rows, self.seconds, strict=True))


@dataclass(frozen=True)
class CostModel:
    """Seconds of one step's DP collectives and MoE/MLP work (all layers) in each mode."""

    sum_len: Curve  # by rows of the sum_len buffer
    max_len: Curve  # by M, the rows of each group

    def __str__(self) -> str:
        return f"sum_len by rows [{self.sum_len}]; max_len by rows per group [{self.max_len}]"


def calibrate(
    run_step: Callable[[StepLayout], Callable[[], object]],
    topo: Topology,
    device: torch.device,
    group: torch.distributed.ProcessGroup | None,
) -> CostModel:
    """Times padded all-padding steps of each mode at several sizes; every rank must call it
    together. `run_step(step)` prepares a step and returns the call that runs it.

    Returns rank 0's cost model on every rank, so that all ranks choose alike.
    """
    a, dp = topo.attn_tp_size, topo.dp_size
    sizes = {
        PaddingMode.SUM_LEN: sorted(set(CALIBRATION_SIZES)),
        PaddingMode.MAX_LEN: sorted({round_up(r, a) for r in CALIBRATION_SIZES}),
    }
    seconds: dict[PaddingMode, list[float]] = {m: [] for m in sizes}

    def timed(run: Callable[[], object]) -> float:
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        run()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        return time.perf_counter() - start

    runs = {
        m: [run_step(StepLayout(m, (0,) * dp, (0,) * dp, topo.dp_rank, a, size)) for size in sizes[m]]
        for m in sizes
    }
    for m in sizes:
        runs[m][0]()  # warm-up
    # Modes interleaved run by run, so that a slow spell of the machine hits both alike.
    bar = tqdm(
        range(len(CALIBRATION_SIZES)), desc="Calibrating padding modes", unit="size", disable=topo.rank != 0
    )
    for i in bar:
        samples: dict[str, list[float]] = {m: [] for m in sizes if i < len(runs[m])}
        for _ in range(CALIBRATION_REPS):
            for m, times in samples.items():
                times.append(timed(runs[m][i]))
        for m, times in samples.items():
            seconds[m].append(statistics.median(times))
    curves = {}
    for m, secs in seconds.items():
        # More rows never cost less: a spike from a descheduled peer must not outweigh larger sizes.
        monotone = tuple(min(secs[i:]) for i in range(len(secs)))
        curves[m] = Curve(tuple(float(r) for r in sizes[m]), monotone)
    cost = broadcast_object(CostModel(**curves), 0, group)
    if topo.rank == 0:
        logger.info("dp padding cost model (a padded step's time on rank 0, used by every rank): %s", cost)
    return cost


def _bucket(buckets: list[int], n: int) -> int | None:
    i = bisect.bisect_left(buckets, n)
    return buckets[i] if i < len(buckets) else None


class PaddingPolicy:
    """Turns every group's sizes into the step's StepLayout: padding mode, and bucket or unpadded."""

    def __init__(self, dp_padding_mode: str, buckets: list[int], topo: Topology, max_kv_len: int):
        self.dp_padding_mode = dp_padding_mode  # --dp-padding-mode: a PaddingMode, or auto (per step)
        self.dp_rank, self.attn_tp_size = topo.dp_rank, topo.attn_tp_size
        self.dp_size = topo.dp_size
        self.max_kv_len = max_kv_len  # longest request a padded step (a captured graph) can attend to
        self.cost: CostModel | None = None  # auto with several DP groups: set by calibrate()
        a = topo.attn_tp_size
        # sum_len's buckets count global rows; max_len's count rows per group, a multiple of A.
        self.buckets = {
            PaddingMode.SUM_LEN: sorted(buckets),
            PaddingMode.MAX_LEN: sorted({round_up(b, a) for b in buckets}),
        }

    def can_pad(self, batch: GroupBatch) -> bool:
        """Whether a group's batch can take a decode bucket: decode, verify (one row per token) or
        idle, every request's KV short enough for a padded step."""
        if batch.kind == BatchKind.EXTEND or not self.buckets[PaddingMode.SUM_LEN]:
            return False
        return all(r.seq_len <= self.max_kv_len for r in batch.reqs)

    def padded_layouts(self) -> list[StepLayout]:
        """Every padded layout a step can take (one CUDA graph each), largest first, with no real rows."""
        if self.dp_padding_mode != "auto":
            modes = (PaddingMode(self.dp_padding_mode),)
        else:
            modes = tuple(PaddingMode) if self.dp_size > 1 else (PaddingMode.SUM_LEN,)
        zeros = (0,) * self.dp_size
        layouts = [
            StepLayout(m, zeros, zeros, self.dp_rank, self.attn_tp_size, b)
            for m in modes
            for b in self.buckets[m]
        ]
        return sorted(layouts, key=lambda s: -s.local_rows)

    def step_layout(self, sizes: list[GroupSizes]) -> StepLayout:
        """The main step's layout: padded when every group can pad."""
        return self.layout(
            [s.tokens for s in sizes], [s.logit_rows for s in sizes], all(s.can_pad for s in sizes)
        )

    def layout(self, tokens: list[int], logit_rows: list[int], can_pad: bool) -> StepLayout:
        """`can_pad`: every group's batch fits a bucket (decode or idle, short enough)."""
        a = self.attn_tp_size
        sum_len, max_len = PaddingMode.SUM_LEN, PaddingMode.MAX_LEN
        sizes = {sum_len: sum(tokens), max_len: max(tokens)}
        buckets = {m: _bucket(self.buckets[m], n) if can_pad else None for m, n in sizes.items()}
        if self.dp_padding_mode != "auto":
            mode = PaddingMode(self.dp_padding_mode)
        elif self.cost is None:  # one DP group: both modes are the same but for rounding
            mode = sum_len
        elif buckets[sum_len] is None and buckets[max_len] is not None:
            mode = max_len  # the sum outgrew the largest bucket; the largest group did not
        else:
            rows = buckets[sum_len] or sizes[sum_len]
            m = buckets[max_len] or round_up(sizes[max_len], a)
            mode = sum_len if self.cost.sum_len(rows) <= self.cost.max_len(m) else max_len
        return StepLayout(mode, tuple(tokens), tuple(logit_rows), self.dp_rank, a, buckets[mode])
