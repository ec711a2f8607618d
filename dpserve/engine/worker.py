"""The loop every rank runs. All ranks step in lockstep:

1. the group leader drains its request socket and schedules a StepPlan;
2. the plan is broadcast inside the group (ATTN_TP, CPU);
3. every rank all-gathers its group's `GroupStep` (tokens, rows to sample, mode, shutdown, can
   use a graph) over the CPU group, so all agree on the step's layout (padding mode, graph
   bucket); when every group is idle no forward runs;
4. the forward joins every WORLD collective, idle groups with zero rows;
5. the leader samples, updates its requests and sends finished outputs to the front end.
"""

from __future__ import annotations

import ctypes
import logging
import os
import signal
import sys
import time
import traceback
from collections import deque
from dataclasses import dataclass

import torch
import zmq

from dpserve.config import EngineConfig
from dpserve.distributed import all_gather_ints, broadcast_object, init_groups
from dpserve.engine.model_runner import ModelRunner
from dpserve.engine.sampler import sample
from dpserve.models.config import ModelConfig
from dpserve.scheduler.plan import MODES, DraftCounts, GroupStep, StepPlan
from dpserve.scheduler.request import GenerateRequest
from dpserve.scheduler.scheduler import Scheduler

IDLE_POLL_MS = 5
STEP_LOG_LEN = 100_000

logger = logging.getLogger("dpserve.worker")


@dataclass(frozen=True)
class StepRecord:
    """One forward step as a group leader saw it (the accounting behind benchmarks)."""

    kind: str  # the largest mode over the groups: extend, verify (speculative drafts), decode
    local_mode: str  # this group's mode: extend, decode or idle
    padding_mode: str  # sum_len or max_len
    tokens: tuple[int, ...]  # real tokens of every DP group
    mlp_rows: int  # rows the MoE/MLP processed (real + padding)
    seconds: float  # the whole step: scheduling, inputs, forward, sampling
    real_rows: int  # real tokens of all groups (the MoE rows without padding)
    graph: bool  # padded to a graph bucket (a CUDA graph replay on GPU); False: eager
    retractions: int = 0  # requests this group retracted to make room for the step
    slots_written: int = 0  # request-to-slot table entries this group wrote (host work of the step)
    forward_seconds: float = 0.0  # the model's share of `seconds` (without drafting); the rest is host work
    draft_seconds: float = 0.0  # NEXTN: the MTP forwards after the step (part of `seconds`)


@dataclass(frozen=True)
class WorkerAddresses:
    dist_init: list[str]  # host:port for torch.distributed, per instance
    requests: list[str]  # ZMQ address per DP group (front end -> group leader)
    outputs: str  # ZMQ address of the front end's collector (every rank -> front end)


def run_worker(rank: int, cfg: EngineConfig, addrs: WorkerAddresses) -> None:
    """Process entry point for global rank `rank`; reports failures to the front end before exiting."""
    logging.basicConfig(level=cfg.log_level.upper(), format=f"[rank {rank}] %(levelname)s %(message)s")
    _leave_signals_to_front_end()
    if cfg.device == "cpu":
        # The node's cores shared out between its ranks: more threads than cores only thrash.
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // cfg.ranks_per_node))
    ctx = zmq.Context()
    out = ctx.socket(zmq.PUSH)
    out.connect(addrs.outputs)
    try:
        _serve(rank, cfg, addrs, ctx, out)
    except BaseException as e:  # the front end must learn of every failure, never hang
        out.send_pyobj(
            {"type": "error", "rank": rank, "error": f"{e!r}", "traceback": traceback.format_exc()}
        )
        out.close(linger=2000)
        os._exit(1)
    out.close(linger=2000)


