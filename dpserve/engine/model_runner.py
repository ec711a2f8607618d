"""One rank's model, KV pool, and the step that turns a StepPlan into logits.

Decode steps that fit a bucket run padded (design section 4): as CUDA graphs on the GPU,
eagerly with the very same padded batches on the CPU.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from itertools import accumulate

import torch

from dpserve.attention import make_backend
from dpserve.config import EngineConfig
from dpserve.distributed import Groups
from dpserve.engine.drafter import NextNDrafter
from dpserve.engine.graph_runner import CudaGraphRunner
from dpserve.engine.padding import PaddingPlanner, calibrate
from dpserve.kvcache.pool import KVPool
from dpserve.layers.dp_attention import DPStep
from dpserve.memory import agree_min, kv_budget_bytes, kv_pool_tokens, param_bytes
from dpserve.models.batch import ForwardBatch
from dpserve.models.checkpoint import CheckpointReader
from dpserve.models.config import ModelConfig
from dpserve.models.registry import build_model
from dpserve.scheduler.plan import ReqStep, StepPlan

logger = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


class ModelRunner:
    def __init__(self, cfg: EngineConfig, model_cfg: ModelConfig, groups: Groups, local_rank: int):
        self.cfg, self.model_cfg, self.groups = cfg, model_cfg, groups
        self.topo = groups.topo
        self.device = torch.device("cuda", local_rank) if cfg.device == "cuda" else torch.device("cpu")
        if cfg.device == "cuda":
            torch.cuda.set_device(self.device)
        self.dtype = DTYPES[cfg.dtype]
        torch.manual_seed(cfg.random_seed)
        previous = torch.get_default_dtype()
        torch.set_default_dtype(self.dtype)
        try:
            with torch.device(self.device):
                backend = make_backend(cfg.attention_backend)
                self.model = build_model(model_cfg, groups, backend, mtp=cfg.speculative_algorithm == "NEXTN")
        finally:
            torch.set_default_dtype(previous)
        reader = CheckpointReader(cfg.model_path, self.dtype)
        self.model.load_weights(reader, show_progress=self.topo.rank == 0)
        reader.close()
        self.model.to(self.device)
        self.weight_bytes = param_bytes(self.model)
        shapes = self.model.kv_entry_shapes()
        self.kv_bytes_per_token = KVPool.bytes_per_token(self.model.kv_layers, shapes, self.dtype)
        # Pool slot of every position of every running request, kept alike on every rank of the group:
        # each step writes only its new slots (row 0 stays zero for padded rows).
        self.req_to_token = torch.zeros(
            cfg.max_running_requests + 1, model_cfg.context_len, dtype=torch.int32, device=self.device
        )
        self.activation_bytes = 0
        self.slots_written = 0  # request-to-slot entries the last step wrote
        self.forward_seconds = 0.0  # the model's part of the last step (the rest is host work)
        self.hidden: torch.Tensor | None = None  # NEXTN: the last step's hidden states
        local_tokens = self._kv_capacity(shapes)
        # Every rank of the instance takes the smallest pool, so the ranks of a group hold the same.
        self.max_total_num_tokens = agree_min(local_tokens, groups.world_cpu)
        self.pool = KVPool(model_cfg.num_layers, self.max_total_num_tokens, shapes, self.dtype, self.device)
        logger.info(
            "dp_rank %d attn_tp_rank %d: weights %.1f MiB, activation peak %.1f MiB, KV budget holds %d "
            "tokens here; KV pool of %d tokens (the instance's minimum) x %d bytes (%.1f MiB)",
            self.topo.dp_rank,
            self.topo.attn_tp_rank,
            self.weight_bytes / 2**20,
            self.activation_bytes / 2**20,
            local_tokens,
            self.max_total_num_tokens,
            self.kv_bytes_per_token,
            self.max_total_num_tokens * self.kv_bytes_per_token / 2**20,
        )
        # A decode step whose longest request exceeds what a graph's attention reads runs eagerly.
        self.graph_kv_len = min(model_cfg.context_len, self.model.attn_backend.graph_max_kv_len or 1 << 62)
        self.planner = PaddingPlanner(cfg.dp_padding_mode, cfg.graph_buckets, self.topo)
        self.graphs = CudaGraphRunner(self) if cfg.device == "cuda" and cfg.graph_buckets else None
        if cfg.dp_padding_mode == "auto" and self.topo.dp_size > 1:
            self.planner.cost = calibrate(self._idle_step, self.topo, self.device, groups.world_cpu)
        self.drafter = NextNDrafter(self, cfg.speculative_num_steps) if self.model.mtp is not None else None

    def _kv_capacity(self, shapes: list[tuple[int, ...]]) -> int:
        """This rank's pool size from dpserve.memory (the planner predicts it with the same calls)."""
        cfg = self.cfg
        total = 0
        budget_from_memory = cfg.max_total_tokens is None and cfg.kv_cache_memory_gb is None
        if cfg.device == "cuda" and budget_from_memory:
            self.activation_bytes = self._measure_activation_peak(shapes)
            total = torch.cuda.mem_get_info(self.device)[1]
        budget = kv_budget_bytes(
            cfg.device,
            cfg.kv_cache_memory_gb,
            cfg.mem_fraction_static,
            total,
            self.weight_bytes,
            self.activation_bytes,
        )
        if cfg.device == "cuda" and budget_from_memory:
            # Never more than is free now (another process may hold part of the device).
            free = torch.cuda.mem_get_info(self.device)[0]
            budget = min(budget, free - self.activation_bytes)
        return kv_pool_tokens(budget, self.kv_bytes_per_token, cfg.max_total_tokens)

    def _measure_activation_peak(self, shapes: list[tuple[int, ...]]) -> int:
        """Peak memory of a warm-up prefill of the largest chunk in every DP group (all ranks
        together: the forward joins every WORLD collective), on a temporary pool."""
        n = min(self.cfg.chunked_prefill_size, self.model_cfg.context_len)
        pool = KVPool(self.model_cfg.num_layers, n, shapes, self.dtype, self.device)
        plan = StepPlan(
            "extend", [ReqStep(row=1, start=0, tokens=[0] * n, slots=list(range(1, n + 1)), sample=True)]
        )
        topo = self.topo
        step = DPStep("sum_len", (n,) * topo.dp_size, (1,) * topo.dp_size, topo.dp_rank, topo.attn_tp_size)
        torch.cuda.synchronize(self.device)
        torch.cuda.reset_peak_memory_stats(self.device)
        base = torch.cuda.memory_allocated(self.device)
        self.model.forward(self._batch(plan, step), pool)
        torch.cuda.synchronize(self.device)
        peak = torch.cuda.max_memory_allocated(self.device) - base
        self.req_to_token.zero_()
        del pool
        torch.cuda.empty_cache()
        return int(peak)

    def can_use_graph(self, plan: StepPlan) -> bool:
        """Whether this group's batch can be padded to a bucket (a captured graph on the GPU): decode,
        verify (one row per token) or idle; every request's KV short enough for the backend's graphs."""
        if plan.mode == "extend" or not self.cfg.graph_buckets:
            return False
        return all(r.seq_len <= self.graph_kv_len for r in plan.reqs)

    def make_step(self, tokens: list[int], logit_rows: list[int], can_pad: bool) -> DPStep:
        """The step's layout from every group's sizes; `can_pad`: every group can use a graph."""
        return self.planner.step(tokens, logit_rows, can_pad)

    def forward(self, plan: StepPlan, step: DPStep) -> torch.Tensor:
        """Runs the model on this group's plan (possibly empty); returns logits of sampled rows."""
        batch = self._batch(plan, step)
        start = time.perf_counter()
        hidden = self._hidden(batch)
        if self.model.mtp is not None:
            self.hidden = hidden  # NEXTN's MTP forwards pair it with the accepted tokens
        logits = self.model.compute_logits(hidden, batch)
        if logits.is_cuda:
            torch.cuda.synchronize(self.device)
        self.forward_seconds = time.perf_counter() - start
        return logits

    def _hidden(self, batch: ForwardBatch) -> torch.Tensor:
        if self.graphs is not None and self.graphs.has(batch.step):
            return self.graphs.replay(batch)
        return self.model.forward_hidden(batch, self.pool)

    def _idle_step(self, step: DPStep) -> Callable[[], torch.Tensor]:
        """A padded step with no real rows, run as decode steps run (for the cost model)."""
        batch = self._batch(StepPlan(), step)
        return lambda: self._hidden(batch)

    def _batch(self, plan: StepPlan, step: DPStep) -> ForwardBatch:
        """The step's inputs; host work proportional to the new tokens, not to the contexts."""
        dev, reqs = self.device, plan.reqs
        rows, cols, slots = [], [], []  # request-to-slot table entries written this step
        for r in reqs:
            rows += [r.row] * (len(r.prefix) + len(r.slots))
            cols += range(r.start - len(r.prefix), r.seq_len)
            slots += r.prefix + r.slots
        self.slots_written = len(slots)  # a decode step writes one per request, whatever the contexts
        if slots:
            self.req_to_token[torch.tensor(rows, device=dev), torch.tensor(cols, device=dev)] = torch.tensor(
                slots, dtype=torch.int32, device=dev
            )
        positions = [p for r in reqs for p in range(r.start, r.seq_len)]
        # Rows to return logits for: a request's last, or every one of a verify step's.
        ends = list(accumulate(len(r.tokens) for r in reqs))
        logit_idx = [i for r, end in zip(reqs, ends, strict=True) for i in range(end - r.logit_rows, end)]
        # Padded rows: token 0 at position 0, each a one-token request on row 0, writing slot 0.
        pad = step.local_rows - plan.num_tokens
        if step.graph:
            # A padded step has a decode graph's shapes: one query row per token. A verify step's
            # token at position p attends to the p + 1 keys up to its own, its drafts included (all of
            # them are in the pool before attention reads it): causal attention, row by row.
            req_rows = [r.row for r in reqs for _ in r.tokens]
            q_lens, seq_lens = [1] * len(positions), [p + 1 for p in positions]
        else:
            req_rows, q_lens, seq_lens = (
                [r.row for r in reqs],
                [len(r.tokens) for r in reqs],
                [r.seq_len for r in reqs],
            )
        return ForwardBatch.build(
            step,
            self.req_to_token,
            [t for r in reqs for t in r.tokens] + [0] * pad,
            positions + [0] * pad,
            [s for r in reqs for s in r.slots] + [0] * pad,
            req_rows + [0] * pad,
            q_lens + [1] * pad,
            seq_lens + [1] * pad,
            logit_idx,
        )
