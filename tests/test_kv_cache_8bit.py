"""The 8-bit KV cache (`--kv-cache-dtype fp8_e4m3 / fp8_e5m2`): FP8 codes with a float32 scale per
token and KV head, computed as each token is written. The engine gives transformers' greedy tokens
and logprobs with what transformers caches rounded the same way (`kv_cache_rounding`: GQA's
keys and values per token and head, MLA's latent and rope key per token), in every attention
backend and layout, through the hybrid window pool, NEXTN's MTP pool, chunked prefill, prefix hits
and retraction; and a token costs the bytes the planner counts."""

from __future__ import annotations

import pytest
import torch
from conftest import (
    GREEDY,
    KV_BUDGET_GB,
    NEW_TOKENS,
    PRESSURE,
    assert_matches_reference,
    engine_for,
    engine_info_for,
    generate_under_pressure,
)

from dpserve.config import KV_CACHE_DTYPES
from dpserve.kvcache.pool import KVPool, ScaledKV, entry_bytes, take
from dpserve.models.config import ModelConfig
from dpserve.testing.reference import hf_greedy_reference

# Most steps agree to 1e-5, but the float noise of a layout's reductions can move one element of a
# cached row across a code boundary (one code step, 2^-4 of its binade): ~1e-4 on a tiny model.
CODE_FLIP = 1e-3
NEXTN = {"speculative_algorithm": "NEXTN", "speculative_num_steps": 2}


@pytest.fixture(scope="module")
def rounded_references(model_dirs, prompts):
    """transformers' greedy outputs with its cache rounded as each 8-bit pool stores it."""

    class References(dict):
        def __missing__(self, key: tuple[str, str]):
            arch, kv = key
            self[key] = hf_greedy_reference(
                model_dirs[arch], prompts, NEW_TOKENS, kv_cache_dtype=KV_CACHE_DTYPES[kv]
            )
            return self[key]

    return References()


@pytest.mark.parametrize("kv", sorted(KV_CACHE_DTYPES))
def test_a_pool_entry_keeps_each_rows_values_within_half_a_code(kv):
    """Each (token, head) row is stored as codes of its own scale (its largest magnitude maps to the
    format's largest value): read back within half a code step of the row's largest
    binade; an all-zero row reads back as zeros; rows not written read as zeros."""
    dtype = KV_CACHE_DTYPES[kv]
    pool = KVPool(1, 8, [(3, 16)], torch.float32, torch.device("cpu"), cache_dtype=dtype)
    entry = pool.layers[0][0]
    assert isinstance(entry, ScaledKV) and entry.codes.dtype == dtype and entry.scales.shape == (9, 3, 1)
    assert [b.shape for b in pool.buffers()] == [(9, 3, 16), (9, 3, 1)]
    g = torch.Generator().manual_seed(0)
    x = torch.randn(4, 3, 16, generator=g) * torch.tensor([1e-3, 1.0, 1e3])[:, None]
    x[1, 2] = 0
    slots = torch.tensor([5, 1, 7, 2])
    pool.write(0, slots, x)
    back = take(entry, slots)
    amax = x.abs().amax(-1, keepdim=True)
    mantissa = torch.finfo(dtype).eps  # code step relative to the binade: 2^-3 (e4m3), 2^-2 (e5m2)
    assert ((back - x).abs() <= amax * mantissa / 2).all()
    torch.testing.assert_close(back.abs().amax(-1, keepdim=True), amax)  # the largest: a code exactly
    assert (back[1, 2] == 0).all() and (take(entry, torch.tensor([3, 4])) == 0).all()
    # rows of one head: slot * heads + head, as the CPU backend gathers them
    torch.testing.assert_close(take(entry, slots * 3 + 1, 16), back[:, 1], rtol=0, atol=0)
    assert entry_bytes((3, 16), dtype) == 3 * 16 + 3 * 4


# (arch, tp, dp, extra): GQA and MLA; the CPU backend's matmuls and the reference backend; DP attention
# with MLA's multi-head prefill; sinks and gpt-oss's hybrid window pool; GLM-4.5's MTP layer drafting;
# the GPU's Triton kernels (in the interpreter here).
CASES = [
    ("llama", 1, 1, "fp8_e4m3", {}),
    ("deepseek_v3", 2, 2, "fp8_e4m3", {}),
    ("deepseek_v2", 1, 1, "fp8_e5m2", {"attention_backend": "sdpa"}),
    ("qwen3_moe", 4, 2, "fp8_e4m3", {}),
    ("gpt_oss", 2, 2, "fp8_e4m3", {"swa_full_tokens_ratio": 0.5}),
    ("glm4_moe_mtp", 2, 2, "fp8_e5m2", NEXTN),
    ("deepseek_v3", 1, 1, "fp8_e4m3", {"attention_backend": "triton", "dp_padding_mode": "sum_len"}),
]
FEW = 3  # prompts through Triton's interpreter, which is slow


@pytest.mark.parametrize("arch,tp,dp,kv,extra", CASES, ids=lambda v: str(v))
def test_8_bit_kv_cache_matches_transformers_with_its_cache_rounded(
    engine_cache, model_dirs, prompts, rounded_references, arch, tp, dp, kv, extra
):
    engine = engine_for(engine_cache, model_dirs, arch, tp, dp, kv_cache_dtype=kv, **extra)
    n = FEW if extra.get("attention_backend") == "triton" else len(prompts)
    outs = engine.generate(input_ids=prompts[:n], sampling_params=GREEDY, return_logprob=True)
    assert_matches_reference(outs, rounded_references[arch, kv][:n], atol=CODE_FLIP)


def test_8_bit_kv_cache_through_chunks_prefix_hits_and_retraction(
    engine_cache, model_dirs, prompts, rounded_references
):
    """Scales travel with their tokens: cached prefixes are read back, retracted requests recomputed,
    chunks of 8 tokens per group attend to the earlier chunks' codes."""
    engine = engine_cache.get(model_dirs["deepseek_v2"], **PRESSURE, kv_cache_dtype="fp8_e4m3")
    for outs in generate_under_pressure(engine, prompts):
        assert_matches_reference(outs, rounded_references["deepseek_v2", "fp8_e4m3"], atol=CODE_FLIP)


def test_8_bit_kv_cache_holds_twice_the_tokens(engine_cache, model_dirs):
    """A token of MLA's latent + rope key costs one byte per element and one float32 scale per layer
    in the 8-bit pool, and the same budget holds that many more tokens (the engines of the parity
    tests above and of tests/test_engine.py)."""
    hf = ModelConfig.load(model_dirs["deepseek_v3"]).hf
    layers, width = hf.num_hidden_layers, hf.kv_lora_rank + hf.qk_rope_head_dim
    auto = engine_info_for(engine_cache, model_dirs, "deepseek_v3", 2, 2)["dp_ranks"][0]
    fp8 = engine_info_for(engine_cache, model_dirs, "deepseek_v3", 2, 2, kv_cache_dtype="fp8_e4m3")[
        "dp_ranks"
    ][0]
    assert auto["kv_bytes_per_token"] in (2 * layers * width, 4 * layers * width)  # bfloat16 or float32
    assert fp8["kv_bytes_per_token"] == layers * (width + 4)
    for rank in (auto, fp8):
        assert rank["max_total_num_tokens"] == int(KV_BUDGET_GB * 2**30) // rank["kv_bytes_per_token"]
