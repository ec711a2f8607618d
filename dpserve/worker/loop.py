"""The loop every rank runs, in lockstep with every other rank (docs/design.md, section 3):

1. the group leader drains its request socket and schedules a `GroupBatch`;
2. the batch is shared with every rank of the group;
3. every rank exchanges its group's `GroupSizes` with all groups and derives the same
   `StepLayout` (padding mode, bucket); when every group is idle no forward runs;
4. the forward joins every WORLD collective, idle groups with zero rows;
5. the leader samples, updates its requests and reports to the front end
   (NEXTN then drafts: the same share / exchange / forward for the MTP layer).

Overlap scheduling (the default; docs/design.md, section 11) processes step N's samples after step
N + 1's forward is launched: the leader schedules N + 1 with N's tokens pending on the device.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import TypeVar

import torch
import zmq

from dpserve.config import EngineConfig
from dpserve.disagg.bootstrap import DecodeLink
from dpserve.disagg.kv_sender import KVSender
from dpserve.distributed import Groups, broadcast, init_groups
from dpserve.eplb.load import LoadCounter
from dpserve.eplb.rebalance import Rebalancer
from dpserve.grammar import GrammarCache
from dpserve.memory import RANK_FIGURES
from dpserve.messages import (
    AbortRequest,
    ExpertLoad,
    FirstToken,
    FlushCache,
    GenerateRequest,
    GetExpertLoad,
    GetStepLog,
    KVDestination,
    PrefillFailed,
    Ready,
    Rebalance,
    RequestOutput,
    Shutdown,
    StepRecords,
    StepReport,
    TokenOut,
    Wake,
)
from dpserve.models.config import ModelConfig
from dpserve.scheduler.scheduled import ScheduledStep
from dpserve.scheduler.scheduler import Scheduler
from dpserve.step.exchange import exchange, share
from dpserve.step.log import StepLog, StepRecord
from dpserve.step.padding import calibrate
from dpserve.step.records import PENDING_TOKEN, BatchKind, DraftBatch, GroupBatch, StepLayout
from dpserve.worker.channels import Heartbeat, WorkerAddresses
from dpserve.worker.drafter import NextNDrafter, draft_batch
from dpserve.worker.model_runner import ForwardTime, ModelRunner, elapsed
from dpserve.worker.sampler import SampleLaunch, Samples, launch_sample
from dpserve.worker.sampling_batch import count_tokens, follow_counts, sampling_inputs
from dpserve.worker.token_counts import TokenCounts

# An idle instance blocks in its leaders' sockets instead of stepping: the front end wakes every
# group's leader whenever a request arrives (`WorkerPool.send(..., wake_all=True)`), so the wait
# only bounds how often an idle instance checks in, never a request's latency.
IDLE_WAIT_MS = 500
# The idle wait while a queued request's grammar compiles, or a decode request's KV is awaited.
GRAMMAR_POLL_MS = 2

logger = logging.getLogger("dpserve.worker")
T = TypeVar("T")


class Worker:
    """One rank: its model runner, and on a group leader the group's scheduler and sockets."""

    def __init__(
        self,
        rank: int,
        cfg: EngineConfig,
        addrs: WorkerAddresses,
        ctx: zmq.Context,
        out: zmq.Socket,
        heartbeat: Heartbeat,
    ):
        instance, topo = cfg.rank_topology(rank)
        self.heartbeat = heartbeat
        self.dp_rank = rank // cfg.attn_tp_size  # global DP rank: a group of DP attention or a replica
        model_cfg = ModelConfig.load(cfg.model_path, cfg.quantization)
        model_cfg.validate(cfg)
        self.groups: Groups = init_groups(topo, cfg.device, addrs.dist_init[instance], cfg.dist_timeout)
        device = torch.device("cpu")
        if cfg.device == "cuda":
            device = torch.device("cuda", rank % cfg.ranks_per_node)  # prepared() checked the count
            torch.cuda.set_device(device)
        self.runner = runner = ModelRunner(cfg, model_cfg, self.groups, device)
        if cfg.dp_padding_mode == "auto" and topo.dp_size > 1:
            runner.policy.cost = calibrate(runner.idle_step, topo, device, self.groups.world_cpu)
        self.drafter = self._drafter(cfg, model_cfg)
        self.overlap = cfg.overlap_schedule
        # The CPU runs a forward where it is called: the host work goes beside it on a thread.
        self.host_thread = None
        if self.overlap and device.type == "cpu" and topo.is_group_leader:
            self.host_thread = ThreadPoolExecutor(1, "host")
        self.out, self.scheduler, self.requests = out, None, None
        self.sender, self.link = None, None
        if cfg.disaggregation_mode != "null":
            kv_heads = 1 if model_cfg.is_mla else model_cfg.num_kv_heads  # MLA: one latent, every rank
            self.sender = KVSender(
                runner.pool, self.groups, runner.window_layers, runner.window_size, kv_heads, cfg.nextn
            )
            if topo.is_group_leader and cfg.disaggregation_mode == "decode":
                self.link = DecodeLink(cfg.disaggregation_timeout)
        if topo.is_group_leader:
            self.scheduler = self._scheduler(cfg, model_cfg)
            # The penalties' token counts of the group's requests, on the logits' device.
            self.token_counts = TokenCounts(model_cfg.vocab_size, cfg.running_per_group, device)
            self.requests = ctx.socket(zmq.PULL)
            self.requests.connect(addrs.requests[self.dp_rank])
        self.step_counts = {"steps_eager": 0, "steps_padded": 0}
        self.step_log = StepLog()
        moes = runner.model.moe_layers
        self.expert_load = LoadCounter(moes, device)
        self.eplb = None
        if cfg.enable_eplb and moes:
            self.eplb = Rebalancer(
                moes,
                cfg.eplb_rebalance_num_iterations,
                cfg.eplb_rebalance_layers_per_chunk,
                cfg.nnodes,
                model_cfg.expert_groups,
            )
        self.report = ReportBuilder(self.dp_rank)
        figures = {k: getattr(runner, k) for k in RANK_FIGURES}
        out.send_pyobj(Ready(rank, self.dp_rank, figures, self._stats()))

    def _drafter(self, cfg: EngineConfig, model_cfg: ModelConfig) -> NextNDrafter | None:
        """NEXTN's drafter over the model's MTP layers (None without them)."""
        runner = self.runner
        if runner.model.mtp is None:
            return None
        return NextNDrafter(
            runner.model,
            runner.req_to_token,
            runner.policy,
            runner.max_total_num_tokens,
            cfg.speculative_num_steps,
            model_cfg.context_len,
            cfg.kv_dtype,
            runner.graph_pool,
        )

    def _scheduler(self, cfg: EngineConfig, model_cfg: ModelConfig) -> Scheduler:
        """A group leader's scheduler over the group's pool (and its grammar cache)."""
        grammars = None
        if cfg.grammar_backend == "xgrammar":
            grammars = GrammarCache(
                cfg.model_path,
                model_cfg.vocab_size,
                model_cfg.eos_token_ids,
                cfg.grammar_cache_size,
                cfg.grammar_max_whitespace,
            )
        return Scheduler(
            self.dp_rank,
            self.runner.max_total_num_tokens,
            cfg.running_per_group,
            cfg.chunk_per_group,
            model_cfg.context_len,
            model_cfg.vocab_size,
            model_cfg.eos_token_ids,
            cfg.random_seed,
            radix_cache=not cfg.disable_radix_cache,
            num_drafts=cfg.num_drafts,
            speculative_algorithm=cfg.speculative_algorithm or "NGRAM",
            window_size=self.runner.window_size,
            window_capacity=self.runner.window_tokens,
            disaggregation=cfg.disaggregation_mode,
            grammars=grammars,
        )

    def serve(self) -> None:
        idle, shutdown = True, False
        launched: Launched | None = None  # overlap scheduling: the step whose samples are not processed
        while True:
            start = time.perf_counter()
            self.heartbeat.step_start = time.monotonic()
            step = None
            if self.scheduler is not None:  # 1. the leader schedules
                self.report = ReportBuilder(self.dp_rank)
                shutdown |= self._drain(wait_ms=self._wait_ms(idle))
                step = self._schedule(shutdown)
            batch: GroupBatch = share(step.batch if step else None, self.groups)  # 2. the group shares it
            if batch.sends:  # prefill: finished prompts' KV to their decode groups
                errors = self.sender.write(batch.sends, self.runner.device)
                if self.scheduler is not None:
                    self.report.add([], self.scheduler.sent(step, errors))
            sizes = exchange(batch.sizes(self.runner.policy.can_pad(batch)), self.groups)  # 3. all agree
            if any(s.shutdown for s in sizes):
                break
            idle = not any(s.tokens for s in sizes)
            if not idle:  # 4. the forward
                layout = self.runner.policy.step_layout(sizes)
            processed = None
            if launched is not None:  # overlap: the step before's samples, beside this forward
                processed = self._beside(self._process_and_report, launched)
            if not idle:
                logits = self.runner.forward(batch, layout)  # (on a GPU: queued)
            if launched is not None:
                new = processed.result()
                if new:
                    count_tokens(self.token_counts, new)
                self._record(launched)
            launched = None
            if not idle:
                kind = BatchKind.largest([s.kind for s in sizes])
                current = Launched(batch, step, layout, kind, start, self.runner.forward_time)
                self._finish_step(current, logits)  # 5. sampling, then drafts and the experts' load
                if self.overlap:
                    launched = current
                else:
                    self._record(current)
            if self.scheduler is not None and (self.report.changed or (batch.reqs and not self.overlap)):
                self._send_report()
        self._close()

    def _wait_ms(self, idle: bool) -> int:
        """How long the leader waits for a message: not at all while busy; while idle, briefly when a
        grammar compiles or KV is awaited (either may come any time), else `IDLE_WAIT_MS`."""
        if not idle:
            return 0
        busy = self.scheduler.compiling or (self.link is not None and self.link.busy)
        return GRAMMAR_POLL_MS if busy else IDLE_WAIT_MS

    def _schedule(self, shutdown: bool) -> ScheduledStep:
        """The leader's next step (PD's answers heard first, its KV asked for after); its admissions
        and failures go into the report."""
        if self.link is not None:
            self._hear_prefill()
        step = self.scheduler.schedule()
        if self.link is not None:
            self._ask_prefill(step)
        step.batch.shutdown = shutdown
        self.report.cached = step.admitted
        if step.failed:
            self.report.add([], step.failed)
        return step

    def _close(self) -> None:
        self.heartbeat.step_start = None
        logger.info("shutting down")
        if self.scheduler is not None and self.scheduler.grammars is not None:
            self.scheduler.grammars.close()
        if self.link is not None:
            self.link.close()
        if self.sender is not None:
            self.sender.close()
        if self.host_thread is not None:
            self.host_thread.shutdown()
        if self.groups.world is not None:
            torch.distributed.destroy_process_group()

    def _beside(self, fn: Callable[..., T], *args) -> Future[T]:
        """Host work `fn(*args)` beside the forward that follows: here on a GPU (the forward is
        queued, not run, by the calls after it), on the rank's host thread on the CPU (which runs the
        forward where it is called; the thread does Python work, no large op, so that one thread's
        OpenMP workers alone use the cores)."""
        if self.host_thread is not None:
            return self.host_thread.submit(fn, *args)
        done: Future[T] = Future()
        done.set_result(fn(*args))
        return done

    def _hear_prefill(self) -> None:
        """Decode leader: requests whose KV arrived start decoding; those whose KV will not come fail;
        slots of ended requests go back once the prefill side can no longer write into them."""
        s = self.scheduler
        for rid, answer in self.link.poll():
            match answer:
                case PrefillFailed(error=error, write_failed=write_failed):
                    output = s.kv_failed(rid, f"prefill-decode transfer: {error}", write_failed)
                    self.report.add([], [output] if output else [])
                case FirstToken():
                    self.report.add(*s.kv_arrived(rid, answer))
        for rid in s.limbo:
            if self.link.waiting(rid):
                self.link.cancel(rid)
            else:
                s.free_limbo(rid)
                self.report.changed = True  # the group's KV figures changed

    def _ask_prefill(self, step: ScheduledStep) -> None:
        """Decode leader: where the requests admitted in `step` want their KV."""
        for req in step.reserved:
            dest = self.sender.destination(req.slots, self.scheduler.kv.window_slots(req))
            self.link.request(req.rid, req.bootstrap, dest)

    def _finish_step(self, launched: Launched, logits: torch.Tensor) -> None:
        """5. The leader samples (under overlap scheduling every rank of the group keeps the tokens
        for the next step's inputs, and the samples are processed during the next forward); NEXTN
        drafts on every rank; every rank counts the experts' load."""
        s, batch, step = self.scheduler, launched.batch, launched.step
        if s is not None and batch.reqs:
            launched.samples = self._sample(step, logits)
        if self.overlap and batch.num_logit_rows:
            self._keep_samples(launched)
        if not self.overlap and s is not None:
            count_tokens(self.token_counts, self._process(launched))
        if self.drafter is not None:
            mine, drafting = draft_batch(step) if s is not None and batch.reqs else (DraftBatch(), [])
            drafted = share(mine if s is not None else None, self.groups)
            sizes = exchange(drafted.sizes(self.drafter.num_steps, self.drafter.context_len), self.groups)
            drafts = self.drafter.run(drafted, sizes, self.runner.hidden, launched.layout.padded)
            if s is not None:
                s.set_drafts(drafting, drafts)
        load = self.runner.take_expert_load()  # on the device; every rank: a collective under all_to_all
        # Rows per logical expert, read before a rebalance changes the slots.
        launched.load = load
        launched.rows = None if load is None else self.expert_load.expert_rows(load)
        if self.eplb is not None:  # every rank, at the same step boundary
            launched.rebalance = self.eplb.step(launched.rows)
        if s is not None and launched.rebalance is not None:
            self._report_rebalance(launched.rebalance)
        launched.slots_written, launched.comm_bytes = self.runner.slots_written, self.runner.comm_bytes
        if self.drafter is not None:
            launched.draft_seconds, launched.draft_padded = self.drafter.seconds, self.drafter.padded
        launched.end = time.perf_counter()

    def _keep_samples(self, launched: Launched) -> None:
        """Overlap scheduling: the step's sampled tokens on every rank of the group, by table row."""
        batch = launched.batch
        if launched.samples is not None:
            tokens = launched.samples.row_tokens
        else:
            tokens = torch.empty(batch.num_logit_rows, dtype=torch.long, device=self.runner.device)
        topo = self.groups.topo
        tokens = broadcast(tokens, topo.dp_rank * topo.attn_tp_size, self.groups.attn_tp)
        self.runner.keep_samples(tokens)

    def _process(self, launched: Launched) -> list[TokenOut]:
        """The leader takes a step's samples into its requests and reports them; returns its new
        tokens (for the penalties' counts, kept where the sampling runs)."""
        if self.scheduler is None or not launched.batch.reqs:
            return []
        start = time.perf_counter()
        samples = launched.samples.result() if launched.samples is not None else Samples([], [], [], [])
        new, finished = self.scheduler.process_samples(launched.step, *samples)
        self.report.add(new, finished)
        launched.process_seconds = time.perf_counter() - start
        return new

    def _process_and_report(self, launched: Launched) -> list[TokenOut]:
        """Overlap scheduling: `_process`, then the report goes out at once (while the forward runs)."""
        new = self._process(launched)
        if self.scheduler is not None and (self.report.changed or launched.batch.reqs):
            self._send_report()
        return new

    def _send_report(self) -> None:
        """The leader's `StepReport` to the front end; later news go into a fresh one."""
        self.out.send_pyobj(self.report.message(self._stats()))
        self.report = ReportBuilder(self.dp_rank)

    def _record(self, launched: Launched) -> None:
        """The leader logs a step, its samples processed (a GPU's forward is done by then)."""
        if self.scheduler is None:
            return
        layout = launched.layout
        self.step_counts["steps_padded" if layout.padded else "steps_eager"] += 1
        record = StepRecord(
            kind=launched.kind,
            local_mode=launched.batch.kind,
            padding_mode=layout.padding_mode,
            tokens=layout.tokens,
            mlp_rows=layout.mlp_rows,
            seconds=launched.end - launched.start,
            forward_seconds=elapsed(launched.forward_time),
            real_rows=layout.total_tokens,
            padded=layout.padded,
            retractions=launched.step.retractions,
            slots_written=launched.slots_written,
            draft_seconds=launched.draft_seconds,
            draft_padded=launched.draft_padded,
            comm_bytes=launched.comm_bytes,
            logit_rows=layout.logit_rows,
            rebalance=launched.rebalance,
            process_seconds=launched.process_seconds,
            pending_tokens=sum(r.tokens[0] == PENDING_TOKEN for r in launched.batch.reqs),
        )
        imbalance = None
        if launched.load is not None:
            self.expert_load.add(launched.rows)  # the leader's, for GetExpertLoad
            imbalance = self.expert_load.imbalance(launched.load)
        self._imbalance_logged(self.step_log.append(record, imbalance))

    def _sample(self, step: ScheduledStep, logits: torch.Tensor) -> SampleLaunch | None:
        """The leader's samples of the step's logits rows (None when no request samples)."""
        if not step.batch.num_logit_rows:
            return None
        s = self.scheduler
        follow_counts(self.token_counts, s.running, step.sampled)
        i = sampling_inputs(step.sampled, self.token_counts, s.vocab_size, s.eos_ids)
        return launch_sample(logits, i.params, i.keys, i.drafts, i.penalties, i.grammar)

    def _report_rebalance(self, rebalance: Rebalance) -> None:
        logger.info(
            "expert rebalance after step %d: %d slots, %.1f MiB between ranks in %.2f s; imbalance %.3f -> %.3f",
            rebalance.step,
            rebalance.slots_moved,
            rebalance.bytes_moved / 2**20,
            rebalance.seconds,
            rebalance.imbalance_before,
            rebalance.imbalance_after,
        )
        self.report.rebalances.append(rebalance)
        self.report.changed = True

    def _imbalance_logged(self, imbalance: float | None) -> None:
        """The expert imbalance of a MoE step its log record just completed, for /metrics."""
        if imbalance is not None:
            self.report.expert_imbalance.append(imbalance)

    def _stats(self) -> dict:
        return {**self.scheduler.stats(), **self.step_counts} if self.scheduler else {}

    def _drain(self, wait_ms: int) -> bool:
        """Takes every pending message; returns True when asked to shut down."""
        shutdown = False
        while self.requests.poll(wait_ms):
            wait_ms = 0
            msg = self.requests.recv_pyobj()
            self.report.changed = True
            output = None
            match msg:
                case GenerateRequest():
                    output = self.scheduler.add(msg)  # an error output if it can never run
                case AbortRequest(rid=rid, message=message):
                    output = self.scheduler.abort(rid, message)
                case KVDestination(rid=rid, dest=dest):
                    self.scheduler.set_destination(rid, dest)
                case Wake():  # another group has work: join its steps
                    pass
                case GetExpertLoad():
                    self.out.send_pyobj(ExpertLoad(self.dp_rank, self.expert_load.take()))
                case GetStepLog():
                    self._imbalance_logged(self.step_log.complete())  # the pending record first
                    self.out.send_pyobj(StepRecords(self.dp_rank, self.step_log.take()))
                case FlushCache():
                    self.scheduler.flush_cache()
                case Shutdown():
                    shutdown = True
            if output is not None:
                self.report.finished.append(output)
        return shutdown


