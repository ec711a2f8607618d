"""NEXTN speculative decoding (DeepSeek's MTP layer drafts) through the engine under DP attention, on the
trained tiny DeepSeek-V3: greedy outputs identical to transformers in every layout, the drafts equal to
the pure-torch MTP reference step by step (prefix-cache hits included), real acceptance, retraction,
and clear errors for checkpoints without an MTP layer."""

from __future__ import annotations

import json
import shutil

import httpx
import pytest
from conftest import GREEDY, NEW_TOKENS, SMALL_POOL, assert_matches_reference

from dpserve import Engine
from dpserve.testing.mtp_reference import mtp_draft_chain, mtp_greedy_drafts
from dpserve.testing.reference import hf_greedy_reference, random_prompts
from dpserve.testing.server import ServerProcess
from dpserve.testing.tiny_models import VOCAB_SIZE, write_tiny_model
from dpserve.testing.trained_mtp import synthetic_sequences, trained_mtp_model

PROMPT_LENGTHS = (5, 41, 17, 90, 9)  # very different lengths, so groups decode and prefill side by side


@pytest.fixture(scope="module")
def trained() -> str:
    return str(trained_mtp_model())


@pytest.fixture(scope="module")
def nextn_prompts() -> list[list[int]]:
    """Held-out synthetic text (drafts mostly accepted) and one random prompt (mostly rejected)."""
    text = [synthetic_sequences(1, n, seed=100 + i)[0] for i, n in enumerate(PROMPT_LENGTHS)]
    return [*text, random_prompts(VOCAB_SIZE, n=1, seed=5, min_len=12, max_len=12)[0]]


@pytest.fixture(scope="module")
def nextn_refs(trained, nextn_prompts):
    return hf_greedy_reference(trained, nextn_prompts, NEW_TOKENS)


def nextn_engine(
    engine_cache, path: str, tp: int, dp: int, steps: int, dp_attention: bool = True, **kwargs
) -> Engine:
    return engine_cache.get(
        path,
        tp_size=tp,
        dp_size=dp,
        enable_dp_attention=dp_attention and dp > 1,
        speculative_algorithm="NEXTN",
        speculative_num_steps=steps,
        **kwargs,
    )


def accept_length(outputs: list[dict]) -> float:
    meta = [o["meta_info"] for o in outputs]
    return sum(m["completion_tokens"] for m in meta) / sum(m["spec_verify_ct"] for m in meta)


@pytest.mark.parametrize(
    "tp,dp,steps,mode,dp_attention",
    [
        (1, 1, 2, "auto", True),
        (2, 2, 3, "sum_len", True),
        (4, 2, 2, "max_len", True),
        (4, 4, 1, "auto", True),
        (1, 2, 2, "auto", False),  # two replicas
    ],
)
def test_nextn_greedy_matches_reference(
    engine_cache, trained, nextn_prompts, nextn_refs, tp, dp, steps, mode, dp_attention
):
    engine = nextn_engine(
        engine_cache, trained, tp, dp, steps, dp_attention, dp_padding_mode=mode, max_total_tokens=2048
    )
    engine.get_step_log()
    accepted_before = sum(m["spec_accepted_tokens"] for m in engine.get_metrics())
    outputs = engine.generate(input_ids=nextn_prompts, sampling_params=GREEDY, return_logprob=True)
    assert_matches_reference(outputs, nextn_refs)
    log = engine.get_step_log()
    assert any(s.kind == "verify" for s in log[0]), "no step verified drafts"
    assert all(s.draft_seconds > 0 for g in log for s in g), "a step ran without the MTP forwards"
    # The MTP forwards take the target's layouts: after a padded step its draft extend is padded (a
    # graph's shapes), and chained forwards of one row per request pad even after a prefill.
    records = [s for g in log for s in g]
    assert all(s.draft_padded >= 1 for s in records if s.padded)
    assert all(s.draft_padded <= steps - 1 for s in records if not s.padded)
    assert any(s.draft_padded == steps for s in records), "no step ran all its MTP forwards padded"
    assert accept_length(outputs[:-1]) > 1.5  # the synthetic-text prompts
    # The known figure: as many verify steps as the reference MTP chain takes on the synthetic text,
    # and every token after each request's first one either an accepted draft or a verify step's own.
    expected = [reference_verify_steps(trained, p, NEW_TOKENS, steps) for p in nextn_prompts[:-1]]
    assert [o["meta_info"]["spec_verify_ct"] for o in outputs[:-1]] == expected
    accepted = sum(m["spec_accepted_tokens"] for m in engine.get_metrics()) - accepted_before
    meta = [o["meta_info"] for o in outputs]
    assert accepted == sum(m["completion_tokens"] - 1 - m["spec_verify_ct"] for m in meta)
    if dp == 4:
        # One request alone: three groups run every MTP forward with zero rows; the same tokens.
        alone = engine.generate(input_ids=nextn_prompts[3], sampling_params=GREEDY)
        assert alone["output_ids"] == outputs[3]["output_ids"]


