"""The memory model shared by the KV allocator (engine/model_runner.py) and the planner (dpserve.plan).

One rank's device memory, as SGLang splits it:

    total x mem_fraction_static = weights + KV pool          ("static" memory)
    the rest                     = activations, CUDA graphs, the allocator's slack

dpserve takes the activation peak out of the static share too (measured on the GPU with a
warm-up forward at the largest prefill chunk, estimated by the planner), so that a long
prefill never runs out of memory:

    kv_budget = total x mem_fraction_static - weights - activation_peak

On the CPU the budget is `kv_cache_memory_gb` (default CPU_DEFAULT_KV_GB). `--max-total-tokens`
overrides every budget. The engine sizes its pool with `kv_pool_tokens(kv_budget_bytes(...))` and
the planner predicts it with the very same calls, so the two cannot disagree. All ranks of an
instance then agree on the smallest pool (`agree_min`), so every rank of a group holds the same.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch import nn

CPU_DEFAULT_KV_GB = 0.25  # KV budget per rank on the CPU when kv_cache_memory_gb is not given
DEFAULT_MEM_FRACTION_STATIC = 0.88  # of the device's memory, for weights + KV (GPU)


def param_bytes(model: nn.Module) -> int:
    """Bytes of a model's parameters AND buffers (rotary caches count: the engine allocates them).
    Works on the meta device too, which is how the planner counts a layout's weights per rank."""
    tensors = [*model.parameters(), *model.buffers()]
    return sum(t.numel() * t.element_size() for t in tensors)


def dtype_bytes(dtype: torch.dtype) -> int:
    return torch.empty(0, dtype=dtype).element_size()


def activation_peak_estimate(
    hf,
    hidden_size: int,
    num_heads_local: int,
    tp_size: int,
    dp_size: int,
    chunk_tokens: int,
    dtype: torch.dtype,
    is_mla: bool,
) -> int:
    """Bytes of the largest transient tensors of one prefill forward of `chunk_tokens` rows per DP
    group (the MoE/MLP sees dp_size times as many rows). An upper-end estimate used by the planner
    where the engine measures (`torch.cuda.max_memory_allocated` around a warm-up forward)."""
    e = dtype_bytes(dtype)
    n, rows = chunk_tokens, chunk_tokens * dp_size
    if is_mla:
        latent = hf.kv_lora_rank + hf.qk_rope_head_dim
        # q in latent space, attended latent, and the score matrix of one head group at a time
        attn = n * num_heads_local * (2 * latent + hf.v_head_dim) * e
        attn += n * n * num_heads_local * 4  # float32 scores of the reference backend
    else:
        head_dim = getattr(hf, "head_dim", None) or hidden_size // num_heads_local // max(tp_size, 1)
        attn = 3 * n * num_heads_local * head_dim * e + n * n * num_heads_local * 4
    inter = getattr(hf, "intermediate_size", 0) or 0
    if getattr(hf, "n_routed_experts", None):
        inter = max(inter, hf.moe_intermediate_size * (hf.n_shared_experts or 0))
        # router logits in float32, plus one expert's rows at a time (top_k / experts of all rows)
        routed = rows * hf.n_routed_experts * 4 + rows * hf.num_experts_per_tok * hidden_size * e
    else:
        routed = 0
    mlp = rows * 3 * -(-inter // tp_size) * e + routed
    gathered = 4 * rows * hidden_size * e  # the gathered buffer, residual, partials, norm output
    return int(attn + mlp + gathered)


def kv_budget_bytes(
    device: str,
    kv_cache_memory_gb: float | None,
    mem_fraction_static: float,
    total_memory: int = 0,
    weight_bytes: int = 0,
    activation_bytes: int = 0,
) -> int:
    """The KV budget of one rank in bytes (see the module docstring)."""
    if kv_cache_memory_gb is not None:
        return int(kv_cache_memory_gb * 2**30)
    if device == "cpu":
        return int(CPU_DEFAULT_KV_GB * 2**30)
    return int(total_memory * mem_fraction_static) - weight_bytes - activation_bytes


def kv_pool_tokens(budget_bytes: int, bytes_per_token: int, max_total_tokens: int | None = None) -> int:
    """Tokens a pool holds: `max_total_tokens` when given, else what the budget holds."""
    if max_total_tokens is not None:
        return max_total_tokens
    tokens = budget_bytes // bytes_per_token if budget_bytes > 0 else 0
    if tokens < 1:
        raise ValueError(
            f"a KV budget of {budget_bytes / 2**20:.1f} MiB per rank holds no token ({bytes_per_token} "
            "bytes per token): the weights and activations leave no room; raise --mem-fraction-static, "
            "use more GPUs, or set --kv-cache-memory-gb"
        )
    return int(tokens)


def kv_bytes_per_token(num_layers: int, entry_shapes: list[tuple[int, ...]], dtype: torch.dtype) -> int:
    """Bytes one token takes in one rank's pool, over all layers."""
    return num_layers * sum(math.prod(s) for s in entry_shapes) * dtype_bytes(dtype)


def agree_min(value: int, group: dist.ProcessGroup | None) -> int:
    """The minimum of `value` over every rank of `group` (a CPU/gloo group); all must call it."""
    if group is None:
        return value
    t = torch.tensor([value], dtype=torch.int64)
    dist.all_reduce(t, op=dist.ReduceOp.MIN, group=group)
    return int(t.item())
