"""--enable-torch-compile (dpserve/worker/compile.py): padded decode steps compiled per bucket give
the eager engine's greedy tokens at float32 (the transformers reference, which the eager engine
matches in test_parity) under DP attention; buckets above torch_compile_max_bs run eagerly."""

from __future__ import annotations

import pytest
import torch
from conftest import GREEDY, assert_matches_reference, engine_for

from dpserve.config import EngineConfig
from dpserve.distributed import Groups, Topology
from dpserve.models.config import ModelConfig
from dpserve.step.records import GroupBatch
from dpserve.worker.model_runner import ModelRunner


def test_compiled_steps_and_eager_above_max_bs(engine_cache, model_dirs, prompts, references):
    """(1,1), DeepseekV3 (MLA with q_lora, grouped top-k MoE): two requests decode in bucket 2
    (compiled), four in bucket 8 (above the max: eager)."""
    engine = engine_for(
        engine_cache,
        model_dirs,
        "deepseek_v3",
        1,
        1,
        enable_torch_compile=True,
        torch_compile_max_bs=2,
        cuda_graph_bs=(2, 8),
    )
    ref = references["deepseek_v3"]
    for part in (slice(0, 2), slice(2, None)):
        engine.get_step_log()
        outputs = engine.generate(input_ids=prompts[part], sampling_params=GREEDY, return_logprob=True)
        assert_matches_reference(outputs, ref[part])
        decode = [s for s in engine.get_step_log()[0] if s.kind == "decode"]
        assert decode and {s.padded for s in decode} == {True}


# One bucket each (the six prompts decode in it), one padding mode each: sum_len's all-reduces and
# max_len's reduce-scatter + all-gather traced. (4,4) on the smallest model (Llama: two layers, no
# MoE): four ranks compiling on two cores is the slowest start.
@pytest.mark.parametrize("arch,tp,dp,mode", [("deepseek_v2", 2, 2, "sum_len"), ("llama", 4, 4, "max_len")])
def test_compiled_parity_dp_attention(engine_cache, model_dirs, prompts, references, arch, tp, dp, mode):
    engine = engine_for(
        engine_cache,
        model_dirs,
        arch,
        tp,
        dp,
        enable_torch_compile=True,
        cuda_graph_bs=(8,),
        dp_padding_mode=mode,
    )
    engine.get_step_log()
    outputs = engine.generate(input_ids=prompts, sampling_params=GREEDY, return_logprob=True)
    assert_matches_reference(outputs, references[arch])
    assert sorted({o["meta_info"]["dp_rank"] for o in outputs}) == list(range(dp))
    decode = [s for s in engine.get_step_log()[0] if s.kind == "decode"]
    assert decode and {(s.padded, s.padding_mode) for s in decode} == {(True, mode)}


def test_no_recompile_when_serving_and_eager_above_max_bs(model_dirs):
    """In one process: after the warm-up no covered bucket compiles again, and a bucket above
    torch_compile_max_bs never enters compiled code (either would raise under fail_on_recompile);
    both give the eager forward's hidden states."""
    path = model_dirs["llama"]
    cfg = EngineConfig(
        model_path=path,
        device="cpu",
        dtype="float32",
        kv_cache_memory_gb=0.002,
        cuda_graph_bs=[1, 4],
        enable_torch_compile=True,
        torch_compile_max_bs=1,
    )
    model_cfg = ModelConfig.load(path)
    runner = ModelRunner(
        cfg, model_cfg, Groups(Topology(1, 1, 0), None, None, None, None), torch.device("cpu")
    )
    with torch.compiler.set_stance("fail_on_recompile"):
        for layout in runner.policy.padded_layouts():
            inputs = runner._inputs(GroupBatch(), layout)
            out = runner.forward_hidden(inputs, runner.pool)
            eager = runner.model.forward_hidden(inputs, runner.pool)
            if layout.bucket > cfg.torch_compile_max_bs:  # the very same eager computation
                assert torch.equal(out, eager)
            else:
                torch.testing.assert_close(out, eager)
