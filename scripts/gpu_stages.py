"""The stages of scripts/gpu_check.py, cheapest first. Each runs in its own process, on the GPU
(`Scale.gpu`: DeepSeek-V3's per-rank shapes, bfloat16 where that is what serving runs) or as its
CPU variant (`Scale.cpu`: tiny shapes, Triton's interpreter, gloo), which the test suite runs so
that the script cannot rot between GPU runs. A stage returns its figures (one line) and raises
`StageFailed` with them when a check fails; its progress goes to stdout as it runs."""

from __future__ import annotations

import functools
import json
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

GREEDY = {"temperature": 0.0, "ignore_eos": True}
KV_TOKENS = 8192  # every engine's KV pool: enough for the stage, nothing like the whole GPU


class StageFailed(Exception):
    pass


@dataclass(frozen=True)
class Scale:
    device: str
    mla_heads: tuple[int, ...]  # query heads per latent (attention TP 1 of V2-Lite, V2, V3)
    decode_lens: tuple[int, ...]
    extend_lens: tuple[tuple[int, int], ...]  # (KV tokens, new tokens) per request
    moe: tuple[tuple[str, int, int], ...]  # (label, experts, intermediate rows) per rank
    hidden: int
    moe_rows: int
    kernel_dtype: torch.dtype
    batch: int  # the large decode batch of the engine stages
    served: str  # model of the serving and one_batch stages: bundled config name or tiny arch
    min_served_ratio: float  # dpserve's served throughput over transformers' at least
    served_tokens: int  # output tokens per request of the serving stage

    @property
    def tol(self) -> float:
        return 3e-2 if self.kernel_dtype == torch.bfloat16 else 2e-3


GPU = Scale(
    "cuda",
    (16, 40, 128),
    (700, 37, 4096, 5, 16384),
    ((2048, 2048), (600, 100), (129, 1)),
    (("EP16", 16, 2048), ("TP16", 256, 128)),  # V3 over 16 ranks: 16 whole experts, or 256 of 128 rows
    7168,
    512,
    torch.bfloat16,
    64,
    "smollm2-135m",
    1.0,
    64,
)
CPU = Scale(
    "cpu",
    (16, 40),
    (37, 5, 70),
    ((24, 24), (30, 9), (9, 1)),
    (("EP", 8, 64), ("TP", 32, 16)),
    128,
    16,
    torch.float32,
    8,
    "llama",
    0.0,  # tiny models on two cores: the ratio is printed, not judged
    16,
)


def expect(ok: bool, failures: list[str], what: str) -> None:
    if not ok:
        failures.append(what)


def finish(failures: list[str], figures: list[str]) -> str:
    line = "; ".join(figures)
    if failures:
        raise StageFailed(f"{', '.join(failures)} | {line}")
    return line


def log(text: str) -> None:
    print(f"    {text}", flush=True)


# ---------------------------------------------------------------------------------------------- startup


def startup(scale: Scale) -> str:
    """The GPUs this process sees, the versions, and the fork server's preload leaving CUDA alone."""
    import transformers

    from dpserve.engine.worker_pool import FORKSERVER_PRELOAD

    probe = f"import importlib, torch\nfor m in {FORKSERVER_PRELOAD!r}: importlib.import_module(m)\n"
    probe += "print(torch.cuda.is_initialized())"
    preload = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True)
    figures = [f"torch {torch.__version__}, transformers {transformers.__version__}"]
    failures: list[str] = []
    if scale.device == "cuda":
        import triton

        n = torch.cuda.device_count()
        figures.append(f"{n} x {torch.cuda.get_device_name()}, triton {triton.__version__}")
        expect(n > 0, failures, "no GPU visible")
    expect(preload.stdout.strip() == "False", failures, f"the preload initialised CUDA: {preload.stdout}")
    figures.append("fork-server preload leaves CUDA uninitialised")
    return finish(failures, figures)


# ---------------------------------------------------------------------------------------------- kernels


