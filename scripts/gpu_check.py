"""What only a GPU can check, in one run on one GPU (tp=1: NCCL needs one GPU per rank). The CPU test
suite covers the rest, including these kernels in Triton's interpreter. Prints one summary line last.

1. Kernels compiled for the GPU: Triton paged attention (MLA at DeepSeek's dims, GQA; decode and
   extend) against the sdpa backend on the same device, and the fused MoE against the expert loop.
2. Engines in bfloat16, tiny DeepseekV2 (written here) and SmolLM2 (if its GGUF is installed):
   CUDA graphs vs --disable-cuda-graph (same greedy tokens, decode step time), triton vs sdpa
   attention, the memory sizing (weights, activation peak, KV pool), decode tokens/s at batch 1-64.
3. NEXTN speculative decoding on the trained tiny DeepSeek-V3 (6 layers; verify steps replay the
   decode graphs, one row per token): greedy outputs identical with and without drafts, accept
   length, decode speed-up at batch 1.
4. Expert parallelism over NCCL at (tp, dp) = (2,2) (two GPUs: NCCL takes one per rank; skipped on one):
   --ep-size 2 with --moe-a2a-backend none and all_to_all, decode graphs captured (all_to_all's
   fixed-capacity dispatch inside them), greedy outputs equal to TP MoE's (float32), and the bytes
   each rank counted per step (graph replays included) equal to the planner's.
5. DeepSeek-V3's per-rank shapes: MLA attention with 128 heads (attention TP 1) at the launch
   `launch_config` picks for this GPU, and the fused MoE (EP 16: 16 whole experts; TP 16: 256
   experts of 128) against the torch paths; the MoE layer's peak memory on 32,768 gathered rows
   (dp 16 x 2,048) against the rows x top_k x hidden buffer it no longer makes.
6. The start-up activation peak each engine measures against the planner's estimate.
7. tp=2 dp=2 with DP attention on two GPUs (NCCL; skipped, saying so, on one): CUDA graphs over NCCL
   give the same greedy tokens as eager steps.

    bash scripts/gpu_check.sh
"""

from __future__ import annotations

import statistics
import sys
import tempfile
import time

import torch

from dpserve import Engine
from dpserve.attention.backend import AttentionMetadata
from dpserve.attention.sdpa import SdpaBackend
from dpserve.attention.triton_backend import TritonBackend
from dpserve.layers.fused_moe import fused_experts
from dpserve.plan.comm import forward_bytes, logged_layout
from dpserve.plan.layouts import meta_model
from dpserve.testing.tiny_models import write_tiny_model

DEV = torch.device("cuda")
results: dict[str, str] = {}
failures: list[str] = []


def check(name: str, ok: bool, detail: str) -> None:
    results[name] = ("ok " if ok else "FAIL ") + detail
    print(f"{name}: {results[name]}", flush=True)
    if not ok:
        failures.append(name)


def attention_meta(seq_lens: list[int], q_lens: list[int]) -> tuple[AttentionMetadata, int]:
    slots = torch.randperm(sum(seq_lens)) + 1  # slot 0: padding
    table = torch.zeros(len(seq_lens) + 1, max(seq_lens), dtype=torch.int32)
    used = 0
    for b, n in enumerate(seq_lens):
        table[b + 1, :n] = slots[used : used + n]
        used += n
    meta = AttentionMetadata(
        req_to_token=table.to(DEV),
        req_idx=torch.arange(1, len(seq_lens) + 1, dtype=torch.int32, device=DEV),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=DEV),
        q_start=torch.tensor([0, *q_lens], device=DEV).cumsum(0).to(torch.int32),
        num_tokens=sum(q_lens),
        max_q_len=max(q_lens),
        max_seq_len=max(seq_lens),
    )
    return meta, sum(seq_lens) + 1


