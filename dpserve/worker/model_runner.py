"""One rank's model and KV pool, and the forward that turns a group's batch into logits.

Decode steps that fit a bucket run padded (docs/design.md, section 4): as CUDA graphs on the GPU,
eagerly with the very same padded batches on the CPU.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import torch

from dpserve.attention import make_backend
from dpserve.config import EngineConfig
from dpserve.distributed import SENT, Groups, all_reduce
from dpserve.kvcache.pool import KVPool
from dpserve.layers.linear import pack_linears_for_cpu
from dpserve.layers.quant import kernels_used
from dpserve.memory import (
    agree_min,
    kv_budget_bytes,
    param_bytes,
    pool_token_bytes,
    release_freed_host_memory,
)
from dpserve.models.base import CausalLM
from dpserve.models.batch import ForwardBatch, group_inputs
from dpserve.models.config import ModelConfig
from dpserve.models.loader import BlockScales, load_weights
from dpserve.models.registry import build_model
from dpserve.scheduler.scheduler import largest_step
from dpserve.step.padding import PaddingPolicy
from dpserve.step.records import BatchKind, BatchReq, GroupBatch, PaddingMode, StepLayout
from dpserve.worker.compile import CompiledDecode
from dpserve.worker.graph_runner import CudaGraphRunner

logger = logging.getLogger(__name__)


def load_model(cfg: EngineConfig, model_cfg: ModelConfig, groups: Groups, device: torch.device) -> CausalLM:
    """This rank's part of the model, built on `device` in the engine's dtype and loaded."""
    torch.manual_seed(cfg.random_seed)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(cfg.torch_dtype)
    try:
        with torch.device(device):
            backend = make_backend(cfg.attention_backend)
            model = build_model(model_cfg, groups, cfg, backend)
    finally:
        torch.set_default_dtype(previous)
    quantized = BlockScales(model_cfg.quant, model) if model_cfg.quant else None
    load_weights(model.weights(), cfg.model_path, show_progress=groups.topo.rank == 0, quantized=quantized)
    release_freed_host_memory()
    return model


# The model's time in a forward: seconds on the CPU; on a GPU its start and end events, read once
# the step's results are on the host (no synchronisation of its own).
ForwardTime = float | tuple[torch.cuda.Event, torch.cuda.Event]


def elapsed(timing: ForwardTime) -> float:
    """Seconds of a forward's model time (on a GPU, once its end event is reached)."""
    if isinstance(timing, float):
        return timing
    start, end = timing
    end.synchronize()
    return start.elapsed_time(end) / 1e3


def peak_step(cfg: EngineConfig, context_len: int) -> GroupBatch:
    """The largest step (`largest_step`) as a batch: prompts from position 0 and decoding requests
    with their drafts (logits for each), every request on its own table row and fresh slots."""
    d = cfg.num_drafts
    prompts, decoding = largest_step(cfg.chunk_per_group, cfg.running_per_group, d, context_len)
    sizes = [(n, False) for n in prompts] + [(1 + d, d > 0)] * decoding
    batch, used = GroupBatch(BatchKind.EXTEND), 1  # slot 0: the padding slot
    for row, (n, verify) in enumerate(sizes, start=1):
        slots = list(range(used, used + n))
        batch.reqs.append(BatchReq(row, 0, [0] * n, slots, sample=True, verify=verify, window_slots=slots))
        used += n
    return batch


