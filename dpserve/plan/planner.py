"""Per layout: memory figures (from the engine's code, layouts.py) and predicted step times.

Decode step time of one rank (all ranks step in lockstep) at a global batch of B requests:

    sum over parts (attention, MLP/MoE, LM head) of max(bytes / bandwidth, FLOPs / FLOP rate)
    + the forward's collectives (dpserve.plan.comm: the bytes the engine counts, collective by
      collective, for every MoE placement), alpha-beta, with the padding mode `auto` would pick
    + fixed costs (kernel launches per layer on GPU; eager op dispatch on the CPU; host work per step)

Bytes: attention weights, the routed experts the step touches (E * (1 - (1 - k/E)^rows): the engine
runs only the chosen experts, by the fused grouped GEMM on GPU, in eager steps and CUDA graphs
alike; all E with `moe_kernel="dense"`, for comparison; with expert parallelism a rank's own whole
experts), dense MLP and shared experts, the KV cache read. Rows: the padded rows each mode makes
(docs/design.md, section 4): sum_len bucket(S) rows; max_len dp * round_up(bucket(max n_g), A); an MLP
on each rank's own rows (replicated, or shared experts beside all_to_all) 1/A of its group's. The
expert work is the same with TP MoE and EP (top_k slices per row, or top_k / T whole experts per
row per rank): what EP changes here is the bytes moved (all_to_all) and where shared experts run.
"""

from __future__ import annotations

import bisect
import math
from dataclasses import dataclass, field

from dpserve.models.config import ModelConfig
from dpserve.plan.comm import Collective, forward_collectives
from dpserve.plan.layouts import Layout, LayoutMemory, enumerate_layouts, layout_memory, meta_model
from dpserve.plan.profiles import DeviceProfile
from dpserve.step.records import StepLayout, round_up

# Eager ops per step on the CPU (counted with a TorchDispatchMode on the engine's forward of the tiny
# models): fixed per step, per layer by part, per routed expert the sparse path visits.
OPS_STEP = 60
OPS_MLA, OPS_GQA, OPS_MLP, OPS_MOE, OPS_EXPERT, OPS_LAYER = 110, 52, 6, 30, 12, 22
# GPU: an unpadded all_to_all step reads the exchanged counts on the host once per MoE layer (the
# split sizes of the dispatch), draining the stream: an assumption, listed in GPU_ASSUMPTIONS.
A2A_COUNTS_SYNC_S = 50e-6


@dataclass
class Workload:
    input_len: int = 1024
    output_len: int = 256
    concurrency: int | None = None  # requests in flight over all GPUs
    request_rate: float | None = None  # requests/s (concurrency from Little's law)
    tpot_ms: float | None = None  # target time per output token
    batch_sizes: list[int] | None = None  # decode batches (over all GPUs) to predict


@dataclass
class StepTime:
    batch: int  # requests over all GPUs
    seconds: float
    mode: str  # padding mode auto picks (sum_len with one group)
    mlp_rows: int  # rows the MoE/MLP processes (with padding)
    parts: dict = field(default_factory=dict)  # seconds by part
    comm_bytes: int = 0  # bytes one rank sends in the step's forward (dpserve.plan.comm)

    @property
    def throughput(self) -> float:
        return self.batch / self.seconds


@dataclass
class LayoutPlan:
    mem: LayoutMemory
    max_concurrency: int = 0  # requests that fit over all GPUs (KV and --max-running-requests)
    decode: list[StepTime] = field(default_factory=list)
    prefill_chunk_s: float = 0.0  # one prefill step of chunked_prefill_size tokens in every group
    prefill_chunk_tokens: int = 0
    prefill_chunk_comm_bytes: int = 0  # bytes one rank sends in that prefill step
    at_concurrency: StepTime | None = None  # the workload's concurrency (or the most that fits)
    best_under_tpot: StepTime | None = None  # the largest batch whose step is within the TPOT target

    @property
    def layout(self) -> Layout:
        return self.mem.layout


def _bucket(buckets: list[int], n: int) -> int | None:
    i = bisect.bisect_left(buckets, n)
    return buckets[i] if i < len(buckets) else None