def kernels() -> None:
    torch.manual_seed(0)
    for name, seq_lens, q_lens in (
        ("decode", [700, 37, 2048, 5], [1, 1, 1, 1]),
        ("extend", [300, 64, 129], [300, 20, 1]),
    ):
        for dtype, tol in ((torch.float32, 1e-3), (torch.bfloat16, 3e-2)):
            meta, slots = attention_meta(seq_lens, q_lens)
            mla_cache = torch.randn(slots, 576, device=DEV, dtype=dtype)
            mla_q = torch.randn(meta.num_tokens, 16, 576, device=DEV, dtype=dtype)
            k, v = (torch.randn(slots, 8, 128, device=DEV, dtype=dtype) for _ in range(2))
            gqa_q = torch.randn(meta.num_tokens, 32, 128, device=DEV, dtype=dtype)
            outs = []
            for backend in (SdpaBackend(), TritonBackend()):
                m = AttentionMetadata(**{**meta.__dict__, "state": {}})
                backend.prepare(m)
                outs.append(
                    (backend.mla(mla_q, mla_cache, m, 576**-0.5, 512), backend.gqa(gqa_q, k, v, m, 0.088))
                )
            err = max((a.float() - b.float()).abs().max().item() for a, b in zip(*outs, strict=True))
            check(f"attention {name} {str(dtype)[6:]}", err < tol, f"max error {err:.2e}")
    rows, experts, top_k, hidden, inter = 96, 64, 6, 1024, 256
    x = torch.randn(rows, hidden, device=DEV, dtype=torch.bfloat16)
    w13 = torch.randn(experts, 2 * inter, hidden, device=DEV, dtype=torch.bfloat16) / hidden**0.5
    w2 = torch.randn(experts, hidden, inter, device=DEV, dtype=torch.bfloat16) / inter**0.5
    weights = torch.rand(rows, top_k, device=DEV)
    ids = torch.stack([torch.randperm(experts, device=DEV)[:top_k] for _ in range(rows)])
    ref = torch.zeros(rows, hidden, device=DEV, dtype=torch.float32)
    for e in ids.unique().tolist():
        r, slot = torch.where(ids == e)
        gate, up = (x[r].float() @ w13[e].float().t()).chunk(2, dim=-1)
        ref.index_add_(
            0, r, (torch.nn.functional.silu(gate) * up) @ w2[e].float().t() * weights[r, slot, None]
        )
    got = fused_experts(x, w13, w2, weights, ids).float()
    err = ((got - ref).abs().max() / ref.abs().max()).item()
    check("fused MoE bf16", err < 3e-2, f"relative error {err:.2e}")


def v3_shapes() -> None:
    """Kernels at DeepSeek-V3's per-rank shapes against the torch paths (bfloat16)."""
    from types import SimpleNamespace

    from dpserve.attention.triton_kernels import launch_config
    from dpserve.layers.mlp import MoE, experts_loop

    torch.manual_seed(0)
    for name, seq_lens, q_lens in (
        ("decode bs64", [4096] * 32 + [300] * 32, [1] * 64),
        ("decode bs1", [16384], [1]),
        ("extend", [2048, 600], [2048, 100]),
    ):
        meta, slots = attention_meta(seq_lens, q_lens)
        cache = torch.randn(slots, 576, device=DEV, dtype=torch.bfloat16)
        q = torch.randn(meta.num_tokens, 128, 576, device=DEV, dtype=torch.bfloat16)
        outs = []
        for backend in (SdpaBackend(), TritonBackend()):
            m = AttentionMetadata(**{**meta.__dict__, "state": {}})
            backend.prepare(m)
            outs.append(backend.mla(q, cache, m, 576**-0.5, 512).float())
        err = (outs[0] - outs[1]).abs().max().item()
        kind = "decode" if max(q_lens) == 1 else "extend"
        launch = launch_config(
            kind,
            batch=len(seq_lens),
            heads=128,
            kv_heads=1,
            lk=576,
            max_seq_len=max(seq_lens),
            max_q_len=max(q_lens),
        )
        check(f"V3 MLA {name}", err < 3e-2, f"max error {err:.2e}, grid {launch.grid}")
    hidden, top_k = 7168, 8
    for label, experts, inter in (("EP16", 16, 2048), ("TP16", 256, 128)):
        rows = 512
        x = torch.randn(rows, hidden, device=DEV, dtype=torch.bfloat16)
        w13 = torch.randn(experts, 2 * inter, hidden, device=DEV, dtype=torch.bfloat16) / hidden**0.5
        w2 = torch.randn(experts, hidden, inter, device=DEV, dtype=torch.bfloat16) / inter**0.5
        weights = torch.rand(rows, top_k, device=DEV)
        # EP: of 256 experts, the ones on other ranks fall outside [0, 16) and are skipped.
        ids = torch.stack([torch.randperm(256, device=DEV)[:top_k] for _ in range(rows)])
        ids = torch.where(ids < experts, ids, -1)
        ref = experts_loop(x.float(), w13.float(), w2.float(), weights, ids)
        got = fused_experts(x, w13, w2, weights, ids).float()
        err = ((got - ref).abs().max() / ref.abs().max()).item()
        check(f"V3 fused MoE {label}", err < 3e-2, f"relative error {err:.2e}")
    cfg = SimpleNamespace(
        hidden_size=hidden,
        n_routed_experts=256,
        num_experts_per_tok=top_k,
        topk_method="noaux_tc",
        scoring_func="sigmoid",
        n_group=8,
        topk_group=4,
        norm_topk_prob=True,
        routed_scaling_factor=2.5,
    )
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device(DEV):
            moe = MoE(cfg, 128, 128)  # TP 16: every expert, 128 of its 2,048 intermediate rows
    finally:
        torch.set_default_dtype(previous)
    for p in moe.parameters():
        p.normal_(0, 0.02)
    rows = 16 * 2048
    x = torch.randn(rows, hidden, device=DEV, dtype=torch.bfloat16)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    moe(x)
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    whole = rows * top_k * hidden * 2
    check(
        "V3 MoE layer peak (32,768 rows)",
        peak < whole,
        f"{peak / 2**30:.2f} GiB, vs {whole / 2**30:.2f} GiB for one rows x top_k x hidden buffer",
    )


