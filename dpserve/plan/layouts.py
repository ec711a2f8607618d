"""Layouts the engine can take on a number of GPUs, and their memory figures computed by the
engine's own code: EngineConfig and ModelConfig.validate decide validity (their ValueError is the
reason shown), `build_model` on the meta device gives the weights per rank, `pool_token_bytes`
the KV bytes per token (full and sliding-window layers), and dpserve.memory the pool size, exactly as a started engine computes them.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from dpserve.config import EngineConfig
from dpserve.distributed import Groups
from dpserve.layers.mlp import MLP, MoE
from dpserve.memory import (
    dtype_bytes,
    kv_budget_bytes,
    kv_pool_tokens,
    moe_chunk_rows,
    param_bytes,
    pool_token_bytes,
)
from dpserve.models.config import ModelConfig
from dpserve.models.registry import build_model
from dpserve.scheduler.scheduler import largest_step

MOE_PLACEMENTS = ("tp", "ep", "ep-a2a")  # TP MoE; EP gathering rows (none); EP with all_to_all dispatch


def moe_placement(ep_size: int, moe_a2a_backend: str) -> str:
    """The MOE_PLACEMENTS entry of the engine options `ep_size` and `moe_a2a_backend`."""
    if ep_size == 1:
        return "tp"
    return "ep-a2a" if moe_a2a_backend == "all_to_all" else "ep"


@dataclass(frozen=True)
class Layout:
    tp: int
    dp: int
    dp_attention: bool
    moe: str = "tp"  # one of MOE_PLACEMENTS: --ep-size tp (ep, ep-a2a), --moe-a2a-backend all_to_all (ep-a2a)

    @property
    def name(self) -> str:
        if self.dp_attention:
            name = f"tp{self.tp} dp{self.dp} dp-attn"
        else:
            name = f"tp{self.tp}" + (f" x{self.dp} replicas" if self.dp > 1 else "")
        return name + {"tp": "", "ep": " ep", "ep-a2a": " ep a2a"}[self.moe]

    @property
    def flags(self) -> str:
        out = f"--tp {self.tp} --dp {self.dp}" + (" --enable-dp-attention" if self.dp_attention else "")
        if self.moe != "tp":
            out += f" --ep-size {self.tp}"
        return out + (" --moe-a2a-backend all_to_all" if self.moe == "ep-a2a" else "")

    @property
    def options(self) -> dict:
        """The engine options of the MoE placement."""
        if self.moe == "tp":
            return {}
        return {"ep_size": self.tp, "moe_a2a_backend": "all_to_all" if self.moe == "ep-a2a" else "none"}

    @property
    def num_gpus(self) -> int:
        return self.tp * (1 if self.dp_attention else self.dp)


def enumerate_layouts(num_gpus: int, moe: bool = False) -> list[Layout]:
    """Plain TP over divisors of num_gpus with replicas filling the rest, and DP attention over all
    GPUs for every dp in 2..num_gpus (those not dividing tp come out invalid); for a MoE model each DP
    attention layout also with expert parallelism, rows gathered and dispatched."""
    divisors = [t for t in range(1, num_gpus + 1) if num_gpus % t == 0]
    plain = [Layout(t, num_gpus // t, False) for t in reversed(divisors)]
    placements = MOE_PLACEMENTS if moe else ("tp",)
    return plain + [Layout(num_gpus, d, True, m) for d in range(2, num_gpus + 1) for m in placements]


@dataclass
class Components:
    """Bytes and element counts of one rank's weights, split the way a step reads them."""

    attn_bytes: int = 0  # attention weights of all layers
    dense_mlp_bytes: int = 0  # dense MLP layers and shared experts
    expert_bytes: int = 0  # one routed expert's local shard (w13 + w2), per MoE layer
    num_experts: int = 0  # routed experts on this rank (all with TP MoE)
    total_experts: int = 0
    top_k: int = 0
    moe_layers: int = 0
    gate_bytes: int = 0  # router weights of all MoE layers (float32)
    head_bytes: int = 0  # LM head shard
    embed_bytes: int = 0
    attn_params: int = 0  # elements, for FLOPs
    dense_mlp_params: int = 0
    own_rows_mlp_params: int = 0  # of dense_mlp_params: MLPs on each rank's own rows (replicated)
    expert_params: int = 0
    gate_params: int = 0
    head_params: int = 0


