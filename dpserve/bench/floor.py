"""The floor of one decode step on this machine, measured (the library behind
`python -m dpserve.bench.roofline` and bench.one_batch's floor column).

The machine: memory bandwidth from large copies, and the time of every linear of the model at its
own shape and the step's rows with the fastest GEMM kernel the machine offers there (ATen's
F.linear, oneDNN on a prepacked weight, MKL's packed GEMM: `gemm_kernels`), so a small-row GEMM is
charged what it really costs here, not a peak rate, nor what an inefficient kernel costs. The step's
floor is the larger of two lower bounds:

- compute: the model's linears at their measured times, plus the attention core's FLOPs at the
  peak matmul rate (a large square GEMM);
- memory: the bytes a decode step must read (every weight it uses: attention, dense MLP, the
  routed experts the batch touches, E * (1 - (1 - k/E)^rows) of them, the LM head; and the KV
  cache of every request) at the measured bandwidth.

The floor is for the whole model on one device (the engine's tp=1 model). On a CPU every rank
shares the same cores, so it bounds any layout; across N devices divide it by N.
"""

from __future__ import annotations

import functools
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from dpserve.config import EngineConfig
from dpserve.cpu_ops import onednn_packs
from dpserve.layers.linear import Linear
from dpserve.layers.mlp import MoE
from dpserve.memory import kv_bytes_per_token
from dpserve.models.config import ModelConfig

MiB = 2**20
ATEN, ONEDNN_PACKED = "aten", "onednn packed"


def _best_seconds(fn, reps: int) -> float:
    """The fastest of `reps` timed calls: a floor is what the machine can do, not its typical noise."""
    fn()  # warm-up: first-call allocation and kernel selection are not part of the floor
    best = float("inf")
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


class Machine:
    """Bandwidth, peak matmul rate and the time of linears at given shapes, measured on `device`
    with every thread torch has (the engine's one rank at tp=1 uses them all)."""

    def __init__(self, dtype: torch.dtype, device: str = "cpu", reps: int = 7):
        self.dtype, self.device, self.reps = dtype, device, reps
        self._linear: dict[tuple[int, int, int, torch.dtype], dict[str, float]] = {}

    @functools.cached_property
    def bandwidth(self) -> float:
        """Bytes per second of a large copy (read + write), measured when first asked for."""
        big = torch.empty(256 * MiB, dtype=torch.uint8, device=self.device)
        dst = torch.empty_like(big)
        return 2 * big.numel() / self._time(lambda: dst.copy_(big))

    @functools.cached_property
    def peak_flops(self) -> float:
        """FLOP/s of a large square matmul in the machine's dtype, measured when first asked for (a
        minute or more where bfloat16 is emulated)."""
        n = 2048
        a = torch.randn(n, n, dtype=self.dtype, device=self.device)
        b = torch.randn(n, n, dtype=self.dtype, device=self.device)
        return 2 * n**3 / self._time(lambda: a @ b)

    def _time(self, fn) -> float:
        if self.device == "cuda":
            torch.cuda.synchronize()

            def synced():
                fn()
                torch.cuda.synchronize()

            return _best_seconds(synced, self.reps)
        return _best_seconds(fn, self.reps)

    def linear_seconds(self, rows: int, in_features: int, out_features: int, dtype: torch.dtype) -> float:
        """The fastest kernel's time for this GEMM: the floor is what the machine can do."""
        return min(self.gemm_kernels(rows, in_features, out_features, dtype).values())

    def gemm_kernels(
        self, rows: int, in_features: int, out_features: int, dtype: torch.dtype
    ) -> dict[str, float]:
        """Seconds of x [rows, in] @ w [out, in]^T with every kernel available here."""
        key = (rows, in_features, out_features, dtype)
        if key not in self._linear:
            x = torch.randn(rows, in_features, dtype=dtype, device=self.device)
            w = torch.randn(out_features, in_features, dtype=dtype, device=self.device)
            self._linear[key] = {name: self._time(fn) for name, fn in gemm_candidates(x, w).items()}
        return self._linear[key]


def gemm_candidates(x: torch.Tensor, w: torch.Tensor) -> dict[str, Callable[[], torch.Tensor]]:
    """The GEMM kernels for F.linear(x, w) on x's device: ATen's default; on the CPU oneDNN on a
    weight prepacked once (bfloat16, what the engine's Linear runs there) and MKL's packed GEMM
    (float32, packed for x's row count)."""
    kernels = {ATEN: lambda: F.linear(x, w)}
    if x.device.type == "cpu":
        if onednn_packs(w.dtype, x.device.type):
            packed = torch.ops.mkldnn._reorder_linear_weight(w, None)
            kernels[ONEDNN_PACKED] = lambda: torch.ops.mkldnn._linear_pointwise(
                x, packed, None, "none", [], ""
            )
        if w.dtype == torch.float32 and torch.backends.mkl.is_available() and len(x):
            mkl = torch.ops.mkl._mkl_reorder_linear_weight(w, len(x))
            kernels["mkl packed"] = lambda: torch.ops.mkl._mkl_linear(x, mkl, w, None, len(x))
    return kernels


def engine_kernel(layer: torch.nn.Module | None, dtype: torch.dtype, device: str) -> str:
    """The kernel the engine runs for `layer` (a Linear; None for the LM head, which runs F.linear):
    oneDNN on its packed weight where `Linear.pack_for_cpu` packs it (and `MoE.pack_for_cpu` the
    routed experts, which this table leaves aside)."""
    return ONEDNN_PACKED if isinstance(layer, Linear) and layer.packs(dtype, device) else ATEN


