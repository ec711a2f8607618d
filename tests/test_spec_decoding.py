"""Speculative decoding (NGRAM) through the engine under DP attention: greedy outputs identical to
transformers in every layout, verify steps with idle groups, retraction and prefix-cache hits."""

from __future__ import annotations

import pytest
from conftest import GREEDY, SMALL_POOL, assert_matches_reference, engine_for

from dpserve.sampling_params import SamplingParams
from dpserve.speculative.ngram import propose_ngram
from dpserve.testing.reference import hf_sampling_reference

SPEC = {"speculative_algorithm": "NGRAM", "speculative_num_steps": 3}


def ngram_engine(engine_cache, model_dirs, tp: int, dp: int, **kwargs):
    """The tiny DeepseekV3 with NGRAM drafts and DP attention (dp > 1)."""
    return engine_for(engine_cache, model_dirs, "deepseek_v3", tp, dp, **SPEC, **kwargs)


def ngram_run(prompt: list[int], output: list[int], num_steps: int) -> tuple[int, int, int]:
    """(verify steps, drafts proposed, drafts accepted) of a greedy request that ran to its length
    with NGRAM drafts and slots to spare: each step proposes what prompt lookup finds, at most what
    the request may still generate beside the step's own token."""
    emitted, steps, proposed, accepted = 1, 0, 0, 0  # the prefill emits the first token
    while emitted < len(output):
        n = min(num_steps, len(output) - emitted - 1)
        drafts = propose_ngram(prompt + output[:emitted], n) if n > 0 else []
        guesses = zip(drafts, output[emitted:], strict=False)
        hits = next((i for i, (d, t) in enumerate(guesses) if d != t), len(drafts))
        steps, proposed, accepted, emitted = (
            steps + 1,
            proposed + len(drafts),
            accepted + hits,
            emitted + hits + 1,
        )
    return steps, proposed, accepted


def spec_counts(engine) -> tuple[int, int]:
    """Drafts proposed and accepted, over every DP group."""
    metrics = engine.get_metrics()
    return sum(m["spec_draft_tokens"] for m in metrics), sum(m["spec_accepted_tokens"] for m in metrics)


@pytest.mark.parametrize("tp,dp", [(1, 1), (2, 2), (4, 2), (4, 4)])
def test_ngram_greedy_matches_reference(engine_cache, model_dirs, prompts, references, tp, dp):
    engine = ngram_engine(engine_cache, model_dirs, tp, dp)
    engine.get_step_log()
    before = spec_counts(engine)
    outputs = engine.generate(input_ids=prompts, sampling_params=GREEDY, return_logprob=True)
    assert_matches_reference(outputs, references["deepseek_v3"])
    steps = [s for s in engine.get_step_log()[0] if s.kind != "extend"]
    assert any(s.kind == "verify" for s in steps), "no step verified drafts"
    # Exact accounting: the steps, drafts and accepted drafts prompt lookup gives on these outputs.
    expected = [
        ngram_run(p, o["output_ids"], SPEC["speculative_num_steps"])
        for p, o in zip(prompts, outputs, strict=True)
    ]
    assert [o["meta_info"]["spec_verify_ct"] for o in outputs] == [e[0] for e in expected]
    after = spec_counts(engine)
    assert (after[0] - before[0], after[1] - before[1]) == tuple(sum(e[i] for e in expected) for i in (1, 2))
    if dp == 4:
        # One request alone: three groups idle in every verify step, the same tokens.
        alone = engine.generate(input_ids=prompts[2], sampling_params=GREEDY, return_logprob=True)
        assert alone["output_ids"] == outputs[2]["output_ids"]


def test_ngram_with_retraction_and_prefix_hits(engine_cache, model_dirs, references, prompts):
    """A small pool: verify steps beside retractions; the same prompts twice hit the prefix cache."""
    engine = ngram_engine(
        engine_cache, model_dirs, 2, 2, max_total_tokens=SMALL_POOL, chunked_prefill_size=32
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


def test_ngram_with_penalties_matches_decoding_one_token_at_a_time(engine_cache, model_dirs, prompts):
    """Penalties under speculative decoding: greedy outputs equal transformers decoding one token at
    a time with the same penalties, through verify steps, retractions (the counts are rebuilt at
    re-admission) and both DP groups. Penalties below 1 and below 0 encourage repeats, so drafts get
    accepted (that each verified position counts the drafts before it is pinned down exactly in
    tests/test_penalties.py)."""
    engine = ngram_engine(
        engine_cache, model_dirs, 2, 2, max_total_tokens=SMALL_POOL, chunked_prefill_size=32
    )
    penalties = [{"repetition_penalty": 0.6}, {"frequency_penalty": -1.2, "presence_penalty": 0.5}, {}]
    params = [SamplingParams(**GREEDY, **penalties[i % 3]) for i in range(len(prompts))]
    eos = engine.model_cfg.eos_token_ids
    refs = [
        hf_sampling_reference(model_dirs["deepseek_v3"], p, sp, eos)
        for p, sp in zip(prompts, params, strict=True)
    ]
    before = spec_counts(engine)
    retractions = sum(m["retractions"] for m in engine.get_metrics())
    outputs = engine.generate(input_ids=prompts * 3, sampling_params=[vars(p) for p in params] * 3)
    for i, out in enumerate(outputs):
        ref = refs[i % len(prompts)]
        assert out["output_ids"][: ref.compare_len] == ref.output_ids[: ref.compare_len], i
    assert sum(r.compare_len for r in refs) >= 0.9 * len(refs) * GREEDY["max_new_tokens"]
    after = spec_counts(engine)
    assert after[1] > before[1] and sum(m["retractions"] for m in engine.get_metrics()) > retractions


@pytest.mark.parametrize("mode", ["sum_len", "max_len"])
def test_padded_verify_steps_match(engine_cache, model_dirs, prompts, references, mode):
    """Verify steps padded to a bucket (rows = requests x (1 + drafts)) give the reference tokens."""
    engine = ngram_engine(engine_cache, model_dirs, 4, 2, dp_padding_mode=mode)
    engine.get_step_log()
    outputs = engine.generate(input_ids=prompts, sampling_params=GREEDY, return_logprob=True)
    assert_matches_reference(outputs, references["deepseek_v3"])
    verify = [s for s in engine.get_step_log()[0] if s.kind == "verify"]
    assert any(s.padded and s.padding_mode == mode and s.mlp_rows > s.real_rows for s in verify)
