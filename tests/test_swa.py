"""The hybrid sliding-window pool (dpserve/kvcache/window.py): gpt-oss's window layers keep their KV
in a pool of their own, a token's window KV is given up once no query can read it, the prefix cache
keeps what it can of it and gives it up first when the pool is short, and a cached prefix is used
only as far as its window survived; every output stays transformers' greedy one."""

from __future__ import annotations

import pytest
from conftest import GREEDY, assert_matches_reference

from dpserve.kvcache.window import WindowSlots
from dpserve.memory import swa_pool_tokens
from dpserve.testing.reference import hf_greedy_reference

WINDOW = 8  # the tiny gpt-oss checkpoint's sliding_window
# 160 full slots per group; the window pool: max(0.1 x 160, 4 requests x (8 + 3 drafts) + a 16-token
# chunk) = 60, so the cache's window KV is given up as requests come and go.
HYBRID = {
    "max_total_tokens": 160,
    "max_running_requests": 4,
    "chunked_prefill_size": 16,
    "swa_full_tokens_ratio": 0.1,
    "speculative_algorithm": "NGRAM",
    "speculative_num_steps": 3,
}


@pytest.fixture(scope="module")
def gpt_oss(model_dirs) -> str:
    return model_dirs["gpt_oss"]


def test_pool_sizes_from_one_budget():
    # 512 + 512 bytes per token over full / window layers; the window pool 0.25 x the full one.
    assert swa_pool_tokens(1_280_000, 512, 512, 0.25, 100) == (2000, 500)
    # The floor binds: the window pool keeps it, the full layers take the rest.
    assert swa_pool_tokens(1_280_000, 512, 512, 0.25, 800) == (1700, 800)
    # A budget too small for the floor: equal pools, as if every layer kept every token.
    assert swa_pool_tokens(102_400, 512, 512, 0.25, 800) == (100, 100)
    # --max-total-tokens sizes the full pool; the window one follows.
    assert swa_pool_tokens(0, 512, 512, 0.25, 100, max_total_tokens=1000) == (1000, 250)


def test_a_cached_prefix_is_used_as_far_as_its_window_survived():
    slots = WindowSlots(num_tokens=6, window_size=3)  # a query reads the 2 positions before its own
    full = [11, 12, 13, 14, 15]  # a cached sequence's full slots
    slots.acquire(full[1:])
    slots.keep(full[1:])
    assert slots.usable(full) == 5
    slots.reclaim(1)  # the oldest (12) goes
    assert slots.cached == 3 and slots.usable(full) == 5  # 14 and 15 still there: the whole prefix
    slots.drop([15])
    assert slots.usable(full) == 4  # up to 15's position: 13 and 14 still there
    slots.drop([13])
    assert slots.usable(full) == 0  # every shorter prefix lacks a window token (11 never had one)
    slots.drop([14])
    assert slots.cached == 0 and slots.allocator.num_free == 6


def test_window_layers_forget_and_outputs_stay_greedy(engine_cache, gpt_oss, prompts):
    engine = engine_cache.get(gpt_oss, **HYBRID)
    (rank,) = engine.get_server_info()["dp_ranks"]
    assert (rank["max_total_num_tokens"], rank["window_tokens"]) == (160, 60)
    outs = engine.generate(input_ids=prompts, sampling_params=GREEDY, return_logprob=True)
    assert_matches_reference(outs, hf_greedy_reference(gpt_oss, prompts, GREEDY["max_new_tokens"]))
    (m,) = engine.get_metrics()
    assert m["window_evicted_tokens"] > 0  # the cache gave window KV up for new tokens
    assert m["kv_window_cached"] < m["kv_cached"]  # it keeps full KV whose window KV is gone
    assert m["kv_window_free"] + m["kv_window_cached"] == 60  # nothing else holds a window slot

    # The next turn of the last conversation: its window KV was cached last, so the whole of it hits.
    turn = prompts[-1] + outs[-1]["output_ids"]
    (out,) = engine.generate(input_ids=[turn], sampling_params=GREEDY, return_logprob=True)
    assert out["meta_info"]["cached_tokens"] == len(turn) - 1
    assert_matches_reference([out], hf_greedy_reference(gpt_oss, [turn], GREEDY["max_new_tokens"]))


def test_without_the_prefix_cache_window_slots_are_reused_at_once(engine_cache, gpt_oss, prompts):
    """Nothing caches window KV: a position's slot is free (and the next new token's) the step its
    request's queries stop reading it."""
    engine = engine_cache.get(gpt_oss, disable_radix_cache=True, **HYBRID)
    outs = engine.generate(input_ids=prompts, sampling_params=GREEDY, return_logprob=True)
    assert_matches_reference(outs, hf_greedy_reference(gpt_oss, prompts, GREEDY["max_new_tokens"]))
    (m,) = engine.get_metrics()
    assert (m["kv_window_free"], m["kv_window_cached"], m["kv_free"]) == (60, 0, 160)
