"""Speculative decoding (NGRAM) through the engine under DP attention: greedy outputs identical to
transformers in every layout, verify steps with idle groups, retraction and prefix-cache hits."""

from __future__ import annotations

import pytest
from conftest import GREEDY, KV_BUDGET_GB, SMALL_POOL, assert_matches_reference

SPEC = {"speculative_algorithm": "NGRAM", "speculative_num_steps": 3}


def ngram_engine(engine_cache, model_dirs, tp: int, dp: int, **kwargs):
    """The tiny DeepseekV3 with NGRAM drafts and DP attention (dp > 1)."""
    return engine_cache.get(
        model_dirs["deepseek_v3"], tp_size=tp, dp_size=dp, enable_dp_attention=dp > 1, **SPEC, **kwargs
    )


@pytest.mark.parametrize("tp,dp", [(1, 1), (2, 2), (4, 2), (4, 4)])
def test_ngram_greedy_matches_reference(engine_cache, model_dirs, prompts, references, tp, dp):
    engine = ngram_engine(engine_cache, model_dirs, tp, dp, kv_cache_memory_gb=KV_BUDGET_GB)
    engine.get_step_log()
    outputs = engine.generate(input_ids=prompts, sampling_params=GREEDY, return_logprob=True)
    assert_matches_reference(outputs, references["deepseek_v3"])
    steps = [s for s in engine.get_step_log()[0] if s.kind != "extend"]
    assert any(s.kind == "verify" for s in steps), "no step verified drafts"
    # Accept length accounting: every token after the first comes from a verify step.
    for o in outputs:
        meta = o["meta_info"]
        assert 1 <= meta["spec_verify_ct"] <= meta["completion_tokens"] - 1
    metrics = engine.get_metrics()
    assert sum(m["spec_draft_tokens"] for m in metrics) > 0
    if dp == 4:
        # One request alone: three groups idle in every verify step, the same tokens.
        alone = engine.generate(input_ids=prompts[2], sampling_params=GREEDY, return_logprob=True)
        assert alone["output_ids"] == outputs[2]["output_ids"]


def test_ngram_with_retraction_and_prefix_hits(engine_cache, model_dirs, references, prompts):
    """A small pool: verify steps beside retractions; the same prompts twice hit the prefix cache."""
    engine = ngram_engine(
        engine_cache, model_dirs, 2, 2, max_total_tokens=SMALL_POOL, chunked_prefill_size=16
    )
    # Every prompt three times at once: several times the pool, so requests are retracted.
    first = engine.generate(input_ids=prompts * 3, sampling_params=GREEDY, return_logprob=True)
    second = engine.generate(input_ids=prompts, sampling_params=GREEDY, return_logprob=True)
    for k in range(3):
        assert_matches_reference(first[k * len(prompts) : (k + 1) * len(prompts)], references["deepseek_v3"])
    assert [o["output_ids"] for o in second] == [o["output_ids"] for o in first[: len(prompts)]]
    metrics = engine.get_metrics()
    assert sum(m["retractions"] for m in metrics) > 0
    assert sum(o["meta_info"]["cached_tokens"] for o in second) > 0


@pytest.mark.parametrize("mode", ["sum_len", "max_len"])
def test_padded_verify_steps_match(engine_cache, model_dirs, prompts, references, mode):
    """Verify steps padded to a bucket (rows = requests x (1 + drafts)) give the reference tokens."""
    engine = ngram_engine(
        engine_cache, model_dirs, 4, 2, kv_cache_memory_gb=KV_BUDGET_GB, dp_padding_mode=mode
    )
    engine.get_step_log()
    outputs = engine.generate(input_ids=prompts, sampling_params=GREEDY, return_logprob=True)
    assert_matches_reference(outputs, references["deepseek_v3"])
    verify = [s for s in engine.get_step_log()[0] if s.kind == "verify"]
    assert any(s.graph and s.padding_mode == mode and s.mlp_rows > s.real_rows for s in verify)