class ModelRunner:
    def __init__(self, cfg: EngineConfig, model_cfg: ModelConfig, groups: Groups, device: torch.device):
        self.cfg, self.model_cfg, self.groups, self.device = cfg, model_cfg, groups, device
        self.topo = groups.topo
        self.model = load_model(cfg, model_cfg, groups, device)
        self.dtype = cfg.torch_dtype
        self.weight_bytes = param_bytes(self.model)
        self._prepare_weights()
        self.kv_shapes = self.model.kv_entry_shapes()
        # The hybrid sliding-window pool: window layers keep only their windows' KV, in slots of their own.
        self.window_size = 0 if cfg.disable_hybrid_swa_memory else self.model.window_size
        self.window_layers = self.model.window_layers if self.window_size else frozenset()
        self.kv_bytes_per_token, self.window_bytes_per_token = pool_token_bytes(
            self.model.kv_layers, len(self.window_layers), self.kv_shapes, cfg.kv_dtype
        )
        # Pool slot of every position of every running request, kept alike on every rank of the group:
        # each step writes only its new slots (row 0 stays zero for padded rows).
        self.req_to_token = torch.zeros(
            cfg.running_per_group + 1, model_cfg.context_len, dtype=torch.int32, device=device
        )
        self.activation_bytes = 0
        self.slots_written = 0  # request-to-slot entries the last step wrote
        self.forward_time: ForwardTime = 0.0  # the model's part of the last step (`elapsed`)
        self.comm_bytes = 0  # bytes this rank sent in the last step's forward (collectives, LM head included)
        self.hidden: torch.Tensor | None = None  # NEXTN: the last step's hidden states
        # Overlap scheduling: each table row's token sampled last, for the next step's pending tokens.
        self.sampled_tokens = torch.zeros(cfg.running_per_group + 1, dtype=torch.long, device=device)
        self.logit_table_rows: torch.Tensor | None = None  # the last forward's, by logits row
        # A decode step whose longest request exceeds what a graph's attention reads runs unpadded.
        max_kv_len = min(model_cfg.context_len, self.model.attn_backend.graph_max_kv_len or 1 << 62)
        self.policy = PaddingPolicy(cfg.dp_padding_mode, cfg.graph_buckets, self.topo, max_kv_len)
        self.req_to_window = torch.zeros_like(self.req_to_token) if self.window_size else None
        local_tokens, local_window = self._kv_capacity()
        # Every rank of the instance takes the smallest pool, so the ranks of a group hold the same.
        self.max_total_num_tokens = agree_min(local_tokens, groups.world_cpu)
        self.window_tokens = agree_min(local_window, groups.world_cpu)
        self.pool = KVPool(
            model_cfg.num_layers,
            self.max_total_num_tokens,
            self.kv_shapes,
            self.dtype,
            device,
            self.window_layers,
            self.window_tokens,
            cfg.kv_dtype,
        )
        self._log_memory(local_tokens)
        self.graphs: CudaGraphRunner | None = None
        self.graph_pool: tuple | None = None
        self.forward_hidden = self.model.forward_hidden
        self._capture(max_kv_len)

    def _prepare_weights(self) -> None:
        """Says which kernels multiply 8-bit weights; packs bfloat16 CPU weights for oneDNN."""
        cfg, model_cfg, device = self.cfg, self.model_cfg, self.device
        if model_cfg.quant is not None:
            q, kernels = model_cfg.quant, kernels_used(self.model, model_cfg.quant, device)
            logger.info("%s weights (%s) kept 8-bit: %s", q.method, q.describe(), kernels)
        if device.type == "cpu" and not cfg.enable_torch_compile:  # inductor packs compiled steps itself
            packed = pack_linears_for_cpu(self.model)
            if packed:
                logger.info("%d linear layers packed for oneDNN (bfloat16 on the CPU)", packed)

    def _log_memory(self, local_tokens: int) -> None:
        logger.info(
            "dp_rank %d attn_tp_rank %d: weights %.1f MiB, activation peak %.1f MiB, KV budget holds %d "
            "tokens here; KV pool of %d tokens (the instance's minimum) x %d bytes (%.1f MiB)%s",
            self.topo.dp_rank,
            self.topo.attn_tp_rank,
            self.weight_bytes / 2**20,
            self.activation_bytes / 2**20,
            local_tokens,
            self.max_total_num_tokens,
            self.kv_bytes_per_token,
            self.max_total_num_tokens * self.kv_bytes_per_token / 2**20,
            f"; its {len(self.window_layers)} sliding-window layers keep {self.window_tokens} tokens "
            f"({self.window_size}-token windows)"
            if self.window_size
            else "",
        )

    def _capture(self, max_kv_len: int) -> None:
        """Padded decode steps compiled (--enable-torch-compile) and, on a GPU, captured as graphs."""
        cfg = self.cfg
        if cfg.enable_torch_compile and cfg.graph_buckets:
            compiled = CompiledDecode(self.model, self.policy.padded_layouts(), cfg.torch_compile_max_bs)
            self.forward_hidden = compiled.forward_hidden
            compiled.warm_up(self.idle_step)
        if cfg.device == "cuda" and cfg.graph_buckets:
            self.graph_pool = torch.cuda.graph_pool_handle()  # NEXTN's MTP graphs share it
            self.graphs = CudaGraphRunner(
                self.model,
                self.req_to_token,
                self.policy.padded_layouts(),
                max_kv_len,
                lambda batch, _: self.forward_hidden(batch, self.pool),
                self.graph_pool,
                "decode steps",
                req_to_window=self.req_to_window,
            )

    def _kv_capacity(self) -> tuple[int, int]:
        """This rank's pool sizes, full and window layers' (0 without the hybrid pool), from
        dpserve.memory (the planner predicts them with the same calls)."""
        cfg = self.cfg
        total = 0
        budget_from_memory = cfg.max_total_tokens is None and cfg.kv_cache_memory_gb is None
        if cfg.device == "cuda" and budget_from_memory:
            self.activation_bytes = self._measure_activation_peak()
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
        return cfg.kv_pool_sizes(
            budget, self.kv_bytes_per_token, self.window_bytes_per_token, self.window_size
        )

    def _measure_activation_peak(self) -> int:
        """Peak memory of a warm-up forward of the largest step the scheduler can form, in every DP
        group (all ranks together: the forward joins every WORLD collective), on a temporary pool."""
        batch = peak_step(self.cfg, self.model_cfg.context_len)
        n = batch.num_tokens
        pool = KVPool(
            self.model_cfg.num_layers,
            n,
            self.kv_shapes,
            self.dtype,
            self.device,
            cache_dtype=self.cfg.kv_dtype,
        )
        topo = self.topo
        layout = StepLayout(
            PaddingMode.SUM_LEN,
            (n,) * topo.dp_size,
            (batch.num_logit_rows,) * topo.dp_size,
            topo.dp_rank,
            topo.attn_tp_size,
        )
        torch.cuda.synchronize(self.device)
        torch.cuda.reset_peak_memory_stats(self.device)
        base = torch.cuda.memory_allocated(self.device)
        self.model.forward(self._inputs(batch, layout), pool)
        torch.cuda.synchronize(self.device)
        peak = torch.cuda.max_memory_allocated(self.device) - base
        self.req_to_token.zero_()
        if self.req_to_window is not None:
            self.req_to_window.zero_()
        del pool
        torch.cuda.empty_cache()
        return int(peak)

    def forward(self, batch: GroupBatch, layout: StepLayout) -> torch.Tensor:
        """Runs the model on this group's batch (possibly empty); returns logits of sampled rows."""
        inputs = self._inputs(batch, layout)
        self.logit_table_rows = inputs.logit_table_rows
        # On the GPU the forward is timed by events, read once the step's results are on the host:
        # no synchronisation of its own.
        events = (
            [torch.cuda.Event(enable_timing=True) for _ in range(2)] if self.device.type == "cuda" else []
        )
        start, sent = time.perf_counter(), SENT.total
        for e in events[:1]:
            e.record()
        hidden = self._hidden(inputs)
        if self.model.mtp is not None:
            self.hidden = hidden  # NEXTN's MTP forwards pair it with the accepted tokens
        logits = self.model.compute_logits(hidden, inputs)
        for e in events[1:]:
            e.record()
        self.forward_time = tuple(events) or time.perf_counter() - start
        self.comm_bytes = SENT.total - sent
        return logits

    def keep_samples(self, tokens: torch.Tensor) -> None:
        """Overlap scheduling: the tokens the last step sampled, one per logits row (on the device, on
        every rank of the group), kept by table row for the next step's `PENDING_TOKEN`s."""
        self.sampled_tokens[self.logit_table_rows] = tokens

    def take_expert_load(self) -> torch.Tensor | None:
        """Rows routed to each expert of each MoE layer since the last call, over every group
        ([layers, experts], on the device: nothing read back), the counts zeroed; None for a model without MoE. Every rank
        must call it: rows counted on each rank's own rows (all_to_all) are summed over WORLD."""
        moes = self.model.moe_layers
        if not moes:
            return None
        load = torch.stack([moe.load for moe in moes])
        if moes[0].on_own_rows:
            all_reduce(load, self.groups.world)
        for moe in moes:
            moe.load.zero_()
        return load

    def _hidden(self, inputs: ForwardBatch) -> torch.Tensor:
        if self.graphs is not None and self.graphs.has(inputs.layout):
            return self.graphs.replay(inputs)
        return self.forward_hidden(inputs, self.pool)

    def idle_step(self, layout: StepLayout) -> Callable[[], torch.Tensor]:
        """A padded step with no real rows, run as decode steps run (for the cost model)."""
        inputs = self._inputs(GroupBatch(), layout)
        return lambda: self._hidden(inputs)

    def _inputs(self, batch: GroupBatch, layout: StepLayout) -> ForwardBatch:
        """The step's inputs (`group_inputs`); a `PENDING_TOKEN` is the previous step's sample."""
        self.slots_written = sum(len(r.prefix) + len(r.slots) for r in batch.reqs)  # a decode step: one each
        return group_inputs(
            batch, layout, self.req_to_token, self.sampled_tokens, self.model.moe_own_rank, self.req_to_window
        )
