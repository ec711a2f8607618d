"""KV on demand in the whole engine (docs/design.md, section 5): admission by estimate, retraction under
pressure, the radix prefix cache per DP group, and input checks. Outputs are compared with
transformers' greedy tokens."""

from __future__ import annotations

import random

import pytest
from conftest import SMALL_POOL as POOL
from conftest import small_pool_engine as engine_for

from dpserve.testing.reference import hf_greedy_reference, random_prompts

LONG = 48  # new tokens of the oversubscription requests
LAYOUTS = [(2, 2), (4, 2)]


@pytest.fixture(scope="module")
def long_prompts() -> list[list[int]]:
    return random_prompts(vocab_size=301, n=16, seed=7, min_len=3, max_len=40)


@pytest.fixture(scope="module")
def long_refs(model_dirs, long_prompts):
    return hf_greedy_reference(model_dirs["deepseek_v2"], long_prompts, LONG)


@pytest.fixture(scope="module")
def shared_prompts() -> list[list[int]]:
    """Two system prompts of 30 tokens, each with six different questions."""
    rng = random.Random(3)
    systems = [[rng.randrange(3, 301) for _ in range(30)] for _ in range(2)]
    return [
        s + [rng.randrange(3, 301) for _ in range(rng.randrange(2, 9))] for s in systems for _ in range(6)
    ]


@pytest.fixture(scope="module")
def shared_refs(model_dirs, shared_prompts):
    return hf_greedy_reference(model_dirs["deepseek_v2"], shared_prompts, 16)


def assert_greedy(outputs: list[dict], refs) -> None:
    compared = 0
    for i, (out, ref) in enumerate(zip(outputs, refs, strict=True)):
        n = ref.compare_len
        assert out["output_ids"][:n] == ref.output_ids[:n], f"request {i}: tokens differ"
        compared += n
    assert compared >= 0.75 * sum(len(r.output_ids) for r in refs)


def greedy(n: int) -> dict:
    return {"max_new_tokens": n, "temperature": 0.0, "ignore_eos": True}


@pytest.mark.parametrize(
    "tp,dp", LAYOUTS[:1]
)  # retraction is a group's: its attention TP size does not enter
def test_oversubscribed_pool_retracts_and_matches_reference(
    engine_cache, model_dirs, long_prompts, long_refs, tp, dp
):
    engine = engine_for(engine_cache, model_dirs, tp, dp)
    engine.get_step_log()
    for g in range(dp):
        assert sum(len(p) + LONG for p in long_prompts[g::dp]) >= 4 * POOL
    outputs = engine.generate(input_ids=long_prompts, sampling_params=greedy(LONG))
    assert_greedy(outputs, long_refs)
    assert all(o["meta_info"]["completion_tokens"] == LONG for o in outputs)
    log = engine.get_step_log()
    for g in range(dp):
        assert sum(s.retractions for s in log[g]) > 0, f"group {g} never retracted"
        assert engine.get_metrics()[g]["retractions"] > 0
        assert engine.get_metrics()[g]["kv_used"] == 0  # nothing held once all finished


def test_short_request_is_not_stuck_behind_a_long_one(engine_cache, model_dirs, prompts, references):
    """Reserving prompt + max_new_tokens would make the short request wait for the long one."""
    engine = engine_for(engine_cache, model_dirs, 2, 2)
    long_prompt, long_new, short_new = [5] * 10, POOL - 12, 8
    assert len(long_prompt) + long_new + len(prompts[0]) + short_new > POOL
    long_rid = engine.submit(long_prompt, greedy(long_new), dp_rank=0)
    while not any(s.local_mode == "decode" for s in engine.get_step_log()[0]):
        pass  # the long request decodes once group 0 logs a decode step
    short = engine.wait(engine.submit(prompts[0], greedy(short_new), dp_rank=0))
    ref = references["deepseek_v2"][0]
    n = min(short_new, ref.compare_len)
    assert short["output_ids"][:n] == ref.output_ids[:n]
    # Group 0's report of the step that finished the short request: the long one still runs.
    assert engine.get_metrics()[0]["running"] == 1
    assert engine.wait(long_rid)["meta_info"]["completion_tokens"] == long_new