def components(model) -> Components:
    c = Components(
        head_bytes=param_bytes_of([model.lm_head]), embed_bytes=param_bytes_of([model.embed_tokens.weight])
    )
    c.head_params = model.lm_head.numel()
    for layer in model.layers:
        attn = [p for p in layer.self_attn.parameters()]
        c.attn_bytes += param_bytes_of(attn)
        c.attn_params += sum(p.numel() for p in attn)
        mlp = layer.mlp
        if isinstance(mlp, MoE):
            c.moe_layers += 1
            c.num_experts, c.total_experts, c.top_k = mlp.w13.shape[0], mlp.gate.shape[0], mlp.top_k
            c.expert_params = mlp.w13[0].numel() + mlp.w2[0].numel()
            c.expert_bytes = c.expert_params * mlp.w13.element_size()
            gate = [mlp.gate] + ([mlp.correction_bias] if mlp.correction_bias is not None else [])
            c.gate_bytes += param_bytes_of(gate)
            c.gate_params += mlp.gate.numel()
            mlp = mlp.shared_experts
        if isinstance(mlp, MLP):
            params = sum(p.numel() for p in mlp.parameters())
            c.dense_mlp_bytes += param_bytes(mlp)
            c.dense_mlp_params += params
            c.own_rows_mlp_params += params if mlp.on_own_rows else 0
    return c