def expected_verify_steps(prompt: list[int], path: str, max_new_tokens: int, num_steps: int) -> int:
    """Steps a NEXTN engine takes if its drafts are the reference MTP chain's: after each step it drafts
    as many tokens as still fit beside the next one, and accepts the prefix equal to the greedy tokens."""
    out = mtp_greedy_drafts(path, prompt, max_new_tokens).output_ids
    emitted, steps = 1, 0  # the prefill emits the first token
    while emitted < max_new_tokens:
        steps += 1
        n = min(num_steps, max_new_tokens - emitted - 1)
        chain = mtp_draft_chain(path, prompt + out[:emitted], n) if n > 0 else []
        guesses = zip(chain, out[emitted : emitted + len(chain)], strict=True)
        accepted = next((i for i, (d, t) in enumerate(guesses) if d != t), len(chain))
        emitted += accepted + 1
    return steps


_VERIFY_STEPS: dict = {}


def reference_verify_steps(path: str, prompt: list[int], max_new_tokens: int, num_steps: int) -> int:
    """expected_verify_steps, computed once per prompt and step count."""
    key = (path, tuple(prompt), max_new_tokens, num_steps)
    if key not in _VERIFY_STEPS:
        _VERIFY_STEPS[key] = expected_verify_steps(prompt, path, max_new_tokens, num_steps)
    return _VERIFY_STEPS[key]


