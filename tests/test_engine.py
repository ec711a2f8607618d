"""Scheduling, KV limits, sampling and failure handling of the Engine."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
import time

import pytest
from conftest import (
    GREEDY,
    KV_BUDGET_GB,
    NEW_TOKENS,
    assert_matches_reference,
    engine_for,
    small_pool_engine,
)

from dpserve import Engine
from dpserve.engine.engine import WorkerFailure
from dpserve.sampling_params import SamplingParams


def test_request_larger_than_pool_is_rejected(engine_cache, model_dirs, prompts, references):
    engine = small_pool_engine(engine_cache, model_dirs)
    too_big = {"max_new_tokens": 60, "temperature": 0.0}
    message = (
        "the request needs 100 KV tokens (40 prompt + up to 60 new), but its DP group's KV pool holds only 96"
    )
    with pytest.raises(ValueError, match=re.escape(message)):
        engine.generate(input_ids=[1 + i % 200 for i in range(40)], sampling_params=too_big)
    with pytest.raises(ValueError, match="context length is 512"):
        engine.generate(input_ids=[5] * 600, sampling_params=GREEDY)
    # A request that would run past the context is refused whole, not capped.
    with pytest.raises(ValueError, match="500 tokens and max_new_tokens is 16: 516 tokens, but the model's"):
        engine.generate(input_ids=[5] * 500, sampling_params=GREEDY)
    # The engine keeps serving.
    out = engine.generate(input_ids=prompts[1], sampling_params=GREEDY, return_logprob=True)
    assert_matches_reference([out], references["deepseek_v2"][1:2])


def test_stop_tokens(engine_cache, model_dirs, prompts):
    engine = small_pool_engine(engine_cache, model_dirs)
    free = engine.generate(input_ids=prompts[0], sampling_params=GREEDY)
    ids = free["output_ids"]
    stop_tok = next(t for i, t in enumerate(ids) if i >= 3 and t not in ids[:i])
    out = engine.generate(input_ids=prompts[0], sampling_params={**GREEDY, "stop_token_ids": [stop_tok]})
    assert out["output_ids"] == ids[: ids.index(stop_tok) + 1]
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop_tok}
    assert free["meta_info"]["finish_reason"] == {"type": "length", "length": NEW_TOKENS}
    assert free["meta_info"]["completion_tokens"] == NEW_TOKENS
    assert free["meta_info"]["prompt_tokens"] == len(prompts[0])
    assert "output_token_logprobs" not in free["meta_info"]


def test_eos_from_generation_config(engine_cache, model_dirs, prompts, tmp_path):
    """generation_config.json's eos_token_id ends a request unless ignore_eos is set."""
    free = engine_cache.get(model_dirs["llama"], tp_size=1, kv_cache_memory_gb=KV_BUDGET_GB).generate(
        input_ids=prompts[1], sampling_params=GREEDY
    )["output_ids"]
    eos = next(t for i, t in enumerate(free) if i >= 3 and t not in free[:i])
    model = tmp_path / "eos_model"
    shutil.copytree(model_dirs["llama"], model)
    gen = json.loads((model / "generation_config.json").read_text())
    (model / "generation_config.json").write_text(json.dumps({**gen, "eos_token_id": [eos, 299]}))
    engine = engine_cache.get(str(model), tp_size=1, kv_cache_memory_gb=KV_BUDGET_GB)
    stopped = engine.generate(input_ids=prompts[1], sampling_params={**GREEDY, "ignore_eos": False})
    assert stopped["output_ids"] == free[: free.index(eos) + 1]
    assert stopped["meta_info"]["finish_reason"] == {"type": "stop", "matched": eos}
    assert engine.generate(input_ids=prompts[1], sampling_params=GREEDY)["output_ids"] == free


def test_continuous_batching(engine_cache, model_dirs, prompts, references):
    """Requests that arrive while another decodes join the running batch and give the same tokens."""
    engine = engine_for(engine_cache, model_dirs, "deepseek_v3", 2, 2)
    long_params = {**GREEDY, "max_new_tokens": 48}
    alone = engine.generate(input_ids=prompts[0], sampling_params=long_params)
    engine.get_step_log()
    rid = engine.submit(prompts[0], long_params, dp_rank=0)
    while not any(s.local_mode == "decode" for s in engine.get_step_log()[0]):
        pass  # the long request has started decoding once group 0 logs a decode step
    late = [engine.submit(p, GREEDY, return_logprob=True, dp_rank=0) for p in prompts[1:4]]
    late_out = [engine.wait(r) for r in late]
    assert engine.wait(rid)["output_ids"] == alone["output_ids"]
    assert_matches_reference(late_out, references["deepseek_v3"][1:4])
    log = engine.get_step_log()[0]
    assert any(s.local_mode == "decode" and s.tokens[0] >= 2 for s in log), "late requests never joined"
    # Host work per decode step follows the batch, not the contexts: one table entry per request.
    decode = [s for s in log if s.local_mode == "decode"]
    assert decode and all(s.slots_written == s.tokens[0] for s in decode)


