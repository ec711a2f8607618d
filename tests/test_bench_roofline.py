"""The measured floor (dpserve.bench.floor, behind bench.roofline): what a decode step must read and compute, and the
ratio bench.one_batch prints beside each measured step."""

import json

import torch

from dpserve.bench import floor as roofline_floor
from dpserve.bench import one_batch
from dpserve.layers.linear import Linear
from dpserve.layers.mlp import MoE
from dpserve.memory import kv_bytes_per_token


class CountingMachine(roofline_floor.Machine):
    """Charges one second per linear call (and records its shape) instead of timing it, so the test
    checks which matmuls the floor counts; bandwidth and peak rate are fixed numbers."""

    def __init__(self, dtype: torch.dtype):
        self.dtype, self.device, self.bandwidth, self.peak_flops = dtype, "cpu", 1e9, 1e12
        self.calls: list[tuple[int, int, int]] = []

    def linear_seconds(self, rows, in_features, out_features, dtype) -> float:
        self.calls.append((rows, in_features, out_features))
        return 1.0


def test_dense_floor_reads_every_weight_but_the_embedding_and_every_request_kv(model_dirs):
    model, model_cfg, cfg = roofline_floor.engine_model(model_dirs["llama"], "float32", "cpu")
    machine = CountingMachine(cfg.torch_dtype)
    floor = roofline_floor.decode_floor(model, model_cfg, machine, batch=4, context=10)
    weights = sum(p.numel() * 4 for p in model.parameters()) - model.embed_tokens.weight.numel() * 4
    kv = 4 * 10 * kv_bytes_per_token(model.kv_layers, model.kv_entry_shapes(), torch.float32)
    assert floor.bytes == weights + kv
    linears = [m for m in model.modules() if isinstance(m, Linear)]
    assert len(machine.calls) == len(linears) + 1  # every linear and the LM head, at the batch's rows
    assert {rows for rows, _, _ in machine.calls} == {4}
    assert floor.linear_s == len(linears) + 1
    assert floor.seconds == max(floor.compute_s, floor.memory_s)
    # an 8-bit pool: a byte per value and a float32 scale per (token, KV head) row
    fp8 = roofline_floor.decode_floor(model, model_cfg, machine, 4, 10, torch.float8_e4m3fn)
    (k_shape, _) = model.kv_entry_shapes()
    rows, width = k_shape
    assert fp8.bytes == weights + 4 * 10 * model.kv_layers * 2 * rows * (width + 4)


def test_moe_floor_counts_only_the_experts_a_batch_touches(model_dirs):
    model, model_cfg, cfg = roofline_floor.engine_model(model_dirs["deepseek_v2"], "float32", "cpu")
    moe = [m for m in model.modules() if isinstance(m, MoE)]
    expert = (moe[0].w13[0].numel() + moe[0].w2[0].numel()) * 4
    one = roofline_floor.decode_floor(model, model_cfg, CountingMachine(torch.float32), batch=1, context=8)
    many = roofline_floor.decode_floor(model, model_cfg, CountingMachine(torch.float32), batch=64, context=8)
    kv_one = 8 * kv_bytes_per_token(model.kv_layers, model.kv_entry_shapes(), torch.float32)
    # One row reads top_k experts per MoE layer; 64 rows read nearly all of them.
    untouched_one = sum(m.num_experts - m.top_k for m in moe) * expert
    untouched_many = sum(
        round(m.num_experts - roofline_floor.touched_experts(m.num_experts, m.top_k, 64)) for m in moe
    )
    assert many.bytes - 64 * kv_one > one.bytes - kv_one
    assert abs(
        (many.bytes - 64 * kv_one) - (one.bytes - kv_one) - (untouched_one - untouched_many * expert)
    ) <= len(moe)
    assert one.parts["routed experts"] == sum(2 * m.top_k for m in moe)


def test_one_batch_prints_each_step_beside_the_measured_floor(model_dirs, capsys, tmp_path):
    # 16 tokens each: the batch decodes together for most of them even when, on a loaded machine,
    # its second request is admitted a few steps after the first.
    results = tmp_path / "results.jsonl"
    one_batch.main(
        ["--model-path", model_dirs["llama"], "--device", "cpu", "--dtype", "float32"]
        + ["--batch-size", "1", "2", "--input-len", "12", "--output-len", "16", "--warmup-output-len", "0"]
        + ["--result-file", str(results)]
    )
    out = capsys.readouterr().out
    assert "| floor (ms) | step / floor |" in out
    assert out.count("x the floor") == 2  # each batch's report line
    lines = [json.loads(line) for line in results.read_text().splitlines()]
    assert [r["batch_size"] for r in lines] == [1, 2]
    for r in lines:
        assert r["floor_latency"] > 0
        assert f"{r['median_decode_latency'] / r['floor_latency']:.2f}" in out


def test_the_floor_takes_the_fastest_gemm_and_the_report_names_the_engines(model_dirs):
    """Every linear is timed with each kernel the machine offers (ATen, oneDNN on a prepacked
    weight in bfloat16, MKL packed in float32) and the floor charges the fastest; the report says
    which kernel the engine runs: oneDNN for its packed bfloat16 linears, ATen for MLA's kv_b_proj
    and the LM head."""
    machine = roofline_floor.Machine(torch.bfloat16, "cpu", reps=1)
    kernels = machine.gemm_kernels(4, 64, 96, torch.bfloat16)
    expected = {"aten", "onednn packed"} if torch.ops.mkldnn._is_mkldnn_bf16_supported() else {"aten"}
    assert set(kernels) == expected
    assert machine.linear_seconds(4, 64, 96, torch.bfloat16) == min(kernels.values())
    if torch.backends.mkl.is_available():
        assert set(machine.gemm_kernels(4, 64, 96, torch.float32)) == {"aten", "mkl packed"}
    model, model_cfg, cfg = roofline_floor.engine_model(model_dirs["deepseek_v2"], "bfloat16", "cpu")
    report = roofline_floor.engine_linears(model, machine, batch=4)
    assert set(report) == {"attention", "dense MLP", "shared experts", "lm head"}
    assert report["lm head"][0] == "aten"
    if torch.ops.mkldnn._is_mkldnn_bf16_supported():  # kv_b_proj stays on ATen: the absorbed path reads it
        assert report["attention"][0] == "aten, onednn packed" and report["dense MLP"][0] == "onednn packed"
    for _, used_s, best_s in report.values():
        assert used_s >= best_s > 0
