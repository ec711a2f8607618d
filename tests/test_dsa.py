"""DeepSeek-V3.2's sparse attention (dpserve/models/dsa.py) on a tiny random deepseek_v32 checkpoint
whose index_topk (8) is shorter than the prompts, so that prefill and decode both attend to the
indexer's choice (its greedy parity in every layout: test_families.py): the indexer's key cache
lives in the pool beside the latent, counted with it, chunked, prefix-cached and retracted with it."""

from __future__ import annotations

import pytest
import torch
from conftest import GREEDY, KV_BUDGET_GB, PRESSURE, assert_matches_reference, generate_under_pressure

from dpserve.attention.sdpa import SdpaBackend
from dpserve.attention.triton_backend import TritonBackend
from dpserve.kvcache.pool import KVPool
from dpserve.models.config import ModelConfig
from dpserve.testing.reference import hf_greedy_reference


@pytest.fixture(scope="module")
def v32(model_dirs) -> str:
    return model_dirs["deepseek_v32"]


@pytest.fixture(scope="module")
def v32_refs(v32, prompts):
    return hf_greedy_reference(v32, prompts, GREEDY["max_new_tokens"])


def test_prompts_are_sparse(v32, prompts):
    cfg = ModelConfig.load(v32)
    assert (cfg.family, cfg.declaration.sparse_attention, cfg.hf.index_topk) == ("deepseek_v32", True, 8)
    assert sum(len(p) > cfg.hf.index_topk for p in prompts) >= len(prompts) - 1


def test_indexer_keys_are_counted_with_the_latent(engine_cache, v32):
    """Per token and layer the pool holds the latent (kv_lora_rank + rope) and the indexer key,
    float32, at the same slot (the engine test_families.py checks at (2,2) against transformers)."""
    info = engine_cache.info(
        v32,
        tp_size=2,
        dp_size=2,
        enable_dp_attention=True,
        ep_size=1,
        moe_a2a_backend="none",
        kv_cache_memory_gb=KV_BUDGET_GB,
    )
    hf = ModelConfig.load(v32).hf
    per_token = hf.num_hidden_layers * (hf.kv_lora_rank + hf.qk_rope_head_dim + hf.index_head_dim) * 4
    assert {r["kv_bytes_per_token"] for r in info["dp_ranks"]} == {per_token}


def test_chunks_prefix_hits_and_retraction(engine_cache, v32, v32_refs, prompts):
    """Chunks of 8 tokens per group (each chunk's queries see the earlier chunks' keys through the
    indexer), every prompt twice side by side (prefix-cache hits: cached indexer keys), a pool small
    enough to retract: the same tokens."""
    for outs in generate_under_pressure(engine_cache.get(v32, **PRESSURE), prompts):
        assert_matches_reference(outs, v32_refs)


def test_sparse_mla_on_the_paged_kernels(engine_cache, v32, v32_refs, prompts):
    """The selection runs through the backend's own MLA as one-query requests: the GPU's Triton
    decode kernel (in the interpreter here) over only the chosen slots, prefill and decode alike
    (three prompts: the interpreter is slow)."""
    engine = engine_cache.get(
        v32, attention_backend="triton", dp_padding_mode="sum_len", kv_cache_memory_gb=KV_BUDGET_GB
    )
    outs = engine.generate(input_ids=prompts[:3], sampling_params=GREEDY, return_logprob=True)
    assert_matches_reference(outs, v32_refs[:3])


@pytest.mark.parametrize(
    "dtype,cache_dtype", [(torch.float32, None), (torch.bfloat16, None), (torch.float32, torch.float8_e4m3fn)]
)
def test_index_kernel_equals_the_torch_path(dtype, cache_dtype):
    """The Triton indexer scores (in the interpreter) against the torch path on shuffled pool slots:
    prefill and decode queries, a chunk after a prefix, a padded one-token row, heads and dims that
    are not powers of two, a table wider than any request; -inf exactly where the query may not look;
    an 8-bit pool's keys read in place."""
    g = torch.Generator().manual_seed(0)
    seq_lens, q_lens, width, heads, dim = [70, 5, 33, 1], [70, 1, 9, 1], 96, 6, 40
    slots = torch.randperm(sum(seq_lens), generator=g) + 1
    table = torch.zeros(len(seq_lens), width, dtype=torch.long)
    used = 0
    for b, n in enumerate(seq_lens):
        table[b, :n] = slots[used : used + n]
        used += n
    token_req = torch.repeat_interleave(torch.arange(len(seq_lens)), torch.tensor(q_lens))
    q_pos = torch.cat([torch.arange(s - q, s) for s, q in zip(seq_lens, q_lens, strict=True)])
    n = len(q_pos)
    q = torch.randn(n, heads, dim, generator=g)
    weights = torch.randn(n, heads, generator=g)
    keys = torch.randn(sum(seq_lens) + 1, dim, generator=g).to(dtype)
    if cache_dtype is not None:
        pool = KVPool(1, sum(seq_lens), [(dim,)], dtype, torch.device("cpu"), cache_dtype=cache_dtype)
        pool.write(0, torch.arange(len(keys)), keys)
        keys = pool.layers[0][0]
    args = (q, weights, keys, table, token_req, q_pos, torch.tensor(seq_lens, dtype=torch.int32), dim**-0.5)
    ref = SdpaBackend().index_scores(*args)
    got = TritonBackend().index_scores(*args)
    assert torch.equal(torch.isinf(got), torch.isinf(ref))
    assert int(torch.isfinite(ref).sum()) == sum(
        s - q + i + 1 for s, q in zip(seq_lens, q_lens, strict=True) for i in range(q)
    )
    torch.testing.assert_close(got, ref, atol=1e-4, rtol=1e-4)