@dataclass
class Launched:
    """A step whose forward ran (on a GPU: is queued), from its sampling to its step record."""

    batch: GroupBatch
    step: ScheduledStep | None  # the leader's; None on the other ranks
    layout: StepLayout
    kind: BatchKind  # the largest over the groups
    start: float
    forward_time: ForwardTime
    samples: SampleLaunch | None = None  # the leader's, when any request samples
    load: torch.Tensor | None = None  # MoE: rows per expert slot, over every group (on the device)
    rows: torch.Tensor | None = None  # ... per logical expert
    rebalance: Rebalance | None = None
    slots_written: int = 0
    comm_bytes: int = 0
    draft_seconds: float = 0.0
    draft_padded: int = 0
    end: float = 0.0  # when its sampling, drafting and load counting were done
    process_seconds: float = 0.0


class ReportBuilder:
    """What a group leader gathers during a step for its `StepReport`; sent when anything changed."""

    def __init__(self, dp_rank: int):
        self.dp_rank = dp_rank
        self.tokens: list[TokenOut] = []
        self.expert_imbalance: list[float] = []
        self.rebalances: list[Rebalance] = []
        self.cached: list[tuple[str, int]] = []
        self.finished: list[RequestOutput] = []
        self.changed = False

    def add(self, tokens: list[TokenOut], finished: list[RequestOutput]) -> None:
        self.tokens += tokens
        self.finished += finished
        self.changed = True

    def message(self, stats: dict) -> StepReport:
        return StepReport(
            self.dp_rank,
            self.tokens,
            self.cached,
            self.finished,
            self.expert_imbalance,
            self.rebalances,
            stats,
        )