def planner_vs_engine(name: str, path: str, info: dict, **kwargs) -> None:
    """The activation peak an engine measured against the planner's estimate for its layout."""
    from dpserve.plan.layouts import Layout, layout_memory
    from dpserve.plan.model import load

    try:
        model_path, model_cfg = load(path)
        tp, dp = kwargs.get("tp_size", 1), kwargs.get("dp_size", 1)
        engine_kwargs = {
            k: v for k, v in kwargs.items() if k not in ("tp_size", "dp_size", "enable_dp_attention")
        }
        total = torch.cuda.mem_get_info()[1]
        plan = layout_memory(Layout(tp, dp, dp > 1), model_path, model_cfg, "cuda", total, engine_kwargs)
    except Exception as e:  # report, and go on with the other checks
        check(f"{name} activation peak vs planner", False, f"planner failed: {e!r}")
        return
    measured = max(r["activation_bytes"] for r in info["dp_ranks"])
    check(
        f"{name} activation peak vs planner",
        0 < measured <= plan.activation_bytes,
        f"measured {measured / 2**20:.1f} MiB, planner {plan.activation_bytes / 2**20:.1f} MiB",
    )


def two_gpus(path: str) -> None:
    """tp=2 dp=2 with DP attention: decode graphs captured over NCCL against eager steps."""
    if torch.cuda.device_count() < 2:
        print(f"tp=2 dp=2 skipped: it needs 2 GPUs, this machine has {torch.cuda.device_count()}", flush=True)
        results["tp2 dp2"] = "skipped (one GPU)"
        return
    layout = dict(tp_size=2, dp_size=2, enable_dp_attention=True, dtype="bfloat16")
    outputs = {}
    for label, kwargs in (("graphs", {}), ("eager", {"disable_cuda_graph": True})):
        with Engine(model_path=path, **layout, **kwargs) as engine:
            outputs[label], _ = decode_run(engine, 8)
            if label == "graphs":
                planner_vs_engine("tp2 dp2", path, engine.get_server_info(), **layout)
    check("tp2 dp2 graphs over NCCL vs eager", outputs["graphs"] == outputs["eager"], "8 requests, greedy")


