"""Token-for-token parity with transformers for every model and (tp, dp) layout."""

from __future__ import annotations

import pytest
from conftest import ARCHS, GREEDY, KV_BUDGET_GB, assert_matches_reference

LAYOUTS = [(1, 1), (2, 1), (2, 2), (4, 2), (4, 4)]


def engine_for(engine_cache, model_dirs, arch, tp, dp, **kwargs):
    return engine_cache.get(
        model_dirs[arch],
        tp_size=tp,
        dp_size=dp,
        enable_dp_attention=dp > 1,
        kv_cache_memory_gb=KV_BUDGET_GB,
        **kwargs,
    )


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("tp,dp", LAYOUTS)
def test_greedy_parity(engine_cache, model_dirs, prompts, references, arch, tp, dp):
    engine = engine_for(engine_cache, model_dirs, arch, tp, dp)
    outputs = engine.generate(input_ids=prompts, sampling_params=GREEDY, return_logprob=True)
    assert_matches_reference(outputs, references[arch])
    # Round robin spreads the batch over every DP group.
    assert sorted({o["meta_info"]["dp_rank"] for o in outputs}) == list(range(dp))
    if (tp, dp) == (4, 4):
        # One request at a time: three of four groups run idle batches in every step.
        alone = engine.generate(input_ids=prompts[0], sampling_params=GREEDY, return_logprob=True)
        assert alone["output_ids"] == outputs[0]["output_ids"]
        assert alone["meta_info"]["output_token_logprobs"] == pytest.approx(
            outputs[0]["meta_info"]["output_token_logprobs"], abs=1e-5
        )


@pytest.mark.parametrize("tp,dp", [(2, 2), (4, 2), (4, 4)])
def test_max_len_gather_matches(engine_cache, model_dirs, prompts, references, tp, dp):
    # Unpadded, so M is the largest group's tokens (padded steps: tests/test_padding.py).
    engine = engine_for(
        engine_cache, model_dirs, "deepseek_v3", tp, dp, dp_padding_mode="max_len", disable_cuda_graph=True
    )
    outputs = engine.generate(input_ids=prompts, sampling_params=GREEDY, return_logprob=True)
    assert_matches_reference(outputs, references["deepseek_v3"])
    steps = [s for log in engine.get_step_log() for s in log]
    assert steps and {s.padding_mode for s in steps} == {"max_len"}
    # max_len pads every group to M (a multiple of tp/dp): the MoE sees dp * M rows.
    for s in steps:
        m = -(-max(s.tokens) // (tp // dp)) * (tp // dp)
        assert s.mlp_rows == dp * m


def test_kv_capacity_scales_with_dp(engine_cache, model_dirs):
    """Same per-rank budget: MLA at dp=4 holds 4x the distinct tokens of dp=1."""
    info = {}
    for dp in (1, 4):
        engine = engine_for(engine_cache, model_dirs, "deepseek_v2", 4, dp)
        info[dp] = engine.get_server_info()
    hf = engine.model_cfg.hf
    mla_bytes = hf.num_hidden_layers * (hf.kv_lora_rank + hf.qk_rope_head_dim) * 4
    for dp in (1, 4):
        assert info[dp]["attn_tp_size"] == 4 // dp
        assert [r["dp_rank"] for r in info[dp]["dp_ranks"]] == list(range(dp))
        assert all(r["kv_bytes_per_token"] == mla_bytes for r in info[dp]["dp_ranks"])
    per_rank = int(KV_BUDGET_GB * 2**30 // mla_bytes)
    total = {dp: sum(r["max_total_num_tokens"] for r in info[dp]["dp_ranks"]) for dp in (1, 4)}
    assert total == {1: per_rank, 4: 4 * per_rank}


def test_gqa_kv_bytes_follow_attention_tp(engine_cache, model_dirs):
    """GQA stores 2 * ceil(kv_heads / A) * head_dim values per token per layer."""
    for tp, dp in [(4, 1), (4, 4)]:
        engine = engine_for(engine_cache, model_dirs, "llama", tp, dp)
        hf = engine.model_cfg.hf
        a = tp // dp
        head_dim = hf.hidden_size // hf.num_attention_heads
        expected = hf.num_hidden_layers * 2 * -(-hf.num_key_value_heads // a) * head_dim * 4
        assert {r["kv_bytes_per_token"] for r in engine.get_server_info()["dp_ranks"]} == {expected}


@pytest.mark.parametrize("arch,tp,dp", [("deepseek_v2", 1, 1), ("deepseek_v2", 2, 2), ("llama", 1, 1)])
def test_triton_backend_parity(engine_cache, model_dirs, prompts, references, arch, tp, dp):
    """The GPU attention kernels (in Triton's interpreter here) through the whole engine: prefill
    by the extend kernel, padded decode steps by the split-K decode kernel."""
    # sum_len: no start-up calibration, whose idle steps are slow in the interpreter.
    engine = engine_for(
        engine_cache, model_dirs, arch, tp, dp, attention_backend="triton", dp_padding_mode="sum_len"
    )
    outputs = engine.generate(input_ids=prompts, sampling_params=GREEDY, return_logprob=True)
    assert_matches_reference(outputs, references[arch])
    assert engine.get_server_info()["attention_backend"] == "triton"