def test_offline_routing_follows_the_prefix_cache(engine_cache, model_dirs):
    """The offline Engine routes as the server does (cache_aware by default): a prompt sharing a
    64-token beginning with a finished one goes to the group that cached it, unpinned."""
    engine = engine_for(engine_cache, model_dirs, "deepseek_v3", 2, 2)  # test_continuous_batching's
    prefix = [3 + (7 * i) % 290 for i in range(64)]
    first = engine.generate(input_ids=prefix + [5, 6], sampling_params=GREEDY)
    second = engine.generate(input_ids=prefix + [9, 10, 11], sampling_params=GREEDY)
    assert second["meta_info"]["dp_rank"] == first["meta_info"]["dp_rank"]
    assert second["meta_info"]["cached_tokens"] == 64
    assert engine.get_server_info()["load_balance_method"] == "cache_aware"


def test_sampling(engine_cache, model_dirs, prompts):
    engine = engine_cache.get(model_dirs["llama"], tp_size=1, dp_size=1, kv_cache_memory_gb=KV_BUDGET_GB)
    seeded = {"max_new_tokens": 12, "temperature": 1.0, "seed": 1234, "ignore_eos": True}
    one = engine.generate(input_ids=prompts[2], sampling_params=seeded)
    # Same seed, same tokens, even when batched with other requests.
    batch = engine.generate(
        input_ids=[prompts[0], prompts[2], prompts[3]],
        sampling_params=[{**seeded, "seed": 1}, seeded, {**seeded, "seed": None}],
    )
    assert batch[1]["output_ids"] == one["output_ids"]
    others = [engine.generate(input_ids=prompts[2], sampling_params={**seeded, "seed": s}) for s in (1, 2, 3)]
    assert len({tuple(o["output_ids"]) for o in [one, *others]}) > 1
    greedy = engine.generate(input_ids=prompts[2], sampling_params={**seeded, "temperature": 0.0})
    top1 = engine.generate(input_ids=prompts[2], sampling_params={**seeded, "top_k": 1})
    assert top1["output_ids"] == greedy["output_ids"]


HOSTILE_PARAMS = [
    ({"top_k": 2**63}, "top_k must be -1 or an int >= 1"),
    ({"seed": -(2**63) - 1}, "seed must be an int or None"),
    ({"max_new_tokens": 2**64}, "max_new_tokens must be an int >= 1"),
    ({"min_new_tokens": 2**63, "max_new_tokens": 2**63}, "max_new_tokens must be an int >= 1"),
    ({"temperature": float("nan")}, "temperature must be a number >= 0"),
    ({"temperature": float("inf")}, "temperature must be a number >= 0"),
    ({"top_p": float("nan")}, "top_p must be in (0, 1]"),
    ({"frequency_penalty": float("-inf")}, "frequency_penalty must be in [-2, 2]"),
    ({"logit_bias": {2**63: 1.0}}, "logit_bias must map token ids to numbers in [-100, 100]"),
    ({"logit_bias": {2**62: 1.0}}, "logit_bias token id 4611686018427387904 is outside the vocabulary"),
    ({"logit_bias": {5: float("nan")}}, "logit_bias must map token ids to numbers in [-100, 100]"),
    ({"logit_bias": {t: 1.0 for t in range(1025)}}, "(at most 1024 entries)"),
    ({"stop_token_ids": [2**63]}, "stop_token_ids must be a list of ints"),
    ({"stop_token_ids": [7] * 1025}, "stop_token_ids must be a list of ints (at most 1024)"),
    ({"top_logprobs_num": 2**70}, "top_logprobs_num must be in [0, 20]"),
]


@pytest.mark.parametrize("params,message", HOSTILE_PARAMS)
def test_extreme_values_are_refused_before_any_rank_sees_them(
    engine_cache, model_dirs, prompts, params, message
):
    engine = engine_cache.get(model_dirs["llama"], tp_size=1, dp_size=1, kv_cache_memory_gb=KV_BUDGET_GB)
    with pytest.raises(ValueError, match=re.escape(message)):
        engine.generate(input_ids=prompts[0], sampling_params={"max_new_tokens": 4, **params})
    # A SamplingParams built past from_dict (as the HTTP layer builds them) is checked all the same.
    with pytest.raises(ValueError, match=re.escape(message)):
        engine.front.submit(prompts[0], SamplingParams(**{"max_new_tokens": 4, **params}))