def attention_meta(seq_lens: list[int], q_lens: list[int], device: str):
    from dpserve.attention.backend import AttentionMetadata

    slots = torch.randperm(sum(seq_lens)) + 1  # slot 0: padding
    table = torch.zeros(len(seq_lens) + 1, max(seq_lens), dtype=torch.int32)
    used = 0
    for b, n in enumerate(seq_lens):
        table[b + 1, :n] = slots[used : used + n]
        used += n
    meta = AttentionMetadata(
        req_to_token=table.to(device),
        table_rows=torch.arange(1, len(seq_lens) + 1, dtype=torch.int32, device=device),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
        q_start=torch.tensor([0, *q_lens], device=device).cumsum(0).to(torch.int32),
        num_tokens=sum(q_lens),
        max_q_len=max(q_lens),
        max_seq_len=max(seq_lens),
        q_lens_host=list(q_lens),
        seq_lens_host=list(seq_lens),
    )
    return meta, sum(seq_lens) + 1


def attention_error(
    kind: str, meta, slots: int, scale: Scale, cache_dtype: torch.dtype | None = None
) -> float:
    """Triton's output against the sdpa backend's on the same inputs (max abs error); with
    `cache_dtype`, the caches written to an 8-bit pool of it first (both read its codes and scales)."""
    from dpserve.attention.backend import AttentionMetadata
    from dpserve.attention.sdpa import SdpaBackend
    from dpserve.attention.triton_backend import TritonBackend
    from dpserve.kvcache.pool import KVPool

    dev, dtype = scale.device, scale.kernel_dtype
    window, sinks = 0, None
    if kind == "gqa":
        q = torch.randn(meta.num_tokens, 32, 128, device=dev, dtype=dtype)
        k, v = (torch.randn(slots, 8, 128, device=dev, dtype=dtype) for _ in range(2))
    elif kind == "gpt-oss":  # 64 heads of 64 on 8 KV heads, a 128-token window, attention sinks
        q = torch.randn(meta.num_tokens, 64, 64, device=dev, dtype=dtype)
        k, v = (torch.randn(slots, 8, 64, device=dev, dtype=dtype) for _ in range(2))
        window, sinks = 128, torch.randn(64, device=dev, dtype=dtype)
    else:
        q = torch.randn(meta.num_tokens, int(kind), 576, device=dev, dtype=dtype)
        cache = torch.randn(slots, 576, device=dev, dtype=dtype)
    if cache_dtype is not None:
        values = [k, v] if kind in ("gqa", "gpt-oss") else [cache]
        pool = KVPool(
            1,
            slots - 1,
            [tuple(x.shape[1:]) for x in values],
            dtype,
            torch.device(dev),
            cache_dtype=cache_dtype,
        )
        pool.write(0, torch.arange(slots, device=dev), *values)
        if kind in ("gqa", "gpt-oss"):
            k, v = pool.layers[0]
        else:
            [cache] = pool.layers[0]
    outs = []
    for backend in (SdpaBackend(), TritonBackend()):
        m = AttentionMetadata(**{**meta.__dict__, "state": {}})
        backend.prepare(m)
        if kind in ("gqa", "gpt-oss"):
            out = backend.gqa(q, k, v, m, 0.088, window, sinks)
        else:
            out = backend.mla(q, cache, m, 576**-0.5, 512)
        outs.append(out.float())
    return (outs[0] - outs[1]).abs().max().item()


def index_error(meta, slots: int, scale: Scale) -> float:
    """DeepSeek-V3.2's indexer scores (64 heads of 128), Triton against torch, relative to the largest
    score, over 256 queries at a time (the torch path gathers every key per query); the -inf pattern
    (causal, lengths) must be equal."""
    from dpserve.attention.sdpa import SdpaBackend
    from dpserve.attention.triton_backend import TritonBackend
    from dpserve.models.dsa import sparse_layout

    dev = scale.device
    table, token_req, q_pos = sparse_layout(meta)
    q = torch.randn(meta.num_tokens, 64, 128, device=dev)
    weights = torch.randn(meta.num_tokens, 64, device=dev) / 8
    keys = torch.randn(slots, 128, device=dev, dtype=scale.kernel_dtype)
    worst = 0.0
    for lo in range(0, meta.num_tokens, 256):
        rows = slice(lo, lo + 256)
        args = (q[rows], weights[rows], keys, table, token_req[rows], q_pos[rows], meta.seq_lens, 128**-0.5)
        ref, got = SdpaBackend().index_scores(*args), TritonBackend().index_scores(*args)
        if not torch.equal(torch.isinf(ref), torch.isinf(got)):
            return float("inf")
        finite = torch.isfinite(ref)
        worst = max(worst, ((got - ref)[finite].abs().max() / ref[finite].abs().max()).item())
    return worst