def param_bytes_of(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


@dataclass
class LayoutMemory:
    layout: Layout
    cfg: EngineConfig | None = None
    error: str | None = None  # the engine's reason the layout is invalid, or why it does not fit
    fits: bool = True
    weight_bytes: int = 0  # per rank: parameters and buffers, as the engine reports
    kv_bytes_per_token: int = 0  # per rank, in the full layers (all of them without a hybrid pool)
    window_bytes_per_token: int = 0  # per rank, in the hybrid pool's sliding-window layers
    activation_bytes: int = 0  # the planner's estimate on GPU (the engine measures it); 0 on CPU
    kv_budget_bytes: int = 0
    kv_tokens_per_group: int = 0
    window_tokens_per_group: int = 0  # the hybrid sliding-window pool's (0: none)
    tokens_without_hybrid: int = 0  # what the pool would hold were every layer to keep every token
    groups: int = 0  # DP groups over all GPUs (DP attention groups, or replicas)
    comp: Components = field(default_factory=Components)

    @property
    def valid(self) -> bool:
        return self.error is None

    @property
    def kv_tokens_total(self) -> int:
        return self.kv_tokens_per_group * self.groups


def step_tokens(cfg: EngineConfig, context_len: int) -> int:
    """Tokens of the largest step a group's scheduler can form (what the engine measures)."""
    prompts, decoding = largest_step(cfg.chunk_per_group, cfg.running_per_group, cfg.num_drafts, context_len)
    return sum(prompts) + decoding * (1 + cfg.num_drafts)


def activation_peak_estimate(
    model_cfg: ModelConfig,
    num_heads_local: int,
    tp_size: int,
    dp_size: int,
    chunk_tokens: int,
    dtype: torch.dtype,
) -> int:
    """Bytes of the largest transient tensors of one prefill forward of `chunk_tokens` rows per DP
    group (the MoE/MLP sees dp_size times as many rows). An upper-end estimate used by the planner
    where the engine measures (`torch.cuda.max_memory_allocated` around a warm-up forward)."""
    e = dtype_bytes(dtype)
    n, rows = chunk_tokens, chunk_tokens * dp_size
    hf, hidden_size, moe = model_cfg.hf, model_cfg.hidden_size, model_cfg.moe
    if model_cfg.is_mla:
        latent = hf.kv_lora_rank + hf.qk_rope_head_dim
        # q in latent space, attended latent, and the score matrix of one head group at a time
        attn = n * num_heads_local * (2 * latent + hf.v_head_dim) * e
        attn += n * n * num_heads_local * 4  # float32 scores of the reference backend
    else:
        head_dim = getattr(hf, "head_dim", None) or hidden_size // num_heads_local // max(tp_size, 1)
        attn = 3 * n * num_heads_local * head_dim * e + n * n * num_heads_local * 4
    inter = getattr(hf, "intermediate_size", 0) or 0
    if moe is not None:
        inter = max(inter, moe.shared_intermediate_size)
        # router logits in float32, plus the experts' buffers, a bounded chunk of rows at a time
        inter_local = -(-moe.intermediate_size // tp_size)
        chunk = min(rows, moe_chunk_rows(hidden_size, inter_local, moe.top_k, moe.num_experts, e))
        routed = chunk * (moe.num_experts * 4 + moe.top_k * (hidden_size + inter_local) * e)
    else:
        routed = 0
    mlp = rows * 3 * -(-inter // tp_size) * e + routed
    gathered = 4 * rows * hidden_size * e  # the gathered buffer, residual, partials, norm output
    return int(attn + mlp + gathered)


def engine_config(layout: Layout, model_path: str, device: str, engine_kwargs: dict) -> EngineConfig:
    return EngineConfig(
        model_path=model_path,
        tp_size=layout.tp,
        dp_size=layout.dp,
        enable_dp_attention=layout.dp_attention,
        device=device,
        **{**engine_kwargs, **layout.options},
    )


_MODEL_CACHE: dict = {}


def meta_model(model_cfg: ModelConfig, cfg: EngineConfig, rank: int = 0):
    """The engine's model of global rank `rank`, built on the meta device (no memory, no weights)."""
    _, topo = cfg.rank_topology(rank)
    shaping = (
        cfg.speculative_algorithm,
        cfg.ep_size,
        cfg.moe_a2a_backend,
        cfg.enable_dp_lm_head,
        cfg.moe_dense_tp_size,
        cfg.ep_num_redundant_experts,
    )
    key = (id(model_cfg), topo, cfg.dtype, shaping)
    if key not in _MODEL_CACHE:
        previous = torch.get_default_dtype()
        torch.set_default_dtype(cfg.torch_dtype)
        try:
            with torch.device("meta"):
                _MODEL_CACHE[key] = build_model(model_cfg, Groups(topo, None, None, None, None), cfg)
        finally:
            torch.set_default_dtype(previous)
    return _MODEL_CACHE[key]


def layout_memory(
    layout: Layout,
    model_path: str,
    model_cfg: ModelConfig,
    device: str,
    total_memory: int,
    engine_kwargs: dict,
) -> LayoutMemory:
    """The figures a started engine would report for this layout, or the reason it cannot start."""
    out = LayoutMemory(layout)
    try:
        cfg = engine_config(layout, model_path, device, engine_kwargs)
        model_cfg.check_layout(cfg)  # what is not built yet is planned, and said under the table
        model = meta_model(model_cfg, cfg)
    except ValueError as e:
        out.error = str(e)
        return out
    out.cfg = cfg
    out.groups = layout.dp
    dtype = cfg.torch_dtype
    out.weight_bytes = param_bytes(model)
    window_size = 0 if cfg.disable_hybrid_swa_memory else model.window_size
    out.kv_bytes_per_token, out.window_bytes_per_token = pool_token_bytes(
        model.kv_layers, len(model.window_layers) if window_size else 0, model.kv_entry_shapes(), cfg.kv_dtype
    )
    out.comp = components(model)
    if cfg.device == "cuda" and cfg.max_total_tokens is None and cfg.kv_cache_memory_gb is None:
        out.activation_bytes = activation_peak_estimate(
            model_cfg,
            model_cfg.num_heads // cfg.attn_tp_size,
            cfg.tp_size,
            cfg.dp_size if cfg.enable_dp_attention else 1,
            step_tokens(cfg, model_cfg.context_len),
            dtype,
        )
    out.kv_budget_bytes = kv_budget_bytes(
        cfg.device,
        cfg.kv_cache_memory_gb,
        cfg.mem_fraction_static,
        total_memory,
        out.weight_bytes,
        out.activation_bytes,
    )
    try:
        out.kv_tokens_per_group, out.window_tokens_per_group = cfg.kv_pool_sizes(
            out.kv_budget_bytes, out.kv_bytes_per_token, out.window_bytes_per_token, window_size
        )
        if window_size:
            out.tokens_without_hybrid = kv_pool_tokens(
                out.kv_budget_bytes, out.kv_bytes_per_token + out.window_bytes_per_token, cfg.max_total_tokens
            )
    except ValueError as e:
        out.fits = False
        out.error = (
            (
                f"does not fit: weights {out.weight_bytes / 2**30:.1f} GiB + activations "
                f"{out.activation_bytes / 2**30:.1f} GiB per rank leave no KV room in "
                f"{total_memory * cfg.mem_fraction_static / 2**30:.1f} GiB (total x mem_fraction_static)"
            )
            if cfg.device == "cuda"
            else str(e)
        )
    return out