def _leave_signals_to_front_end() -> None:
    """Ctrl-C or a SIGTERM sent to the whole process group must reach the front end only, which
    then stops every rank in order; a rank dies with its parent so it is never left orphaned."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    if sys.platform == "linux":
        PR_SET_PDEATHSIG = 1
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)


def _serve(rank: int, cfg: EngineConfig, addrs: WorkerAddresses, ctx: zmq.Context, out: zmq.Socket) -> None:
    instance, topo = cfg.rank_topology(rank)
    dp_rank = rank // cfg.attn_tp_size  # global DP rank: a group of DP attention or a replica
    model_cfg = ModelConfig.load(cfg.model_path)
    model_cfg.validate(topo)
    groups = init_groups(topo, cfg.device, addrs.dist_init[instance])
    device_count = torch.cuda.device_count() if cfg.device == "cuda" else 1
    runner = ModelRunner(cfg, model_cfg, groups, local_rank=rank % cfg.ranks_per_node % device_count)
    leader_rank = topo.dp_rank * topo.attn_tp_size
    scheduler = requests = None
    if topo.is_group_leader:
        scheduler = Scheduler(
            dp_rank,
            runner.max_total_num_tokens,
            cfg.max_running_requests,
            cfg.chunked_prefill_size,
            model_cfg.context_len,
            model_cfg.vocab_size,
            model_cfg.eos_token_ids,
            cfg.random_seed,
            radix_cache=not cfg.disable_radix_cache,
            device=runner.device,
            num_drafts=cfg.num_drafts,
            speculative_algorithm=cfg.speculative_algorithm or "NGRAM",
        )
        requests = ctx.socket(zmq.PULL)
        requests.connect(addrs.requests[dp_rank])
    steps = {"steps_eager": 0, "steps_graph": 0}
    out.send_pyobj(
        {
            "type": "ready",
            "rank": rank,
            "dp_rank": dp_rank,
            "max_total_num_tokens": runner.max_total_num_tokens,
            "kv_bytes_per_token": runner.kv_bytes_per_token,
            "weight_bytes": runner.weight_bytes,
            "activation_bytes": runner.activation_bytes,
            "stats": {**scheduler.stats(), **steps} if scheduler else {},
        }
    )
    idle = True
    shutdown = False
    step_log: deque[StepRecord] = deque(maxlen=STEP_LOG_LEN)
    while True:
        loop_start = time.perf_counter()
        plan = None
        if scheduler is not None:
            report = StepReport(dp_rank)
            shutdown |= _drain(
                requests, scheduler, out, report, step_log, wait_ms=IDLE_POLL_MS if idle else 0
            )
            plan = scheduler.schedule()
            plan.shutdown = shutdown
        plan: StepPlan = broadcast_object(plan, leader_rank, groups.attn_tp_cpu)
        local = GroupStep(
            tokens=plan.num_tokens,
            samples=plan.num_logit_rows,
            mode=MODES.index(plan.mode),
            shutdown=plan.shutdown,
            can_pad=runner.can_use_graph(plan),
        )
        rows = all_gather_ints(local.to_ints(), groups.world_cpu)[:: topo.attn_tp_size].tolist()
        group_steps = [GroupStep.from_ints(r) for r in rows]  # one per DP group
        if any(g.shutdown for g in group_steps):
            break
        idle = not any(g.tokens for g in group_steps)
        if not idle:
            step = runner.make_step(
                [g.tokens for g in group_steps],
                [g.samples for g in group_steps],
                can_pad=all(g.can_pad for g in group_steps),
            )
            logits = runner.forward(plan, step)
        if not idle and scheduler is not None and plan.reqs:
            tokens, logprobs = (
                sample(logits, *scheduler.sampling_inputs()) if plan.num_logit_rows else ([], [])
            )
            report.add(*scheduler.process_samples(tokens, logprobs))
        if not idle and runner.drafter is not None:
            _draft(runner, scheduler, leader_rank)
        if scheduler is None:
            continue
        if not idle:
            steps["steps_graph" if step.graph else "steps_eager"] += 1
            step_log.append(
                StepRecord(
                    kind=MODES[max(g.mode for g in group_steps)],
                    local_mode=plan.mode,
                    padding_mode=step.mode,
                    tokens=step.tokens,
                    mlp_rows=step.mlp_rows,
                    seconds=time.perf_counter() - loop_start,
                    forward_seconds=runner.forward_seconds,
                    real_rows=step.total_tokens,
                    graph=step.graph,
                    retractions=scheduler.step_retractions,
                    slots_written=runner.slots_written,
                    draft_seconds=runner.drafter.seconds if runner.drafter else 0.0,
                )
            )
        if report.changed or plan.reqs:
            out.send_pyobj(report.message({**scheduler.stats(), **steps}))
    logger.info("shutting down")
    if groups.world is not None:
        torch.distributed.destroy_process_group()


def _draft(runner: ModelRunner, scheduler: Scheduler | None, leader_rank: int) -> None:
    """NEXTN: every rank runs the MTP forwards after a step (its group's rows from the leader's
    draft plan, every group's sizes all-gathered); the leader keeps the drafts for the next step."""
    groups, topo = runner.groups, runner.topo
    plan = broadcast_object(scheduler.draft_plan if scheduler else None, leader_rank, groups.attn_tp_cpu)
    local = plan.counts(runner.drafter.num_steps, runner.model_cfg.context_len)
    rows = all_gather_ints(local.to_ints(), groups.world_cpu)[:: topo.attn_tp_size].tolist()
    drafts = runner.drafter.run(plan, [DraftCounts.from_ints(r) for r in rows])
    if scheduler is not None:
        scheduler.set_drafts(drafts)


class StepReport:
    """What a group leader tells the front end after a step: new tokens (for streaming), finished
    requests, and its load (for routing and /metrics). One message per step that changed anything."""

    def __init__(self, dp_rank: int):
        self.dp_rank = dp_rank
        self.tokens: list[tuple[str, int, float]] = []  # (rid, token, logprob)
        self.finished: list[dict] = []
        self.changed = False

    def add(self, tokens: list[tuple[str, int, float]], finished: list[dict]) -> None:
        self.tokens += tokens
        self.finished += finished
        self.changed = True

    def message(self, stats: dict) -> dict:
        return {
            "type": "step",
            "dp_rank": self.dp_rank,
            "tokens": self.tokens,
            "finished": self.finished,
            "stats": stats,
        }


def _drain(
    sock: zmq.Socket,
    scheduler: Scheduler,
    out: zmq.Socket,
    report: StepReport,
    step_log: deque[StepRecord],
    wait_ms: int,
) -> bool:
    """Takes every pending message; returns True when asked to shut down."""
    shutdown = False
    while sock.poll(wait_ms):
        wait_ms = 0
        msg = sock.recv_pyobj()
        report.changed = True
        output = None
        if isinstance(msg, GenerateRequest):
            output = scheduler.add(msg)  # an error output if it can never run
        elif msg["type"] == "abort":
            output = scheduler.abort(msg["rid"])
        elif msg["type"] == "get_step_log":
            out.send_pyobj({"type": "step_log", "dp_rank": scheduler.dp_rank, "steps": list(step_log)})
            step_log.clear()
        elif msg["type"] == "shutdown":
            shutdown = True
        if output is not None:
            report.finished.append(output)
    return shutdown