def decode_run(engine: Engine, batch: int, input_len: int = 64, output_len: int = 32) -> tuple[list, float]:
    prompts = [[3 + (7 * b + i) % 200 for i in range(input_len)] for b in range(batch)]
    engine.get_step_log()
    out = engine.generate(
        input_ids=prompts,
        sampling_params={"max_new_tokens": output_len, "temperature": 0, "ignore_eos": True},
    )
    steps = [s for s in engine.get_step_log()[0] if s.kind == "decode" and sum(s.tokens) == batch]
    return [o["output_ids"] for o in out], statistics.median(s.seconds for s in steps)


def engines(name: str, path: str) -> None:
    outputs, step_ms = {}, {}
    for label, kwargs in (
        ("graphs", {}),
        ("eager", {"disable_cuda_graph": True}),
        ("sdpa", {"attention_backend": "sdpa"}),
        ("compiled", {"enable_torch_compile": True, "torch_compile_max_bs": 8}),
    ):
        start = time.perf_counter()
        with Engine(model_path=path, tp_size=1, dtype="bfloat16", **kwargs) as engine:
            info = engine.get_server_info()
            r = info["dp_ranks"][0]
            if label == "compiled":
                print(f"{name} start-up with torch.compile {time.perf_counter() - start:.1f} s", flush=True)
            if label == "graphs":
                planner_vs_engine(name, path, info, dtype="bfloat16")
                print(f"{name} start-up {time.perf_counter() - start:.1f} s, memory: {r}", flush=True)
                check(
                    f"{name} memory",
                    r["max_total_num_tokens"] > 0,
                    f"KV pool {r['max_total_num_tokens']} tokens",
                )
                for batch in (1, 8, 32, 64):
                    _, sec = decode_run(engine, batch)
                    results[f"{name} decode tok/s bs{batch}"] = f"{batch / sec:.0f}"
                    print(
                        f"{name} batch {batch}: {sec * 1e3:.2f} ms/step, {batch / sec:.0f} tok/s", flush=True
                    )
            outputs[label], step_ms[label] = decode_run(engine, 8)
    same = outputs["graphs"] == outputs["eager"]
    check(
        f"{name} graphs vs eager",
        same,
        f"{step_ms['graphs'] * 1e3:.2f} vs {step_ms['eager'] * 1e3:.2f} ms/step",
    )
    agree = sum(a == b for a, b in zip(outputs["graphs"], outputs["sdpa"], strict=True)) / 8
    check(f"{name} triton vs sdpa", agree >= 0.75, f"{agree:.0%} of greedy outputs equal (bf16)")
    # Compiled decode steps (fused by inductor, then captured) against the captured eager ones.
    agree = sum(a == b for a, b in zip(outputs["graphs"], outputs["compiled"], strict=True)) / 8
    check(
        f"{name} torch.compile vs graphs",
        agree >= 0.75,
        f"{agree:.0%} of greedy outputs equal (bf16), {step_ms['compiled'] * 1e3:.2f} vs "
        f"{step_ms['graphs'] * 1e3:.2f} ms/step",
    )


def nextn() -> None:
    """NEXTN on the GPU (verify steps as decode graph replays, eager MTP forwards): the trained tiny DeepSeek-V3
    with 6 layers (trained on the CPU in under a minute, then cached) in float32, greedy outputs
    identical with and without drafts, accept length, decode speed at batch 1."""
    from dpserve.testing.trained_mtp import synthetic_sequences, trained_mtp_model

    path = str(trained_mtp_model(num_layers=6))
    prompts = synthetic_sequences(8, 32, seed=1)
    params = {"max_new_tokens": 64, "temperature": 0, "ignore_eos": True}
    outputs, seconds = {}, {}
    for steps in (0, 1):
        spec = {"speculative_algorithm": "NEXTN", "speculative_num_steps": steps} if steps else {}
        with Engine(model_path=path, tp_size=1, dtype="float32", **spec) as engine:
            engine.generate(input_ids=prompts[:1], sampling_params={**params, "max_new_tokens": 8})
            engine.get_step_log()
            outputs[steps] = engine.generate(input_ids=prompts[:1], sampling_params=params)
            seconds[steps] = sum(s.seconds for s in engine.get_step_log()[0] if s.kind != "extend")
            outputs[steps] += engine.generate(input_ids=prompts, sampling_params=params)
    same = [o["output_ids"] for o in outputs[0]] == [o["output_ids"] for o in outputs[1]]
    meta = [o["meta_info"] for o in outputs[1]]
    accept = sum(m["completion_tokens"] for m in meta) / sum(m["spec_verify_ct"] for m in meta)
    check("NEXTN greedy identical", same, "9 requests, 64 tokens, float32")
    check("NEXTN accept length", accept > 1.5, f"{accept:.2f} tokens per verify step")
    results["NEXTN bs1 decode speedup"] = f"{seconds[0] / seconds[1]:.2f}x"
    print(f"NEXTN batch 1: {seconds[0] * 1e3:.1f} vs {seconds[1] * 1e3:.1f} ms of decode steps", flush=True)


