"""Per-step choice of the DP padding mode and graph bucket (design section 4).

Every rank calls `PaddingPlanner.step` with the same gathered per-group sizes and the same
cost model (rank 0's calibration, broadcast at start-up), so every rank derives the same
mode and bucket without exchanging anything else.

`auto` compares, per step, a cost model of each mode's collectives and MoE/MLP rows:

    sum_len(R rows):  layers * 2 * all_reduce(R) + mlp(R)
    max_len(M rows):  layers * (attn_reduce_scatter(M) + all_gather(D*M) + reduce_scatter(D*M)
                                + attn_all_gather(M)) + mlp(D*M)

Each term is a curve of seconds against rows, measured on the real process groups and model.
"""

from __future__ import annotations

import bisect
import logging
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from dpserve.distributed import Groups, all_gather, all_reduce, broadcast_object, reduce_scatter
from dpserve.layers.dp_attention import DPStep

logger = logging.getLogger(__name__)

CALIBRATION_ROWS = (1, 2, 4, 8, 16, 32, 64, 128, 256)  # per curve, in rows of the hidden size
CALIBRATION_REPS = 5  # timed runs per size (median), after one warm-up run


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
        return " ".join(f"{r:g}:{s * 1e3:.3f}ms" for r, s in zip(self.rows, self.seconds, strict=True))


ZERO = Curve((1.0,), (0.0,))


@dataclass(frozen=True)
class CostModel:
    """Predicted seconds of one step's DP communication and MoE/MLP work in each mode."""

    num_layers: int
    dp_size: int
    all_reduce: Curve  # WORLD, by rows
    all_gather: Curve  # WORLD, by output rows
    reduce_scatter: Curve  # WORLD, by input rows
    attn_all_gather: Curve  # ATTN_TP, by output rows (ZERO when the attention TP size is 1)
    attn_reduce_scatter: Curve  # ATTN_TP, by input rows
    mlp: Curve  # every layer's MLP/MoE together, by rows

    def sum_len(self, rows: int) -> float:
        return self.num_layers * 2 * self.all_reduce(rows) + self.mlp(rows)

    def max_len(self, m: int) -> float:
        d = self.dp_size
        comm = (
            self.attn_reduce_scatter(m)
            + self.all_gather(d * m)
            + self.reduce_scatter(d * m)
            + self.attn_all_gather(m)
        )
        return self.num_layers * comm + self.mlp(d * m)

    def __str__(self) -> str:
        names = (
            "all_reduce",
            "all_gather",
            "reduce_scatter",
            "attn_all_gather",
            "attn_reduce_scatter",
            "mlp",
        )
        return "; ".join(f"{n} [{getattr(self, n)}]" for n in names)


def _time(fn: Callable[[], object], device: torch.device) -> float:
    fn()  # warm-up (also lines the ranks up before the timed runs)
    times = []
    for _ in range(CALIBRATION_REPS):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def calibrate(
    model: torch.nn.Module, groups: Groups, hidden: int, dtype: torch.dtype, device: torch.device
) -> CostModel:
    """Times the collectives and the MLP stack on this rank; every rank must call it together.

    Returns rank 0's cost model on every rank, so that all ranks choose alike.
    """
    t, a = groups.topo.tp_size, groups.topo.attn_tp_size

    def x(rows: int) -> torch.Tensor:
        return torch.randn(rows, hidden, dtype=dtype, device=device) * 0.1

    def curve(in_rows: int, units: int, op: Callable[[torch.Tensor], object]) -> Curve:
        """Times `op` on in_rows * r rows for each calibration r, as a curve over units * r."""
        seconds = [_time(lambda r=r: op(x(in_rows * r)), device) for r in CALIBRATION_ROWS]
        # More rows never cost less: a spike from a descheduled peer must not outweigh larger sizes.
        monotone = [min(seconds[i:]) for i in range(len(seconds))]
        return Curve(tuple(float(units * r) for r in CALIBRATION_ROWS), tuple(monotone))

    def mlp_stack(h: torch.Tensor) -> None:
        for layer in model.layers:
            layer.mlp(h)

    with torch.no_grad():
        attn = a > 1
        cost = CostModel(
            num_layers=len(model.layers),
            dp_size=groups.topo.dp_size,
            all_reduce=curve(1, 1, lambda h: all_reduce(h, groups.world)),
            all_gather=curve(1, t, lambda h: all_gather(h, groups.world)),
            reduce_scatter=curve(t, t, lambda h: reduce_scatter(h, groups.world)),
            attn_all_gather=curve(1, a, lambda h: all_gather(h, groups.attn_tp)) if attn else ZERO,
            attn_reduce_scatter=curve(a, a, lambda h: reduce_scatter(h, groups.attn_tp)) if attn else ZERO,
            mlp=curve(1, 1, mlp_stack),
        )
    cost = broadcast_object(cost, 0, groups.world_cpu)
    logger.info("dp padding cost model (rank 0's timings, seconds per step): %s", cost)
    return cost


def _bucket(buckets: list[int], n: int) -> int | None:
    i = bisect.bisect_left(buckets, n)
    return buckets[i] if i < len(buckets) else None


class PaddingPlanner:
    """Turns the gathered per-group sizes into a DPStep: mode, and graph bucket or eager."""

    def __init__(
        self, mode: str, buckets: list[int], dp_rank: int, attn_tp_size: int, cost: CostModel | None
    ):
        self.mode, self.dp_rank, self.attn_tp_size, self.cost = mode, dp_rank, attn_tp_size, cost
        a = attn_tp_size
        # sum_len's buckets count global rows; max_len's count rows per group, a multiple of A.
        self.buckets = {
            "sum_len": sorted(buckets),
            "max_len": sorted({-(-b // a) * a for b in buckets}),
        }

    @property
    def graph_modes(self) -> tuple[str, ...]:
        """The modes a padded step can take, each needing its own graphs."""
        if self.mode != "auto":
            return (self.mode,)
        return ("sum_len", "max_len") if self.cost is not None else ("sum_len",)

    def step(self, tokens: list[int], logit_rows: list[int], can_pad: bool) -> DPStep:
        """`can_pad`: every group's batch fits a graph (decode or idle, short enough)."""
        a = self.attn_tp_size
        sizes = {"sum_len": sum(tokens), "max_len": max(tokens)}
        buckets = {m: _bucket(self.buckets[m], n) if can_pad else None for m, n in sizes.items()}
        mode = self.mode
        if mode == "auto":
            if self.cost is None:  # one DP group: both modes are the same but for rounding
                mode = "sum_len"
            elif buckets["sum_len"] is None and buckets["max_len"] is not None:
                mode = "max_len"  # the sum outgrew the largest graph; the largest group did not
            else:
                rows = buckets["sum_len"] or sizes["sum_len"]
                m = buckets["max_len"] or -(-sizes["max_len"] // a) * a
                mode = "sum_len" if self.cost.sum_len(rows) <= self.cost.max_len(m) else "max_len"
        return DPStep(mode, tuple(tokens), tuple(logit_rows), self.dp_rank, a, buckets[mode])
