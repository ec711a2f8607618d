"""The memory model shared by the KV allocator (worker/model_runner.py) and the planner (dpserve.plan).

One rank's device memory, as SGLang splits it:

    total x mem_fraction_static = weights + KV pool          ("static" memory)
    the rest                     = activations, CUDA graphs, the allocator's slack

dpserve takes the activation peak out of the static share too (measured on the GPU with a
warm-up forward at the largest prefill chunk; estimated by the planner, dpserve.plan.layouts), so
that a long prefill never runs out of memory:

    kv_budget = total x mem_fraction_static - weights - activation_peak

On the CPU the budget is `kv_cache_memory_gb` (default CPU_DEFAULT_KV_GB). `--max-total-tokens`
overrides every budget. The engine sizes its pools with `EngineConfig.kv_pool_sizes(kv_budget_bytes(...),
...)` (`pool_tokens`: `kv_pool_tokens`, or `swa_pool_tokens` for a hybrid sliding-window pool) and
the planner predicts them with the very same calls, so the two cannot disagree. All ranks of an
instance then agree on the smallest pool (`agree_min`), so every rank of a group holds the same.
"""

from __future__ import annotations

import ctypes
import math

import torch
import torch.distributed as dist
from torch import nn

from dpserve.kvcache.pool import entry_bytes

# Transient float32 copies and per-expert intermediates of the gathered rows (up to dp x the step's
# tokens) are made a bounded chunk of rows at a time: about this many bytes per chunk.
ACTIVATION_CHUNK_BYTES = 256 * 2**20
CPU_DEFAULT_KV_GB = 0.25  # KV budget per rank on the CPU when kv_cache_memory_gb is not given
DEFAULT_MEM_FRACTION_STATIC = 0.88  # of the device's memory, for weights + KV (GPU)

# What a rank reports when ready (weight_bytes: its parameters and buffers; activation_bytes: the
# peak measured at start-up, GPU only; window_tokens: the hybrid sliding-window pool's, 0 without).
RANK_FIGURES = (
    "max_total_num_tokens",
    "window_tokens",
    "kv_bytes_per_token",
    "weight_bytes",
    "activation_bytes",
)


def param_bytes(model: nn.Module) -> int:
    """Bytes of a model's parameters AND buffers (rotary caches count: the engine allocates them).
    Works on the meta device too, which is how the planner counts a layout's weights per rank."""
    tensors = [*model.parameters(), *model.buffers()]
    return sum(t.numel() * t.element_size() for t in tensors)


def dtype_bytes(dtype: torch.dtype) -> int:
    return torch.empty(0, dtype=dtype).element_size()


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


def pool_token_bytes(
    kv_layers: int, window_layers: int, entry_shapes: list[tuple[int, ...]], dtype: torch.dtype
) -> tuple[int, int]:
    """Bytes one token takes in one rank's pool: (in the full layers, in the hybrid pool's window
    layers); every layer is a full one without the hybrid pool (`window_layers` 0)."""
    return (
        kv_bytes_per_token(kv_layers - window_layers, entry_shapes, dtype),
        kv_bytes_per_token(window_layers, entry_shapes, dtype),
    )


def pool_tokens(
    budget_bytes: int,
    full_bytes: int,
    window_bytes: int,
    max_total_tokens: int | None,
    ratio: float = 0.0,
    floor: int = 0,
) -> tuple[int, int]:
    """(full, window) pool tokens of one rank; `window_bytes` 0: no hybrid pool (window 0)."""
    if not window_bytes:
        return kv_pool_tokens(budget_bytes, full_bytes, max_total_tokens), 0
    return swa_pool_tokens(budget_bytes, full_bytes, window_bytes, ratio, floor, max_total_tokens)


def swa_pool_tokens(
    budget_bytes: int,
    full_bytes: int,
    window_bytes: int,
    ratio: float,
    floor: int,
    max_total_tokens: int | None = None,
) -> tuple[int, int]:
    """(full, window) pool tokens when sliding-window layers keep only their windows (SGLang's hybrid
    SWA pool): `full_bytes` / `window_bytes` per token over the full / window layers, the window
    pool `ratio` times the full one, together within the budget (`max_total_tokens`: the full
    pool's size). Never below `floor` (what the running requests' windows and one step's new tokens
    can hold at once), nor above the full pool (whose tokens are all a window pool could ever hold):
    a budget too small for the floor gets equal pools."""
    if max_total_tokens is not None:
        full = max_total_tokens
    else:
        full = kv_pool_tokens(budget_bytes, full_bytes + math.ceil(ratio * window_bytes))
        if int(full * ratio) < floor:
            equal = kv_pool_tokens(budget_bytes, full_bytes + window_bytes)
            full = equal if equal <= floor else (budget_bytes - floor * window_bytes) // full_bytes
    return full, min(full, max(int(full * ratio), floor))


def kv_bytes_per_token(num_layers: int, entry_shapes: list[tuple[int, ...]], dtype: torch.dtype) -> int:
    """Bytes one token takes in one rank's pool of `dtype` (the cache's), over `num_layers` layers."""
    return num_layers * sum(entry_bytes(s, dtype) for s in entry_shapes)


def agree_min(value: int, group: dist.ProcessGroup | None) -> int:
    """The minimum of `value` over every rank of `group` (a CPU/gloo group); all must call it."""
    if group is None:
        return value
    t = torch.tensor([value], dtype=torch.int64)
    dist.all_reduce(t, op=dist.ReduceOp.MIN, group=group)
    return int(t.item())


def chunk_rows(bytes_per_row: int, budget: int | None = None) -> int:
    """Rows processed at once so that a chunk's transient buffers take about `budget` bytes
    (ACTIVATION_CHUNK_BYTES by default)."""
    return max(1, (budget or ACTIVATION_CHUNK_BYTES) // bytes_per_row)


def moe_chunk_rows(
    hidden: int, inter: int, top_k: int, experts: int, elem_bytes: int, budget: int | None = None
) -> int:
    """Rows the routed experts take at once: per row, its float32 copy and router scores, and its
    top_k expert intermediates and outputs (the fused kernels' [rows * top_k, inter] and
    [rows * top_k, hidden] buffers)."""
    return chunk_rows(4 * (hidden + 2 * experts) + top_k * (inter + hidden) * elem_bytes, budget)


def release_freed_host_memory() -> None:
    """Hands the heap's freed pages back to the OS (glibc's malloc_trim; nothing elsewhere): loading
    frees the temporaries it read, widened or quantized, but the allocator keeps their pages
    resident, so a rank's RSS would stay above its weights by the load's high-water mark."""
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return
    if hasattr(libc, "malloc_trim"):
        libc.malloc_trim(0)
