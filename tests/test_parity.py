"""Token-for-token parity with transformers for every model and (tp, dp) layout."""

from __future__ import annotations

import pytest
from conftest import (
    ARCHS,
    GREEDY,
    KV_BUDGET_GB,
    NEW_TOKENS,
    assert_expert_load,
    assert_matches_reference,
    engine_for,
    engine_info_for,
)

from dpserve.models.config import ModelConfig
from dpserve.models.deepseek import mha_is_cheaper
from dpserve.testing.reference import hf_greedy_reference

LAYOUTS = [(1, 1), (2, 1), (2, 2), (4, 2), (4, 4)]


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("tp,dp", LAYOUTS)
def test_greedy_parity(engine_cache, model_dirs, prompts, references, arch, tp, dp):
    engine = engine_for(engine_cache, model_dirs, arch, tp, dp)
    outputs = engine.generate(input_ids=prompts, sampling_params=GREEDY, return_logprob=True)
    assert_matches_reference(outputs, references[arch])
    # Round robin spreads the batch over every DP group.
    assert sorted({o["meta_info"]["dp_rank"] for o in outputs}) == list(range(dp))
    if arch != "llama" and (tp, dp) == (2, 2):  # TP MoE records its expert load too
        engine.get_step_log()
        engine.get_expert_load()
        engine.generate(input_ids=prompts, sampling_params=GREEDY)
        assert_expert_load(engine, engine.get_step_log()[0])
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
    """Same per-rank budget at tp=4: MLA at dp=4 holds 2x the distinct tokens of dp=2 (the latent is
    replicated over a group's attention-TP ranks). The engines of test_greedy_parity, when it ran."""
    info = {dp: engine_info_for(engine_cache, model_dirs, "deepseek_v2", 4, dp) for dp in (2, 4)}
    hf = ModelConfig.load(model_dirs["deepseek_v2"]).hf
    mla_bytes = hf.num_hidden_layers * (hf.kv_lora_rank + hf.qk_rope_head_dim) * 4
    for dp in (2, 4):
        assert info[dp]["attn_tp_size"] == 4 // dp
        assert [r["dp_rank"] for r in info[dp]["dp_ranks"]] == list(range(dp))
        assert all(r["kv_bytes_per_token"] == mla_bytes for r in info[dp]["dp_ranks"])
    per_rank = int(KV_BUDGET_GB * 2**30 // mla_bytes)
    total = {dp: sum(r["max_total_num_tokens"] for r in info[dp]["dp_ranks"]) for dp in (2, 4)}
    assert total == {2: 2 * per_rank, 4: 4 * per_rank}


def test_gqa_kv_bytes_follow_attention_tp(model_dirs, engine_cache):
    """GQA stores 2 * ceil(kv_heads / A) * head_dim values per token per layer."""
    hf = ModelConfig.load(model_dirs["llama"]).hf
    head_dim = hf.hidden_size // hf.num_attention_heads
    for tp, dp in [(4, 2), (4, 4)]:
        info = engine_info_for(engine_cache, model_dirs, "llama", tp, dp)
        expected = hf.num_hidden_layers * 2 * -(-hf.num_key_value_heads // (tp // dp)) * head_dim * 4
        assert {r["kv_bytes_per_token"] for r in info["dp_ranks"]} == {expected}


@pytest.mark.parametrize("arch,tp,dp", [("deepseek_v2", 1, 1), ("deepseek_v2", 2, 2), ("llama", 1, 1)])
def test_triton_backend_parity(engine_cache, model_dirs, prompts, references, arch, tp, dp):
    """The GPU attention kernels (in Triton's interpreter here) through the whole engine: prefill
    by the extend kernel, padded decode steps by the split-K decode kernel (three prompts: the
    interpreter is slow)."""
    # sum_len: no start-up calibration, whose idle steps are slow in the interpreter.
    engine = engine_for(
        engine_cache, model_dirs, arch, tp, dp, attention_backend="triton", dp_padding_mode="sum_len"
    )
    outputs = engine.generate(input_ids=prompts[:3], sampling_params=GREEDY, return_logprob=True)
    assert_matches_reference(outputs, references[arch][:3])
    assert engine.get_server_info()["attention_backend"] == "triton"


@pytest.mark.parametrize("arch,tp,dp", [("deepseek_v3", 2, 2), ("llama", 1, 1)])
def test_sdpa_reference_backend_parity(engine_cache, model_dirs, prompts, references, arch, tp, dp):
    """The reference backend through the whole engine (the CPU's default is the torch backend)."""
    engine = engine_for(engine_cache, model_dirs, arch, tp, dp, attention_backend="sdpa")
    outputs = engine.generate(input_ids=prompts, sampling_params=GREEDY, return_logprob=True)
    assert_matches_reference(outputs, references[arch])
    assert engine.get_server_info()["attention_backend"] == "sdpa"


@pytest.mark.parametrize(
    "arch,tp,dp,backend",
    [
        ("deepseek_v2", 1, 1, "torch"),
        ("deepseek_v3", 2, 2, "torch"),
        ("deepseek_v2", 4, 2, "torch"),
        ("deepseek_v3", 1, 1, "triton"),
    ],
)
def test_mla_multi_head_prefill_parity(engine_cache, model_dirs, prompts, references, arch, tp, dp, backend):
    """MLA prefill in the multi-head form (forced: at the tiny models' sizes auto picks the absorbed
    one): prompts prefilled in chunks of 8 (later chunks expand their cached prefix), then prompts
    sharing a cached beginning with them and diverging (a prefix-cache hit, then several new tokens)."""
    engine = engine_for(
        engine_cache,
        model_dirs,
        arch,
        tp,
        dp,
        mla_prefill="multi_head",
        chunked_prefill_size=8 * dp,  # 8 per group
        attention_backend=backend,
        dp_padding_mode="sum_len",
    )
    n = 3 if backend == "triton" else len(prompts)  # the interpreter is slow
    outputs = engine.generate(input_ids=prompts[:n], sampling_params=GREEDY, return_logprob=True)
    assert_matches_reference(outputs, references[arch][:n])
    diverging = [p[: len(p) // 2] + [7, 8, 9, 10, 11] for p in prompts[:n]]
    again = engine.generate(input_ids=diverging, sampling_params=GREEDY, return_logprob=True)
    assert sum(o["meta_info"]["cached_tokens"] for o in again) > 0
    assert_matches_reference(again, hf_greedy_reference(model_dirs[arch], diverging, NEW_TOKENS))


def test_mla_form_rule():
    """mha_is_cheaper at DeepSeek-V3's per-rank sizes (128 heads at attention TP 1): a long prefill
    takes the multi-head form, a short extend after a long cached prefix and a decode token the
    absorbed one; at the tiny test models' sizes even a whole prefill stays absorbed on the CPU."""
    v3 = dict(heads=128, rank=512, rope=64, nope=128, v=128)
    assert mha_is_cheaper(2048, 2048, **v3, on_gpu=True) and mha_is_cheaper(2048, 2048, **v3, on_gpu=False)
    assert not mha_is_cheaper(16, 8192, **v3, on_gpu=True)
    assert not mha_is_cheaper(1, 4096, **v3, on_gpu=False)
    assert not mha_is_cheaper(20, 20, heads=4, rank=32, rope=16, nope=16, v=16, on_gpu=False)