@pytest.mark.parametrize("steps", [1, 2])
def test_nextn_drafts_are_the_mtp_layers(engine_cache, trained, nextn_prompts, steps):
    """Step by step the engine accepts exactly where the pure-torch MTP reference's chains are right
    (chained steps included), in a first run and again for prompts that share a cached beginning with
    the first run's and then diverge (the cached MTP KV is reused up to the last shared token)."""
    engine = nextn_engine(engine_cache, trained, 1, 1, steps, max_total_tokens=2048)
    new_tokens = 24
    params = {**GREEDY, "max_new_tokens": new_tokens}
    first = nextn_prompts[:4]
    tails = synthetic_sequences(len(first), 2, seed=99)
    second = [p[: len(p) // 2 + 1] + tail for p, tail in zip(first, tails, strict=True)]
    for run, prompts in enumerate((first, second)):
        expected = [reference_verify_steps(trained, p, new_tokens, steps) for p in prompts]
        outputs = engine.generate(input_ids=prompts, sampling_params=params)
        assert [o["meta_info"]["spec_verify_ct"] for o in outputs] == expected, f"run {run}"
    assert all(o["meta_info"]["cached_tokens"] > 0 for o in outputs)
    assert accept_length(outputs) > 1.5
    # Sampling verifies by rejection sampling: it runs beside greedy requests and accepts drafts too.
    sampled = engine.generate(input_ids=prompts, sampling_params={**params, "temperature": 0.7, "seed": 3})
    assert all(len(o["output_ids"]) == new_tokens for o in sampled)
    assert accept_length(sampled) > 1.2


def test_nextn_on_deepseek_v32(engine_cache, model_dirs, prompts, tmp_path_factory):
    """V3.2's MTP layer drafts with its own indexer over the MTP pool's keys (sparse: the prompts pass
    index_topk), under DP attention: transformers' greedy tokens, and each request verifies exactly as
    many steps as the pure-torch MTP reference's chains allow."""
    path = str(write_tiny_model("deepseek_v32_mtp", tmp_path_factory.mktemp("v32_mtp") / "v32"))
    engine = nextn_engine(engine_cache, path, 2, 2, 2)
    outputs = engine.generate(input_ids=prompts, sampling_params=GREEDY, return_logprob=True)
    assert_matches_reference(outputs, hf_greedy_reference(path, prompts, NEW_TOKENS))
    expected = [reference_verify_steps(path, p, NEW_TOKENS, 2) for p in prompts]
    assert [o["meta_info"]["spec_verify_ct"] for o in outputs] == expected


def test_nextn_with_retraction(engine_cache, trained, nextn_prompts, nextn_refs):
    """A pool several times too small: requests are retracted and resumed (prefilled again, their MTP KV
    rebuilt) while others verify drafts; every output stays the reference's."""
    engine = nextn_engine(
        engine_cache,
        trained,
        2,
        2,
        2,
        max_total_tokens=SMALL_POOL + 64,
        chunked_prefill_size=32,  # 16 per group
        load_balance_method="round_robin",  # both copies of a prompt side by side in one group
    )
    outputs = engine.generate(input_ids=nextn_prompts * 2, sampling_params=GREEDY, return_logprob=True)
    for k in range(2):
        assert_matches_reference(outputs[k * len(nextn_prompts) : (k + 1) * len(nextn_prompts)], nextn_refs)
    assert sum(m["retractions"] for m in engine.get_metrics()) > 0


def test_nextn_needs_an_mtp_layer(model_dirs, trained, tmp_path):
    with pytest.raises(ValueError, match="num_nextn_predict_layers=0"):
        Engine(model_dirs["deepseek_v3"], speculative_algorithm="NEXTN", device="cpu")
    with pytest.raises(ValueError, match="LlamaForCausalLM"):
        Engine(model_dirs["llama"], speculative_algorithm="NEXTN", device="cpu")
    # The config announces an MTP layer but its weights were left out of the checkpoint.
    stripped = write_tiny_model("deepseek_v3", tmp_path / "stripped")
    config = json.loads((stripped / "config.json").read_text())
    (stripped / "config.json").write_text(json.dumps(config | {"num_nextn_predict_layers": 1}))
    with pytest.raises(ValueError, match=r"has no model\.layers\.\d+\.eh_proj\.weight"):
        Engine(str(stripped), speculative_algorithm="NEXTN", device="cpu")
    shutil.rmtree(stripped)


def test_nextn_server(trained, nextn_prompts, nextn_refs):
    """Through launch_server at (2,2): the reference's tokens, a stop token cutting a verify step's accepted
    drafts, spec_verify_ct in /generate, and the per-rank draft counters in /metrics."""
    args = ["--model-path", trained, "--tp", "2", "--dp", "2", "--enable-dp-attention", "--dtype", "float32"]
    args += ["--speculative-algorithm", "NEXTN", "--speculative-num-steps", "2", "--max-total-tokens", "2048"]
    with ServerProcess(*args) as server:
        for g, (prompt, ref) in enumerate(zip(nextn_prompts[:2], nextn_refs, strict=False)):
            body = {"input_ids": prompt, "sampling_params": GREEDY, "data_parallel_rank": g}
            out = httpx.post(f"{server.url}/generate", json=body, timeout=60).json()
            n = ref.compare_len
            assert out["output_ids"][:n] == ref.output_ids[:n]
            assert 1 <= out["meta_info"]["spec_verify_ct"] < out["meta_info"]["completion_tokens"]
            # The group's first request: every token after its first is an accepted draft or a verify
            # step's own token.
            meta = out["meta_info"]
            assert (
                spec_metric(server, "accepted_tokens", g)
                == meta["completion_tokens"] - 1 - meta["spec_verify_ct"]
            )
            # A stop token inside a run of accepted drafts: nothing after it is emitted.
            stop = out["output_ids"][9]
            cut = out["output_ids"].index(stop)
            params = {**GREEDY, "stop_token_ids": [stop]}
            stopped = httpx.post(f"{server.url}/generate", json={**body, "sampling_params": params}).json()
            assert stopped["output_ids"] == out["output_ids"][: cut + 1]
            assert stopped["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}
        for g in (0, 1):
            assert spec_metric(server, "draft_tokens", g) > 0
            assert spec_metric(server, "accept_length", g) > 1.5


def spec_metric(server: ServerProcess, name: str, dp_rank: int) -> float:
    """dpserve_spec_{name} (a counter's _total) of one DP rank, from /metrics."""
    text = httpx.get(f"{server.url}/metrics").text
    prefix = f'dpserve_spec_{name}{"" if name == "accept_length" else "_total"}{{dp_rank="{dp_rank}"}} '
    return float(next(line for line in text.splitlines() if line.startswith(prefix)).split()[-1])


def test_nextn_triton_backend(engine_cache, trained, nextn_prompts, nextn_refs):
    """The GPU path's kernels in Triton's interpreter: padded verify steps (one decode row per verified
    token, as a captured graph replays them) and the MTP forwards (extend kernel) give the same tokens."""
    engine = nextn_engine(engine_cache, trained, 1, 1, 2, attention_backend="triton", max_total_tokens=2048)
    assert engine.get_server_info()["attention_backend"] == "triton"
    engine.get_step_log()
    outputs = engine.generate(input_ids=nextn_prompts[:3], sampling_params=GREEDY, return_logprob=True)
    assert_matches_reference(outputs, nextn_refs[:3])
    assert any(s.kind == "verify" and s.padded for s in engine.get_step_log()[0])
