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
            r = engine.get_server_info()["dp_ranks"][0]
            if label == "compiled":
                print(f"{name} start-up with torch.compile {time.perf_counter() - start:.1f} s", flush=True)
            if label == "graphs":
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


def main() -> None:
    assert torch.cuda.is_available(), "gpu_check needs a GPU"
    print(torch.cuda.get_device_name(), torch.__version__, flush=True)
    kernels()
    with tempfile.TemporaryDirectory() as tmp:
        engines("tiny DeepseekV2", str(write_tiny_model("deepseek_v2", f"{tmp}/v2")))
    nextn()
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