def kernels(scale: Scale) -> str:
    """Triton attention (MLA 512+64 at every heads-per-latent of the DeepSeek family, GQA, gpt-oss's
    windows and sinks; decode and extend; an 8-bit KV cache in both FP8 formats), DeepSeek-V3.2's indexer scores, and the fused MoE (per-rank expert shapes of V3) against the torch paths."""
    from dpserve.layers.fused_moe import fused_experts
    from dpserve.layers.mlp import experts_loop, swiglu_clamped

    torch.manual_seed(0)
    dev, failures, figures = scale.device, [], []
    decode = list(scale.decode_lens), [1] * len(scale.decode_lens)
    extend = [s for s, _ in scale.extend_lens], [q for _, q in scale.extend_lens]
    for step, (seq_lens, q_lens) in (("decode", decode), ("extend", extend)):
        meta, slots = attention_meta(seq_lens, q_lens, dev)
        kinds = (*map(str, scale.mla_heads), "gqa", "gpt-oss")
        errors = {k: attention_error(k, meta, slots, scale) for k in kinds}
        # --kv-cache-dtype: the kernels widen FP8 codes in place (integer ops: sm80 as well)
        errors |= {
            f"{k}-{name}": attention_error(k, meta, slots, scale, dtype)
            for k in (str(scale.mla_heads[-1]), "gqa")
            for name, dtype in (("e4m3", torch.float8_e4m3fn), ("e5m2", torch.float8_e5m2))
        }
        worst = max(errors.values())
        expect(worst < scale.tol, failures, f"{step} attention error {worst:.2e}")
        figures.append(f"{step} " + " ".join(f"{k}:{e:.1e}" for k, e in errors.items()))
        log(figures[-1])
        err = index_error(meta, slots, scale)
        expect(err < scale.tol, failures, f"{step} V3.2 indexer error {err:.2e}")
        figures.append(f"{step} V3.2 indexer: {err:.1e}")
        log(figures[-1])
    hidden, rows, top_k = scale.hidden, scale.moe_rows, 8
    for label, experts, inter in scale.moe:
        x = torch.randn(rows, hidden, device=dev, dtype=scale.kernel_dtype)
        w13 = torch.randn(experts, 2 * inter, hidden, device=dev, dtype=x.dtype) / hidden**0.5
        w2 = torch.randn(experts, hidden, inter, device=dev, dtype=x.dtype) / inter**0.5
        weights = torch.rand(rows, top_k, device=dev)
        # Of 256 experts, those of other ranks fall outside [0, experts) and are skipped (EP).
        ids = torch.stack([torch.randperm(max(256, experts), device=dev)[:top_k] for _ in range(rows)])
        ids = torch.where(ids < experts, ids, -1)
        ref = experts_loop(x.float(), w13.float(), w2.float(), weights, ids)
        err = ((fused_experts(x, w13, w2, weights, ids).float() - ref).abs().max() / ref.abs().max()).item()
        expect(err < scale.tol, failures, f"fused MoE {label} error {err:.2e}")
        figures.append(f"MoE {label} {experts}x{inter}: {err:.1e}")
        log(figures[-1])
    # gpt-oss's experts: biases on both products and the clamped SwiGLU, on the last shapes.
    b13 = torch.randn(experts, 2 * inter, device=dev, dtype=x.dtype)
    b2 = torch.randn(experts, hidden, device=dev, dtype=x.dtype)
    act = functools.partial(swiglu_clamped, alpha=1.702, limit=7.0)
    ref = experts_loop(
        x.float(), w13.float(), w2.float(), weights, ids, F.linear, act, b13.float(), b2.float()
    )
    got = fused_experts(x, w13, w2, weights, ids, b13=b13, b2=b2, clamp=(1.702, 7.0))
    err = ((got.float() - ref).abs().max() / ref.abs().max()).item()
    expect(err < scale.tol, failures, f"fused MoE with biases and clamped SwiGLU error {err:.2e}")
    figures.append(f"MoE gpt-oss biases + clamped SwiGLU: {err:.1e}")
    log(figures[-1])
    figures += quantized_errors(scale, failures)
    return finish(failures, figures)


