"""Shared fixtures: tiny checkpoints written once per session, and engines reused across tests.

Engines are expensive (one process per rank), so `engine_cache` keeps the most recently
used one alive and shuts it down when a test asks for a different configuration; tests
that share an engine sit next to each other.
"""

from __future__ import annotations

from collections import Counter

import httpx
import pytest
from torch.utils._python_dispatch import TorchDispatchMode

from dpserve import Engine
from dpserve.testing.reference import hf_greedy_reference, random_prompts
from dpserve.testing.tiny_models import write_tiny_model

ARCHS = ("deepseek_v2", "deepseek_v3", "llama")
# The other families' tiny checkpoints (their references in test_families.py and test_dsa.py).
FAMILY_ARCHS = (
    "kimi_k2",
    "qwen3",
    "qwen3_moe",
    "glm4_moe_mtp",
    "gpt_oss",
    "deepseek_v32",
)
KV_BUDGET_GB = 0.002  # the same per-rank KV budget for every parity engine
NEW_TOKENS = 16
GREEDY = {"max_new_tokens": NEW_TOKENS, "temperature": 0.0, "ignore_eos": True}


@pytest.fixture(scope="session")
def model_dirs(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("models")
    # DeepseekV3 is written as a sharded checkpoint so the index path is exercised too.
    shard = {"deepseek_v3": "100KB"}
    return {
        a: str(write_tiny_model(a, root / a, seed=0, shard_size=shard.get(a))) for a in ARCHS + FAMILY_ARCHS
    }


@pytest.fixture(scope="session")
def prompts(model_dirs) -> list[list[int]]:
    return random_prompts(vocab_size=301, n=6, seed=1)


@pytest.fixture(scope="session")
def references(model_dirs, prompts) -> dict:
    return {a: hf_greedy_reference(model_dirs[a], prompts, NEW_TOKENS) for a in ARCHS}


class EngineCache:
    def __init__(self) -> None:
        self.key = None
        self.engine: Engine | None = None
        self.server_info: dict = {}  # key -> get_server_info() of every engine built

    def get(self, model_path: str, **kwargs) -> Engine:
        key = self._key(model_path, kwargs)
        if key != self.key:
            self.close()
            self.engine = Engine(model_path=model_path, device="cpu", dtype="float32", **kwargs)
            self.key = key
            self.server_info[key] = self.engine.get_server_info()
        return self.engine

    def info(self, model_path: str, **kwargs) -> dict:
        """get_server_info() of the engine with these arguments; built only if no test built it yet."""
        key = self._key(model_path, kwargs)
        if key not in self.server_info:
            self.get(model_path, **kwargs)
        return self.server_info[key]

    @staticmethod
    def _key(model_path: str, kwargs: dict) -> tuple:
        return model_path, tuple(sorted(kwargs.items()))

    def close(self) -> None:
        if self.engine is not None:
            self.engine.shutdown()
        self.engine, self.key = None, None


@pytest.fixture(scope="session")
def engine_cache():
    cache = EngineCache()
    yield cache
    cache.close()


SMALL_POOL = 96  # KV tokens per DP group of the engines that exercise memory pressure
# (2,2) DP attention under memory pressure: chunks of 8 tokens per group, a pool small enough to
# retract, requests dealt round robin.
PRESSURE = {
    "tp_size": 2,
    "dp_size": 2,
    "enable_dp_attention": True,
    "chunked_prefill_size": 16,
    "max_total_tokens": SMALL_POOL,
    "load_balance_method": "round_robin",
}


def generate_under_pressure(engine: Engine, prompts: list[list[int]]) -> list[list[dict]]:
    """Every prompt twice side by side (the second pass hits the prefix cache) on a PRESSURE engine:
    each pass's greedy outputs with logprobs, once the engine is seen to retract and reuse cached
    tokens."""
    before = sum(m["retractions"] for m in engine.get_metrics())
    outs = engine.generate(input_ids=prompts * 2, sampling_params=GREEDY, return_logprob=True)
    assert sum(m["retractions"] for m in engine.get_metrics()) > before
    assert sum(o["meta_info"]["cached_tokens"] for o in outs) > 0
    return [outs[: len(prompts)], outs[len(prompts) :]]


def engine_for(engine_cache, model_dirs, arch: str, tp: int, dp: int, **kwargs) -> Engine:
    """The tiny `arch` model at (tp, dp), with DP attention when dp > 1 and the parity KV budget
    (unless `max_total_tokens` sets the pool)."""
    return engine_cache.get(model_dirs[arch], **_layout_kwargs(tp, dp, kwargs))


def engine_info_for(engine_cache, model_dirs, arch: str, tp: int, dp: int, **kwargs) -> dict:
    """`engine_for(...).get_server_info()`, without a start when an earlier test built that engine."""
    return engine_cache.info(model_dirs[arch], **_layout_kwargs(tp, dp, kwargs))


def _layout_kwargs(tp: int, dp: int, kwargs: dict) -> dict:
    if "max_total_tokens" not in kwargs:
        kwargs.setdefault("kv_cache_memory_gb", KV_BUDGET_GB)
    return dict(tp_size=tp, dp_size=dp, enable_dp_attention=dp > 1, **kwargs)


def small_pool_engine(engine_cache, model_dirs, tp: int = 2, dp: int = 2, **kwargs) -> Engine:
    """DeepseekV2 with DP attention, a KV pool of SMALL_POOL tokens per group and prefill chunks of 16."""
    return engine_for(
        engine_cache,
        model_dirs,
        "deepseek_v2",
        tp,
        dp,
        max_total_tokens=SMALL_POOL,
        chunked_prefill_size=16 * dp,  # 16 per group (SGLang divides it among DP-attention groups)
        **kwargs,
    )


def assert_matches_reference(outputs: list[dict], refs, atol: float = 1e-4) -> None:
    """Same greedy tokens as transformers and logprobs within `atol`, up to each reference's
    first numerically ambiguous step."""
    compared = 0
    for i, (out, ref) in enumerate(zip(outputs, refs, strict=True)):
        n = ref.compare_len
        assert out["output_ids"][:n] == ref.output_ids[:n], f"prompt {i}: tokens differ"
        lps = out["meta_info"]["output_token_logprobs"][:n]
        for step, (a, b) in enumerate(zip(lps, ref.logprobs[:n], strict=True)):
            assert abs(a - b) < atol, f"prompt {i} step {step}: logprob {a} vs {b}"
        compared += n
    # Most prompts must be compared over all tokens, or the test would prove little.
    assert compared >= 0.75 * len(refs) * NEW_TOKENS


def metrics(server) -> dict[str, float]:
    """A server's /metrics: every sample, by its name and labels."""
    text = httpx.get(f"{server.url}/metrics").text
    return {
        k: float(v)
        for k, v in (line.rsplit(" ", 1) for line in text.splitlines() if not line.startswith("#"))
    }


def http_outputs(answers: list[dict]) -> list[dict]:
    """A /generate batch's answers with the offline Engine's logprobs (what the reference takes)."""
    return [
        {
            "output_ids": o["output_ids"],
            "meta_info": {"output_token_logprobs": [e[0] for e in o["meta_info"]["output_token_logprobs"]]},
        }
        for o in answers
    ]


def assert_expert_load(engine, steps) -> None:
    """Every MoE layer counted top_k choices of every real row the steps ran (padding excluded), and
    every step logged its imbalance (the busiest rank's rows over the mean, >= 1)."""
    top_k = engine.model_cfg.hf.num_experts_per_tok
    load = engine.get_expert_load()
    real = sum(s.real_rows for s in steps)
    assert load and all(sum(layer) == top_k * real for layer in load), (real, [sum(x) for x in load])
    assert all(s.expert_imbalance >= 1.0 for s in steps)


class CountOps(TorchDispatchMode):
    """Counts the aten ops run inside it, by name (what a step costs in ops, or which ops it avoids)."""

    def __init__(self):
        super().__init__()
        self.calls: Counter[str] = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.calls[func.overloadpacket.__name__] += 1
        return func(*args, **(kwargs or {}))