def test_a_request_left_nothing_to_sample_fails_alone(engine_cache, model_dirs, prompts):
    """Extreme but valid values are served (a temperature that underflows is greedy, a top_k past
    the vocabulary is all of it); a request whose min_new_tokens forbids every token ends with an
    error naming why, its KV freed, while the request beside it gets its tokens."""
    engine = engine_cache.get(model_dirs["llama"], tp_size=1, dp_size=1, kv_cache_memory_gb=KV_BUDGET_GB)
    greedy = engine.generate(input_ids=prompts[1], sampling_params=GREEDY)["output_ids"]
    extreme = {**GREEDY, "temperature": 1e-300, "top_k": 2**63 - 1, "top_p": 5e-324, "seed": 2**63 - 1}
    assert engine.generate(input_ids=prompts[1], sampling_params=extreme)["output_ids"] == greedy
    vocab = engine.model_cfg.vocab_size
    hostile = {"max_new_tokens": 8, "min_new_tokens": 4, "stop_token_ids": list(range(vocab))}
    bad = engine.submit(prompts[0], hostile)
    good = engine.submit(prompts[1], GREEDY)
    with pytest.raises(ValueError, match="no token can be sampled"):
        engine.wait(bad)
    assert engine.wait(good)["output_ids"] == greedy
    assert engine.get_metrics()[0]["kv_used"] == 0


def test_an_aborted_request_leaves_nothing_of_its_call_behind(engine_cache, model_dirs, prompts):
    """One request of a generate call fails (nothing to sample): the call raises naming it, the
    others are aborted and waited for, and nothing stays in the front end or the KV pool."""
    engine = engine_cache.get(model_dirs["llama"], tp_size=1, dp_size=1, kv_cache_memory_gb=KV_BUDGET_GB)
    hostile = {
        "max_new_tokens": 8,
        "min_new_tokens": 4,
        "stop_token_ids": list(range(engine.model_cfg.vocab_size)),
    }
    long = {**GREEDY, "max_new_tokens": 64}
    with pytest.raises(ValueError, match="^request 1: no token can be sampled"):
        engine.generate(input_ids=prompts[:4], sampling_params=[long, hostile, long, long])
    assert engine.front.requests == {} and engine._params == {}
    assert engine.get_metrics()[0]["kv_used"] == 0 and engine.get_metrics()[0]["running"] == 0


def test_text_prompt(engine_cache, model_dirs):
    engine = engine_cache.get(model_dirs["llama"], tp_size=1, dp_size=1, kv_cache_memory_gb=KV_BUDGET_GB)
    out = engine.generate(
        prompt="The cat sat on the mat", sampling_params={"max_new_tokens": 8, "temperature": 0}
    )
    assert out["meta_info"]["prompt_tokens"] == len(engine.tokenizer.encode("The cat sat on the mat"))
    assert out["text"] == engine.tokenizer.decode(out["output_ids"], skip_special_tokens=True)
    assert len(engine.generate(prompt=["a", "b c"], sampling_params={"max_new_tokens": 2})) == 2


def test_killed_worker_raises(engine_cache, model_dirs):
    engine_cache.close()
    engine = Engine(
        model_path=model_dirs["llama"], tp_size=2, dp_size=2, enable_dp_attention=True, device="cpu"
    )
    killed = engine.front.workers.procs[1]
    killed.kill()
    killed.join()  # the leader's socket is gone before the request is sent (that send once hung)
    start = time.monotonic()
    with pytest.raises(WorkerFailure, match="worker rank 1 exited with code -9"):
        engine.generate(input_ids=[5, 6, 7], sampling_params=GREEDY)
    assert time.monotonic() - start < 60
    assert all(not p.is_alive() for p in engine.front.workers.procs)


def test_broken_checkpoint_raises(model_dirs, tmp_path):
    broken = tmp_path / "broken"
    shutil.copytree(model_dirs["llama"], broken)
    cfg = json.loads((broken / "config.json").read_text())
    cfg["num_hidden_layers"] += 1
    (broken / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(WorkerFailure, match="tensor 'model.layers.2.input_layernorm.weight' not found"):
        Engine(model_path=str(broken), tp_size=2, device="cpu")


def test_tiny_model_cli(tmp_path):
    out = tmp_path / "cli_llama"
    subprocess.run(
        [sys.executable, "-m", "dpserve.testing.tiny_models", "--arch", "llama", "--out", str(out)],
        check=True,
    )
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLM"] and cfg["vocab_size"] == 301
    assert (out / "tokenizer.json").exists() and (out / "model.safetensors").exists()


def test_startup_bench_prints_each_start(model_dirs, capsys):
    from dpserve.bench import startup

    startup.main(["--model-path", model_dirs["llama"], "--repeats", "2"])
    rows = [
        line
        for line in capsys.readouterr().out.splitlines()
        if line.startswith("| 1 ") or line.startswith("| 2 ")
    ]
    assert len(rows) == 2
    assert all(float(cell) >= 0 for row in rows for cell in row.strip("|").split("|")[1:])