def quantized_errors(scale: Scale, failures: list[str]) -> list[str]:
    """8-bit weights (block FP8 in 128 x 128 blocks, W8A8-INT8) through the Triton GEMM and fused
    MoE, activations in the kernels' dtype, against their plain forms (`quant.fp8_linear`,
    `quant.int8_linear`) in float32, on the per-rank shapes of the last MoE case, each weight's part
    starting inside a block (a TP split); and, where the GPU has FP8 dots, DeepSeek's w8a8 recipe
    (parts whose columns start on a block boundary) against the plain form of its FP8 activations."""
    from dpserve.layers.fused_moe import fused_experts
    from dpserve.layers.mlp import experts_loop
    from dpserve.layers.quant import (
        PER_ROW,
        QuantizedWeight,
        QuantSpec,
        fp8_dots,
        fp8_linear,
        int8_linear,
        quantize,
        quantize_groups_fp8,
    )
    from dpserve.layers.quant_triton import linear

    def plain(x, w, bias=None):
        """The CPU's forms; under FP8 dots on x as its FP8 codes per group give it back."""
        if w.q.dtype == torch.int8:
            return int8_linear(x, w.q, w.scale[w.row_block, 0], bias)
        if w.group:
            codes, scales = quantize_groups_fp8(x, w.group)
            x = (codes.float() * scales.repeat_interleave(w.group, 1)[:, : x.shape[1]]).to(x.dtype)
        return fp8_linear(x, w, bias)

    def part(
        w: torch.Tensor, spec: QuantSpec, first_col: int, rows: int, cols: int, group: int
    ) -> QuantizedWeight:
        """`rows` x `cols` of `w` ([rows, cols], or one per expert) from row 3 and column
        `first_col`, with the scales of every block."""
        qs = [quantize(e, spec) for e in (w if w.dim() == 3 else w[None])]
        q = torch.stack([a for a, _ in qs])[:, 3 : 3 + rows, first_col : first_col + cols].contiguous()
        s = torch.stack([b for _, b in qs])
        row_ids = torch.arange(3, 3 + rows, device=w.device)
        col_ids = torch.arange(first_col, first_col + cols, device=w.device)
        col_block = col_ids // spec.block[1] if spec.block[1] != PER_ROW else torch.zeros_like(col_ids)
        if w.dim() == 2:
            q, s = q[0], s[0]
        return QuantizedWeight(q, s, row_ids // spec.block[0], col_block, group)

    dev, out = scale.device, []
    _, experts, inter = scale.moe[-1]
    hidden, rows, top_k = scale.hidden, scale.moe_rows, min(8, experts)
    fp8, int8 = QuantSpec("fp8", (128, 128)), QuantSpec("w8a8_int8", (1, PER_ROW))
    cases = [("fp8", fp8, 5, 0), ("int8", int8, 5, 0)]
    if dev == "cpu" or fp8_dots(torch.device(dev)):
        cases.append(("fp8 dots", fp8, 0, 128))
    for name, spec, first_col, group in cases:
        g = torch.Generator(device=dev).manual_seed(0)
        x = torch.randn(rows, hidden, device=dev, generator=g).to(scale.kernel_dtype)
        w = torch.randn(2 * inter + 5, hidden + 5, device=dev, generator=g)
        lin = part(w, spec, first_col, 2 * inter, hidden, group)
        ref = plain(x.float(), lin)
        err = ((linear(x, lin).float() - ref).abs().max() / ref.abs().max()).item()
        w13 = torch.randn(experts, 2 * inter + 5, hidden + 5, device=dev, generator=g) / hidden**0.5
        w2 = torch.randn(experts, hidden + 5, inter + 5, device=dev, generator=g) / inter**0.5
        w13 = part(w13, spec, first_col, 2 * inter, hidden, group)
        w2 = part(w2, spec, first_col, hidden, inter, group)
        weights = torch.rand(rows, top_k, device=dev, generator=g)
        ids = torch.stack([torch.randperm(experts, device=dev, generator=g)[:top_k] for _ in range(rows)])
        ref = experts_loop(x.float(), w13, w2, weights, ids, plain)
        moe = ((fused_experts(x, w13, w2, weights, ids).float() - ref).abs().max() / ref.abs().max()).item()
        expect(max(err, moe) < scale.tol, failures, f"{name} weights error GEMM {err:.2e} MoE {moe:.2e}")
        out.append(f"{name} weights GEMM {err:.1e} MoE {moe:.1e}")
        log(out[-1])
    return out


# ---------------------------------------------------------------------------------------------- engines


def tiny_model(arch: str, tmp: str) -> str:
    from dpserve.testing.tiny_models import write_tiny_model

    return str(write_tiny_model(arch, Path(tmp) / arch))


def prompts(n: int, length: int = 24) -> list[list[int]]:
    return [[3 + (7 * b + 3 * i) % 290 for i in range(length + 5 * b % 17)] for b in range(n)]


def run(engine, batch: int, new_tokens: int = 16) -> tuple[list[list[int]], float, list]:
    """Greedy outputs of `batch` requests, the median full-batch decode step, the step log."""
    engine.get_step_log()
    out = engine.generate(input_ids=prompts(batch), sampling_params={**GREEDY, "max_new_tokens": new_tokens})
    steps = engine.get_step_log()[0]
    full = [s.seconds for s in steps if s.kind == "decode" and s.real_rows == batch] or [float("nan")]
    return [o["output_ids"] for o in out], statistics.median(full), steps


def compare(scale: Scale, path: str, variants: dict[str, dict], common: dict, batch: int = 0) -> str:
    """Every variant's greedy outputs (batch 1 and the large batch) against the first variant's."""
    from dpserve import Engine

    batch = batch or scale.batch
    outputs, figures = {}, []
    for label, kwargs in variants.items():
        start = time.perf_counter()
        options = {"device": scale.device, "max_total_tokens": KV_TOKENS, **common, **kwargs}
        with Engine(model_path=path, **options) as engine:
            started = time.perf_counter() - start
            one, one_s, _ = run(engine, 1)
            many, many_s, steps = run(engine, batch)
        padded = sum(s.padded for s in steps if s.kind == "decode")
        outputs[label] = one + many
        figures.append(
            f"{label}: start {started:.1f} s, step {one_s * 1e3:.2f}/{many_s * 1e3:.2f} ms "
            f"(bs 1/{batch}), {padded} padded"
        )
        log(figures[-1])
    first = next(iter(outputs))
    differ = [label for label, out in outputs.items() if out != outputs[first]]
    return finish([f"{', '.join(differ)} differ from {first}"] if differ else [], figures)


def graphs(scale: Scale) -> str:
    """Tiny DeepSeek-V3 at tp 1: decode graphs (padded steps on the CPU) in every padding mode give
    the eager engine's greedy tokens; tiny gpt-oss's graphs with its window layers in the hybrid pool
    (their own slots and table, static buffers of the graphs), against eager steps."""
    variants = {"eager": {"disable_cuda_graph": True}}
    variants |= {mode: {"dp_padding_mode": mode} for mode in ("sum_len", "max_len", "auto")}
    with tempfile.TemporaryDirectory() as tmp:
        common = {"tp_size": 1, "dtype": "float32", "cuda_graph_max_bs": 16}
        line = compare(scale, tiny_model("deepseek_v3", tmp), variants, common)
        if scale.device != "cuda":  # padded steps on the CPU: tests/test_swa.py runs the hybrid pool
            return line
        hybrid = {"gpt-oss eager": {"disable_cuda_graph": True}, "gpt-oss graphs": {}}
        window = {**common, "max_running_requests": scale.batch, "swa_full_tokens_ratio": 0.1}
        return f"{line}; {compare(scale, tiny_model('gpt_oss', tmp), hybrid, window)}"


def compile_stage(scale: Scale) -> str:
    """torch.compile'd decode buckets (captured after compiling on the GPU) against eager steps."""
    variants = {"eager": {"disable_cuda_graph": True}, "compiled": {"enable_torch_compile": True}}
    batch = min(scale.batch, 8)
    # The GPU compiles two buckets (the check is the capture, not the size); the CPU variant one,
    # the large batch running eagerly past it (tests/test_compile.py compiles more on the CPU).
    buckets = [1, batch] if scale.device == "cuda" else [1]
    with tempfile.TemporaryDirectory() as tmp:
        common = {
            "tp_size": 1,
            "dtype": "float32",
            "cuda_graph_bs": buckets,
            "torch_compile_max_bs": buckets[-1],
        }
        return compare(scale, tiny_model("deepseek_v3", tmp), variants, common, batch)


def nextn(scale: Scale) -> str:
    """NEXTN on the tiny DeepSeek-V3 trained with its MTP layer (about 10 s on the CPU, cached):
    greedy outputs identical to no speculation, drafts mostly accepted, and the MTP forwards padded
    (captured graphs on the GPU) draft what eager unpadded ones draft: every request verifies as many
    steps in both."""
    from dpserve import Engine
    from dpserve.testing.trained_mtp import synthetic_sequences, trained_mtp_model

    nextn2 = {"speculative_algorithm": "NEXTN", "speculative_num_steps": 2}
    variants = {"plain": {}, "NEXTN 2 eager": {**nextn2, "disable_cuda_graph": True}, "NEXTN 2": nextn2}
    # Buckets up to 3 rows per request: verify steps and their draft extends pad too.
    buckets = [1, 2, 4, 8, 3 * scale.batch]
    common = {"tp_size": 1, "dtype": "float32", "cuda_graph_bs": buckets, "max_total_tokens": KV_TOKENS}
    path = str(trained_mtp_model())
    held_out = [synthetic_sequences(1, 8 + 5 * (i % 8), seed=200 + i)[0] for i in range(scale.batch)]
    outputs, verify_steps, failures, figures = {}, {}, [], []
    for label, kwargs in variants.items():
        with Engine(model_path=path, device=scale.device, **common, **kwargs) as engine:
            engine.get_step_log()
            out = engine.generate(input_ids=held_out, sampling_params={**GREEDY, "max_new_tokens": 16})
            steps = engine.get_step_log()[0]
        outputs[label] = [o["output_ids"] for o in out]
        verify_steps[label] = [o["meta_info"].get("spec_verify_ct", 0) for o in out]
        figures.append(
            f"{label}: {sum(s.padded for s in steps)} padded steps, "
            f"{sum(s.draft_padded for s in steps)} padded MTP forwards, "
            f"{sum(verify_steps[label])} verify steps"
        )
        log(figures[-1])
    expect(all(out == outputs["plain"] for out in outputs.values()), failures, "outputs differ from plain")
    expect(verify_steps["NEXTN 2"] == verify_steps["NEXTN 2 eager"], failures, "padded drafts differ")
    # 15 tokens after the first, each verify step at least one: mostly accepted drafts halve them.
    expect(sum(verify_steps["NEXTN 2"]) < 10 * len(held_out), failures, "drafts mostly rejected")
    expect(" 0 padded MTP" not in figures[2], failures, "no MTP forward ran padded")
    return finish(failures, figures)


def served_model(scale: Scale, tmp: str) -> str:
    from dpserve.testing.tiny_models import write_random_model

    if scale.served in ("llama", "deepseek_v3"):
        return tiny_model(scale.served, tmp)
    # Random weights with the real architecture: throughput does not depend on the values.
    return str(write_random_model(scale.served, Path(tmp) / scale.served, dtype=torch.bfloat16))


def serving(scale: Scale) -> str:
    """The HTTP server against transformers' generate on the same device, same prompts and lengths."""
    from dpserve.bench import serving as bench
    from dpserve.testing.server import ServerProcess

    dtype = "bfloat16" if scale.device == "cuda" else "float32"
    prompts_n = 4 * scale.batch
    with tempfile.TemporaryDirectory() as tmp:
        path = served_model(scale, tmp)
        server_args = ["--model-path", path, "--tp", "1", "--dtype", dtype, "--device", scale.device]
        server_args += ["--max-total-tokens", str(KV_TOKENS * 4), "--cuda-graph-max-bs", str(scale.batch)]
        with ServerProcess(*server_args) as server:
            bench.main(
                [
                    *("--base-url", server.url, "--model-path", path, "--num-prompts", str(prompts_n)),
                    *("--random-input-len", "128", "--random-output-len", str(scale.served_tokens)),
                    *("--seed", "0"),
                    *("--max-concurrency", str(scale.batch), "--baseline", "transformers"),
                    *("--baseline-dtype", dtype, "--baseline-device", scale.device),
                    *("--output-file", f"{tmp}/result.json", "--disable-tqdm"),
                ]
            )
        r = json.loads(Path(f"{tmp}/result.json").read_text().splitlines()[-1])
    ratio, completed = r["output_throughput_ratio"], r["completed"]
    figures = [
        f"{scale.served}: {r['output_throughput']:.0f} vs transformers "
        f"{r['baseline']['output_throughput']:.0f} output tok/s ({ratio:.2f}x), "
        f"{completed}/{prompts_n} requests, TTFT p50 {r['median_ttft_ms']:.0f} ms"
    ]
    failures = []
    expect(completed == prompts_n, failures, f"{prompts_n - completed} requests failed")
    expect(ratio >= scale.min_served_ratio, failures, f"slower than transformers ({ratio:.2f}x)")
    return finish(failures, figures)


def one_batch(scale: Scale) -> str:
    """bench.one_batch at tp 1, batch 1 and the large batch: decode steps against the measured floor."""
    from dpserve.bench import one_batch as bench

    dtype = "bfloat16" if scale.device == "cuda" else "float32"
    with tempfile.TemporaryDirectory() as tmp:
        path = served_model(scale, tmp)
        bench.main(
            [
                *("--model-path", path, "--tp", "1", "--dtype", dtype, "--device", scale.device),
                *("--batch-size", "1", str(scale.batch), "--input-len", "256", "--output-len", "16"),
                *("--max-total-tokens", str(KV_TOKENS * 4), "--result-file", f"{tmp}/r.jsonl"),
            ]
        )
        results = [json.loads(line) for line in Path(f"{tmp}/r.jsonl").read_text().splitlines()]
    figures = [
        f"bs {r['batch_size']}: {r['median_decode_latency'] * 1e3:.2f} ms/step, "
        f"{r['median_decode_latency'] / r['floor_latency']:.1f}x the floor {r['floor_latency'] * 1e3:.3f} ms"
        for r in results
    ]
    return finish([], figures)


# ---------------------------------------------------------------------------------------- two GPUs+

DP_ATTENTION = {"tp_size": 2, "dp_size": 2, "enable_dp_attention": True, "dtype": "float32"}


def tp2_dp2(scale: Scale) -> str:
    """tp=2 dp=2 DP attention: decode graphs over NCCL (gloo on the CPU) against eager steps."""
    variants = {"eager": {"disable_cuda_graph": True}, "graphs": {}}
    with tempfile.TemporaryDirectory() as tmp:
        common = DP_ATTENTION | {"cuda_graph_max_bs": 16}
        return compare(scale, tiny_model("deepseek_v2", tmp), variants, common)


def padding(scale: Scale) -> str:
    """bench.padding at (2, 2): sum_len, max_len and auto at batch 1 and the large batch."""
    import argparse

    from dpserve.bench import padding as bench

    with tempfile.TemporaryDirectory() as tmp:
        model = tiny_model("deepseek_v2_mid" if scale.device == "cuda" else "deepseek_v2", tmp)
        args = bench.parse_args(["--layouts", "2,2", "--batch-sizes", "1", str(scale.batch)])
        args = argparse.Namespace(**{**vars(args), "device": scale.device, "rounds": 1, "decode_steps": 6})
        results = bench.sweep(args, model)
    bench.add_ratios(results)
    print(bench.table(results), flush=True)
    figures = [
        f"bs {r['batch']} {r['spread']}: {r['latency_ms']:.2f} ms, {r['ratio_vs_best_fixed']:.2f}x best fixed"
        for r in results
        if r["mode"] == "auto"
    ]
    unpadded = [r for r in results if r["padded_steps"] < r["steps"]]
    return finish([f"{len(unpadded)} points ran unpadded steps"] if unpadded else [], figures)


def expert_parallel(scale: Scale) -> str:
    """TP MoE, EP with `none` and with `all_to_all` dispatch (its fixed-capacity exchange inside the
    decode graphs) at (2, 2) on the tiny DeepSeek-V3: the same greedy tokens."""
    variants = {
        "TP MoE": {},
        "EP none": {"ep_size": 2},
        "EP all_to_all": {"ep_size": 2, "moe_a2a_backend": "all_to_all"},
    }
    with tempfile.TemporaryDirectory() as tmp:
        common = DP_ATTENTION | {"cuda_graph_max_bs": 16, "dp_padding_mode": "sum_len"}
        return compare(scale, tiny_model("deepseek_v3", tmp), variants, common)


@dataclass(frozen=True)
class Stage:
    name: str
    run: Callable[[Scale], str]
    timeout_s: int  # on the GPU, start-up included (one GPU: 300 s in all); the CPU variants get more
    gpus: int = 1


STAGES = (
    Stage("startup", startup, 20),
    Stage("kernels", kernels, 45),
    Stage("graphs", graphs, 55),
    Stage("compile", compile_stage, 50),
    Stage("nextn", nextn, 45),
    Stage("serving", serving, 45),
    Stage("one_batch", one_batch, 40),
    Stage("tp2_dp2", tp2_dp2, 45, gpus=2),
    Stage("padding", padding, 60, gpus=2),
    Stage("expert_parallel", expert_parallel, 60, gpus=2),
)