def engine_linears(
    model: torch.nn.Module, machine: Machine, batch: int
) -> dict[str, tuple[str, float, float]]:
    """Per kind of weight (as `Floor.parts`; the routed experts and router aside): the kernels the
    engine runs for its linears at `batch` rows, their seconds, and the best kernels' seconds."""
    head = model.lm_head
    linears = [
        (_kind(n), m, *m.weight.shape, m.weight.dtype)
        for n, m in model.named_modules()
        if isinstance(m, Linear)
    ]
    linears.append(("lm head", None, *head.shape, head.dtype))
    out: dict[str, list] = {}
    for kind, layer, out_f, in_f, dtype in linears:
        kernels = machine.gemm_kernels(batch, in_f, out_f, dtype)
        used = engine_kernel(layer, dtype, machine.device)
        entry = out.setdefault(kind, [set(), 0.0, 0.0])
        entry[0].add(used)
        entry[1] += kernels[used]
        entry[2] += min(kernels.values())
    return {kind: (", ".join(sorted(names)), used_s, best_s) for kind, (names, used_s, best_s) in out.items()}


@dataclass
class Floor:
    batch: int
    context: float  # KV tokens per request
    linear_s: float  # every linear at its own shape and rows, as timed on this machine
    attention_core_s: float  # QK^T and PV at the peak matmul rate
    bytes: int  # weights the step reads + the KV cache of every request
    bandwidth: float
    parts: dict[str, float]  # linear seconds by kind of weight

    @property
    def compute_s(self) -> float:
        return self.linear_s + self.attention_core_s

    @property
    def memory_s(self) -> float:
        return self.bytes / self.bandwidth

    @property
    def seconds(self) -> float:
        return max(self.compute_s, self.memory_s)

    @property
    def bound(self) -> str:
        return "compute" if self.compute_s >= self.memory_s else "memory"


def touched_experts(num_experts: int, top_k: int, rows: int) -> float:
    """Expected distinct experts `rows` rows route to when each picks top_k of num_experts uniformly."""
    return num_experts * (1 - (1 - top_k / num_experts) ** rows)


def _attention_core_flops(model_cfg: ModelConfig, context: float) -> float:
    """FLOPs of QK^T and PV for one query row over `context` keys, all layers."""
    hf, heads = model_cfg.hf, model_cfg.num_heads
    if model_cfg.is_mla:  # absorbed decode: scores over the latent + rope part, output in the latent
        per_head = 2 * context * (hf.kv_lora_rank + hf.qk_rope_head_dim) + 2 * context * hf.kv_lora_rank
    else:
        head_dim = getattr(hf, "head_dim", None) or model_cfg.hidden_size // heads
        per_head = 4 * context * head_dim
    return per_head * heads * model_cfg.num_layers


def _kind(name: str) -> str:
    for key in ("self_attn", "shared_experts", "mlp"):
        if f".{key}." in f".{name}":
            return {"self_attn": "attention", "shared_experts": "shared experts", "mlp": "dense MLP"}[key]
    return "other"


def decode_floor(
    model: torch.nn.Module,
    model_cfg: ModelConfig,
    machine: Machine,
    batch: int,
    context: float,
    kv_dtype: torch.dtype | None = None,
) -> Floor:
    """The floor of one decode step of `batch` requests, each attending over `context` KV tokens,
    for the engine's model `model` (built on the meta device: only its shapes are read); the KV
    pool holds `kv_dtype` (default: the machine's dtype; an 8-bit pool's scales counted)."""
    parts: Counter[str] = Counter()
    # Every parameter is read once per step except the embedding table (one row per token) and the
    # routed experts no row picks.
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    weight_bytes -= model.embed_tokens.weight.numel() * model.embed_tokens.weight.element_size()
    for name, module in model.named_modules():
        if isinstance(module, Linear):
            out_f, in_f = module.weight.shape
            parts[_kind(name)] += machine.linear_seconds(batch, in_f, out_f, module.weight.dtype)
        elif isinstance(module, MoE):
            e, hidden = module.gate.shape
            parts["router"] += machine.linear_seconds(batch, hidden, e, module.gate.dtype)
            touched = touched_experts(module.num_experts, module.top_k, batch)
            rows = max(1, round(batch * module.top_k / touched))  # rows each touched expert runs
            two_inter, inter = module.w13.shape[1], module.w2.shape[2]
            per_expert = machine.linear_seconds(rows, hidden, two_inter, module.w13.dtype)
            per_expert += machine.linear_seconds(rows, inter, hidden, module.w2.dtype)
            parts["routed experts"] += touched * per_expert
            expert_bytes = (module.w13[0].numel() + module.w2[0].numel()) * module.w13.element_size()
            weight_bytes -= round((module.num_experts - touched) * expert_bytes)
    head = model.lm_head
    parts["lm head"] += machine.linear_seconds(batch, head.shape[1], head.shape[0], head.dtype)
    kv_bytes = kv_bytes_per_token(model.kv_layers, model.kv_entry_shapes(), kv_dtype or machine.dtype)
    kv = batch * context * kv_bytes
    core = batch * _attention_core_flops(model_cfg, context) / machine.peak_flops
    return Floor(
        batch, context, sum(parts.values()), core, int(weight_bytes + kv), machine.bandwidth, dict(parts)
    )


def engine_model(
    model_path: str, dtype: str, device: str = "cpu"
) -> tuple[torch.nn.Module, ModelConfig, torch.dtype]:
    """The engine's model at tp=1 on the meta device (shapes only, no memory), its model config and
    the engine config (dtype and device resolved)."""
    from dpserve.plan.layouts import meta_model  # the planner's builder: the same model a started engine runs
    from dpserve.plan.model import load

    path, model_cfg = load(model_path)  # also resolves the embedded model and GGUF files
    cfg = EngineConfig(model_path=path, dtype=dtype, device=device)
    return meta_model(model_cfg, cfg), model_cfg, cfg