class StepModel:
    def __init__(
        self, mem: LayoutMemory, model_cfg: ModelConfig, prof: DeviceProfile, nnodes: int, moe_kernel: str
    ):
        self.mem, self.m, self.p = mem, model_cfg, prof
        cfg = mem.cfg
        self.cfg = cfg
        self.model = meta_model(model_cfg, cfg)  # the engine's model (meta device): its collectives
        self.window_size = self.model.window_size
        self.T, self.A = cfg.tp_size, cfg.attn_tp_size
        self.G = cfg.dp_size if cfg.enable_dp_attention else 1  # groups in one instance
        self.ranks_per_node = mem.layout.num_gpus // nnodes
        self.world_spans = self.ranks_per_node < self.T
        self.attn_spans = self.ranks_per_node < self.A
        self.buckets = cfg.graph_buckets
        self.graphs = bool(self.buckets)
        self.moe_kernel = moe_kernel  # engine: the chosen experts only; dense: every expert on every row
        r, c = self.ranks_per_node, max(prof.cores, 1)
        self.op_s = prof.op_overhead
        self.alpha = {}
        if prof.is_cpu:
            threads = max(1, c // r)
            by_threads = prof.measured.get("op_s_by_threads", {})
            self.op_s = by_threads.get(str(threads), prof.op_overhead)
            # gloo latency per ring step measured with this many processes on the machine
            for w, g in prof.measured.get("gloo_by_world", {}).items():
                self.alpha[int(w)] = g["alpha"]
            self.compute_share = threads / c if r <= c else 1 / r
            self.bw_share = 1 / min(r, c)
            self.oversub = max(1.0, r / c)
        else:
            self.compute_share = self.bw_share = self.oversub = 1.0

    # --- collectives ---------------------------------------------------------------------------
    def _coll(self, c: Collective) -> float:
        """Alpha-beta seconds of one collective: latency per ring step, then the bytes this rank sends."""
        p = self.p
        ranks, spans = (self.T, self.world_spans) if c.group == "world" else (self.A, self.attn_spans)
        alpha, bw = (p.inter_alpha, p.inter_bw) if spans else (p.intra_alpha, p.intra_bw)
        steps = 2 * (ranks - 1) if c.kind == "all_reduce" else ranks - 1
        if p.is_cpu:
            # measured at the node's process count (contention included), else scaled from 2 processes
            measured = self.alpha.get(self.ranks_per_node)
            latency = steps * (measured if measured is not None else alpha * self.oversub)
        else:
            latency = alpha * (2 if c.kind == "all_reduce" else 1)
        return latency + c.sent / bw

    # --- one step --------------------------------------------------------------------------------
    def step(self, layout: StepLayout, real_local: int, ctx: float) -> tuple[dict, int]:
        """(Seconds by part, bytes one rank sends) of one step of `layout` (group 0's view), with
        `real_local` real requests per group reading `ctx` KV tokens each."""
        local_rows, mlp_rows = layout.local_rows, layout.mlp_rows
        own_rows = round_up(local_rows, self.A) // self.A
        sampled = layout.logit_rows[0]
        m, c, p = self.m, self.mem.comp, self.p
        flops = p.flops * p.flop_eff * self.compute_share
        bw = p.mem_bw * p.mem_eff * self.bw_share
        L, H = m.num_layers, m.hidden_size
        heads = m.num_heads // self.A
        hf = m.hf
        # attention: weights, KV read, projections and the attention core
        kv_rows = local_rows if p.is_cpu else real_local  # the sdpa grid gathers max_seq_len for every row
        kv_factor = 3 if p.is_cpu else 1  # sdpa: gather (read + write) then attend
        kv_bytes = kv_rows * ctx * self.mem.kv_bytes_per_token * kv_factor
        # The hybrid pool's sliding-window layers read their windows only.
        kv_bytes += kv_rows * min(ctx, self.window_size) * self.mem.window_bytes_per_token * kv_factor
        if m.is_mla and m.declaration.sparse_attention:
            # V3.2: the indexer reads every key of its own (index_head_dim per token and layer) and
            # scores it with each of its heads; MLA reads and attends to the index_topk chosen only.
            chosen = min(ctx, hf.index_topk)
            index_share = hf.index_head_dim / (hf.index_head_dim + hf.kv_lora_rank + hf.qk_rope_head_dim)
            per_token = self.mem.kv_bytes_per_token * kv_factor
            kv_bytes = kv_rows * per_token * (ctx * index_share + chosen * (1 - index_share))
            core = 2 * heads * chosen * (2 * (hf.kv_lora_rank + hf.qk_rope_head_dim)) * L
            core += 2 * hf.index_n_heads * ctx * hf.index_head_dim * L
        elif m.is_mla:
            core = 2 * heads * ctx * (2 * (hf.kv_lora_rank + hf.qk_rope_head_dim)) * L
        else:
            hd = getattr(hf, "head_dim", None) or H // m.num_heads
            core = 4 * heads * ctx * hd * L
        attn_flops = 2 * c.attn_params * local_rows + core * kv_rows
        t_attn = max((c.attn_bytes + kv_bytes) / bw, attn_flops / flops)
        # MLP / MoE on the gathered rows
        if c.moe_layers:
            # a rank's experts each row reaches: top_k slices (TP MoE), top_k / T whole experts (EP)
            share = c.num_experts / c.total_experts
            if self.moe_kernel == "dense":
                touched, active = c.num_experts, c.num_experts
            else:
                touched = c.num_experts * (1 - (1 - c.top_k / c.total_experts) ** mlp_rows)
                active = c.top_k * share
        else:
            touched = active = 0
        mlp_bytes = c.dense_mlp_bytes + c.gate_bytes + touched * c.expert_bytes * c.moe_layers
        gathered = c.dense_mlp_params - c.own_rows_mlp_params
        mlp_flops = 2 * (
            mlp_rows * (gathered + c.gate_params + active * c.expert_params * c.moe_layers)
            + own_rows * c.own_rows_mlp_params
        )
        t_mlp = max(mlp_bytes / bw, mlp_flops / flops)
        t_head = max(c.head_bytes / bw, 2 * sampled * c.head_params / flops)
        colls = forward_collectives(self.model, layout)
        t_coll = sum(self._coll(x) for x in colls)
        # fixed costs
        fixed = p.step_overhead + p.layer_overhead * L
        if not p.is_cpu and not layout.padded:
            fixed += A2A_COUNTS_SYNC_S * sum(x.part == "counts" for x in colls)
        if p.is_cpu:
            ops = OPS_STEP + L * OPS_LAYER
            for layer_is_moe in self._layer_kinds():
                ops += OPS_MLA if m.is_mla else OPS_GQA
                if layer_is_moe:
                    visited = c.num_experts * (1 - (1 - c.top_k / c.num_experts) ** mlp_rows)
                    ops += OPS_MOE + OPS_EXPERT * visited
                else:
                    ops += OPS_MLP
            fixed += ops * self.op_s * self.oversub
        parts = {"attention": t_attn, "mlp": t_mlp, "lm_head": t_head, "collectives": t_coll, "fixed": fixed}
        return parts, sum(x.sent for x in colls)

    def _layer_kinds(self) -> list[bool]:
        c = self.mem.comp
        return [True] * c.moe_layers + [False] * (self.m.num_layers - c.moe_layers)

    def decode(self, batch: int, ctx: float) -> StepTime:
        """A decode step with `batch` requests spread evenly over all groups of all instances."""
        groups_total = self.mem.groups
        G, A = self.G, self.A
        b = math.ceil(batch / groups_total)  # requests of the busiest group
        per_instance = math.ceil(batch / (groups_total // G))  # S: real rows of one instance
        options = []
        modes = ("sum_len", "max_len") if G > 1 and self.cfg.dp_padding_mode == "auto" else None
        if modes is None:
            modes = (self.cfg.dp_padding_mode if G > 1 else "sum_len",)
        # the instance's S rows as evenly over its groups as the router spreads them (the busiest: b)
        tokens = tuple(per_instance // G + (g < per_instance % G) for g in range(G))
        for mode in modes:
            if mode == "sum_len":
                bucket = _bucket(self.buckets, per_instance) if self.graphs else None
            else:
                bucket = _bucket(sorted({round_up(x, A) for x in self.buckets}), b) if self.graphs else None
            layout = StepLayout(mode, tokens, tokens, 0, A, bucket)
            parts, sent = self.step(layout, b, ctx)
            options.append(StepTime(batch, sum(parts.values()), mode, layout.mlp_rows, parts, sent))
        return min(options, key=lambda s: s.seconds)

    def padding_edges(self, max_batch: int) -> list[int]:
        """The largest batches whose decode steps still fit a bucket under sum_len and under max_len,
        then `max_batch`: the ranges `largest_within` bisects."""
        edges = {max_batch}
        if self.graphs:
            instances = self.mem.groups // self.G
            edges.add(max(self.buckets) * instances)
            edges.add(max(round_up(x, self.A) for x in self.buckets) * self.mem.groups)
        return sorted(e for e in edges if e <= max_batch)

    def prefill_chunk(self, tokens: int) -> tuple[float, int]:
        """(Seconds, bytes one rank sends) of one prefill step of `tokens` new tokens in every group
        (eager, sum_len)."""
        layout = StepLayout("sum_len", (tokens,) * self.G, (1,) * self.G, 0, self.A)
        parts, sent = self.step(layout, tokens, tokens / 2)
        return sum(parts.values()), sent


def default_batches(max_concurrency: int) -> list[int]:
    out, b = [], 1
    while b < max_concurrency:
        out.append(b)
        b *= 2
    return [*out, max_concurrency] if max_concurrency > 0 else []


def plan_layout(
    mem: LayoutMemory, model_cfg: ModelConfig, prof: DeviceProfile, wl: Workload, nnodes: int, moe_kernel: str
) -> LayoutPlan:
    plan = LayoutPlan(mem)
    if not mem.valid:
        return plan
    cfg = mem.cfg
    per_request = wl.input_len + wl.output_len
    per_group = min(cfg.running_per_group, mem.kv_tokens_per_group // per_request)
    plan.max_concurrency = per_group * mem.groups
    sm = StepModel(mem, model_cfg, prof, nnodes, moe_kernel)
    ctx = wl.input_len + wl.output_len / 2
    batches = wl.batch_sizes or default_batches(plan.max_concurrency)
    plan.decode = [sm.decode(b, ctx) for b in batches if b <= max(plan.max_concurrency, 1)]
    plan.prefill_chunk_tokens = min(cfg.chunk_per_group, wl.input_len)
    plan.prefill_chunk_s, plan.prefill_chunk_comm_bytes = sm.prefill_chunk(plan.prefill_chunk_tokens)
    if plan.max_concurrency:
        conc = plan.max_concurrency
        if wl.concurrency:
            conc = min(wl.concurrency, conc)
        elif wl.request_rate:
            prefill_s = plan.prefill_chunk_s * math.ceil(wl.input_len / plan.prefill_chunk_tokens)
            c = 1.0
            for _ in range(50):  # Little's law: in flight = rate x (prefill + decode time)
                c = wl.request_rate * (prefill_s + wl.output_len * sm.decode(max(1, round(c)), ctx).seconds)
                c = min(c, conc)
            conc = max(1, round(c))
        plan.at_concurrency = sm.decode(conc, ctx)
        if wl.tpot_ms:
            plan.best_under_tpot = largest_within(sm, ctx, wl.tpot_ms / 1e3, plan.max_concurrency)
    return plan


def largest_within(sm: StepModel, ctx: float, limit_s: float, max_batch: int) -> StepTime | None:
    """The step of the largest batch up to `max_batch` whose decode step takes at most `limit_s`
    (None when batch 1 already takes longer), by bisection inside each range of batches whose steps
    a padding mode runs all padded or all unpadded: the step time grows with the batch inside one,
    but an unpadded step can be cheaper than the largest padded one (all_to_all's fixed capacity)."""
    best, lo = None, 1
    for edge in sm.padding_edges(max_batch):
        hi = edge
        while lo <= hi:
            mid = (lo + hi) // 2
            step = sm.decode(mid, ctx)
            if step.seconds <= limit_s:
                best, lo = step, mid + 1
            else:
                hi = mid - 1
        lo = edge + 1
    return best


@dataclass
class Plan:
    model: str
    model_path: str
    model_cfg: ModelConfig
    profile: DeviceProfile
    num_gpus: int
    nnodes: int
    workload: Workload
    layouts: list[LayoutPlan]
    engine_kwargs: dict


def make_plan(
    model: str,
    profile: DeviceProfile,
    num_gpus: int,
    workload: Workload,
    engine_kwargs: dict,
    nnodes: int = 1,
    gpu_memory_bytes: int | None = None,
    layouts: list[Layout] | None = None,
    moe_kernel: str = "engine",
) -> Plan:
    from dpserve.plan.model import load

    path, model_cfg = load(model, engine_kwargs.get("quantization"))
    total = gpu_memory_bytes or profile.memory_bytes
    kwargs = dict(engine_kwargs, nnodes=nnodes)
    if nnodes > 1:
        kwargs.setdefault("dist_init_addr", "node0:29500")
    plans = []
    moe = model_cfg.moe is not None
    for layout in layouts or enumerate_layouts(num_gpus, moe):
        mem = layout_memory(layout, path, model_cfg, profile.device, total, kwargs)
        plans.append(plan_layout(mem, model_cfg, profile, workload, nnodes, moe_kernel))
    return Plan(model, path, model_cfg, profile, num_gpus, nnodes, workload, plans, engine_kwargs)