def expert_parallel() -> None:
    """TP MoE, EP `none` and EP `all_to_all` at (2,2) on the tiny DeepSeek-V3 in float32, graphs on."""
    if torch.cuda.device_count() < 2:
        print(f"EP skipped: NCCL needs one GPU per rank, {torch.cuda.device_count()} here", flush=True)
        return
    prompts = [[3 + (11 * b + i) % 250 for i in range(8 + 5 * b)] for b in range(6)]
    params = {"max_new_tokens": 24, "temperature": 0, "ignore_eos": True}
    outputs = {}
    with tempfile.TemporaryDirectory() as tmp:
        path = str(write_tiny_model("deepseek_v3", f"{tmp}/v3"))
        for label, kwargs in (
            ("TP MoE", {}),
            ("EP none", {"ep_size": 2}),
            ("EP all_to_all", {"ep_size": 2, "moe_a2a_backend": "all_to_all"}),
        ):
            options = dict(tp_size=2, dp_size=2, enable_dp_attention=True, dp_padding_mode="sum_len")
            with Engine(model_path=path, dtype="float32", **options, **kwargs) as engine:
                engine.get_step_log()
                out = engine.generate(input_ids=prompts, sampling_params=params)
                outputs[label] = [o["output_ids"] for o in out]
                logs = engine.get_step_log()
                model = meta_model(engine.model_cfg, engine.cfg)
                replays = [s for s in logs[0] if s.padded]
                # every rank leads its group at (2,2); unpadded all_to_all steps depend on the routing
                exact = [
                    steps for steps in zip(*logs, strict=True) if steps[0].padded or "all_to_all" not in label
                ]
                equal = all(
                    s.comm_bytes == forward_bytes(model, logged_layout(s, g, 1))
                    for steps in exact
                    for g, s in enumerate(steps)
                )
            check(
                f"{label} graphs", bool(replays), f"{len(replays)} of {len(logs[0])} steps replayed a graph"
            )
            check(f"{label} bytes", equal, f"{len(exact)} steps' bytes per rank equal the planner's")
    for label in ("EP none", "EP all_to_all"):
        same = outputs[label] == outputs["TP MoE"]
        check(f"{label} vs TP MoE", same, "6 requests, 24 greedy tokens, float32")


def main() -> None:
    assert torch.cuda.is_available(), "gpu_check needs a GPU"
    print(torch.cuda.get_device_name(), torch.__version__, flush=True)
    kernels()
    v3_shapes()
    with tempfile.TemporaryDirectory() as tmp:
        tiny = str(write_tiny_model("deepseek_v2", f"{tmp}/v2"))
        engines("tiny DeepseekV2", tiny)
        two_gpus(tiny)
    nextn()
    expert_parallel()
    try:
        from dpserve.models.gguf import resolve_model_path

        smollm2 = resolve_model_path("smollm2-135m-instruct")
    except Exception as e:  # the GGUF package may not be installed on the GPU machine
        print(f"SmolLM2 skipped: {e}")
    else:
        engines("SmolLM2", smollm2)
    print(
        "GPU CHECK",
        "PASS" if not failures else f"FAIL ({', '.join(failures)})",
        "|",
        "; ".join(f"{k}: {v}" for k, v in results.items()),
    )
    sys.exit(1 if failures else 0)


if __name__ == "__main__":
    main()