@pytest.mark.parametrize("tp,dp", LAYOUTS[1:])  # attention TP 2 (the cache is a group's, as at (2,2))
def test_prefix_cache_shared_prefixes(engine_cache, model_dirs, shared_prompts, shared_refs, tp, dp):
    engine = engine_for(engine_cache, model_dirs, tp, dp, max_running_requests=4 * dp)  # 4 per group
    # In one group: every request pinned to group 0.
    rids = [engine.submit(p, greedy(16), dp_rank=0) for p in shared_prompts]
    outputs = [engine.wait(r) for r in rids]
    assert_greedy(outputs, shared_refs)
    assert sum(o["meta_info"]["cached_tokens"] for o in outputs) >= 30 * 6
    # Across groups (each in turn), on caches that the requests above filled and evicted.
    rids = [engine.submit(p, greedy(16), dp_rank=i % dp) for i, p in enumerate(shared_prompts)]
    outputs = [engine.wait(r) for r in rids]
    assert_greedy(outputs, shared_refs)
    metrics = engine.get_metrics()
    assert all(m["cache_hit_tokens"] > 0 for m in metrics)
    assert metrics[0]["cache_evicted_tokens"] > 0  # the pool of 96 held far less than was cached


def test_same_prompt_twice_prefills_only_the_suffix(engine_cache, model_dirs, prompts, references):
    engine = engine_for(engine_cache, model_dirs, 2, 2)
    prompt, ref = prompts[1], references["deepseek_v2"][1]
    first = engine.generate(input_ids=prompt, sampling_params=greedy(16), return_logprob=True)
    engine.get_step_log()
    before = engine.get_metrics()[first["meta_info"]["dp_rank"]]["prefilled_tokens"]
    second = engine.submit(prompt, greedy(16), return_logprob=True, dp_rank=first["meta_info"]["dp_rank"])
    second = engine.wait(second)
    g = second["meta_info"]["dp_rank"]
    assert second["meta_info"]["cached_tokens"] == len(prompt) - 1
    assert engine.get_metrics()[g]["prefilled_tokens"] - before == 1
    assert [s.tokens[g] for s in engine.get_step_log()[g] if s.local_mode == "extend"] == [1]
    for out in (first, second):
        assert out["output_ids"][: ref.compare_len] == ref.output_ids[: ref.compare_len]
    assert second["meta_info"]["output_token_logprobs"] == pytest.approx(
        first["meta_info"]["output_token_logprobs"], abs=1e-4
    )


def test_bad_input_raises_and_the_engine_keeps_serving(engine_cache, model_dirs, prompts, references):
    engine = engine_for(engine_cache, model_dirs, 2, 2)
    vocab = engine.model_cfg.vocab_size
    with pytest.raises(ValueError, match=rf"token id {vocab + 5} is outside the vocabulary \[0, {vocab}\)"):
        engine.generate(input_ids=[[vocab + 5]])
    with pytest.raises(ValueError, match="token id -1"):
        engine.submit([5, -1])
    with pytest.raises(ValueError, match="max_new_tokens must be an int >= 1"):
        engine.generate(input_ids=[5, 6], sampling_params={"max_new_tokens": "8"})
    with pytest.raises(ValueError, match="temperature must be a number >= 0"):
        engine.generate(input_ids=[5, 6], sampling_params={"temperature": -1})
    with pytest.raises(ValueError, match="stop token id 999"):
        engine.generate(input_ids=[5, 6], sampling_params={"stop_token_ids": [999]})
    with pytest.raises(ValueError, match="the prompt is empty"):
        engine.generate(input_ids=[[]])
    out = engine.generate(input_ids=prompts[2], sampling_params=greedy(16))
    ref = references["deepseek_v2"][2]
    assert out["output_ids"][: ref.compare_len] == ref.output_ids[: ref.compare_len]


def test_seeded_sampling_survives_retraction(engine_cache, model_dirs, long_prompts):
    """A retracted request resumes with its own generator: the same tokens as when run alone."""
    engine = engine_for(engine_cache, model_dirs, 2, 2)
    params = [{**greedy(LONG), "temperature": 1.0, "seed": 100 + i} for i in range(len(long_prompts))]
    engine.get_step_log()
    together = engine.generate(input_ids=long_prompts, sampling_params=params)
    assert sum(s.retractions for log in engine.get_step_log() for s in log) > 0
    for i in range(4):
        alone = engine.generate(input_ids=long_prompts[i], sampling_params=params[i])
        assert alone["output_ids"] == together[i]["output_ids"]
