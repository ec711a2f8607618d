"""dpserve.plan against the engine: at every layout the engine starts here, the planner's KV tokens
per group, KV bytes per token and weight bytes per rank equal what the started engine reports;
invalid layouts carry the engine's own reason; the --json schema; the pool agreed by all ranks."""

from __future__ import annotations

import json
import multiprocessing as mp

import pytest

from dpserve import Engine
from dpserve.engine.workers import free_port
from dpserve.memory import agree_min
from dpserve.plan.__main__ import main as plan_main
from dpserve.plan.layouts import Layout, layout_memory
from dpserve.plan.model import load
from dpserve.plan.report import SCHEMA

SMOLLM2 = "smollm2-135m-instruct"
KV_GB = 0.004

# (model, tp, dp, DP attention, kv_cache_memory_gb): every layout kind the engine can start here.
CASES = [
    ("deepseek_v2", 1, 1, False, None),  # the CPU default budget, through dpserve.memory
    ("deepseek_v2", 2, 2, True, KV_GB),
    ("deepseek_v3", 4, 2, True, KV_GB),
    ("deepseek_v2", 4, 4, True, KV_GB),
    ("llama", 2, 1, False, KV_GB),  # tp=2 without DP attention
    (SMOLLM2, 2, 2, True, KV_GB),
]


def _path(model_dirs, model: str) -> str:
    return model_dirs.get(model, model)


def planned(model_path: str, tp: int, dp: int, attn: bool, kv_gb: float | None, **extra):
    path, model_cfg = load(model_path)
    kwargs = {"kv_cache_memory_gb": kv_gb, "dtype": "float32", **extra}
    return layout_memory(Layout(tp, dp, attn), path, model_cfg, "cpu", 0, kwargs)


@pytest.mark.parametrize("model,tp,dp,attn,kv_gb", CASES, ids=lambda v: str(v))
def test_planner_memory_equals_engine(model_dirs, model, tp, dp, attn, kv_gb):
    assert_planned_memory(_path(model_dirs, model), tp, dp, attn, kv_gb)


def test_planner_memory_with_nextn():
    """NEXTN's MTP layer: its weights and one more layer of KV per token, as the engine holds them."""
    from dpserve.testing.trained_mtp import trained_mtp_model

    assert_planned_memory(str(trained_mtp_model()), 2, 2, True, KV_GB, speculative_algorithm="NEXTN")


def assert_planned_memory(path: str, tp: int, dp: int, attn: bool, kv_gb: float | None, **extra) -> None:
    mem = planned(path, tp, dp, attn, kv_gb, **extra)
    assert mem.valid, mem.error
    with Engine(
        model_path=path,
        tp_size=tp,
        dp_size=dp,
        enable_dp_attention=attn,
        device="cpu",
        dtype="float32",
        kv_cache_memory_gb=kv_gb,
        dp_padding_mode="sum_len",  # no start-up calibration: memory does not depend on the mode
        **extra,
    ) as engine:
        info = engine.get_server_info()
    assert len(info["dp_ranks"]) == mem.groups == dp
    for rank in info["dp_ranks"]:
        assert rank["max_total_num_tokens"] == mem.kv_tokens_per_group
        assert rank["kv_bytes_per_token"] == mem.kv_bytes_per_token
        assert rank["weight_bytes"] == mem.weight_bytes
    assert mem.kv_tokens_total == sum(r["max_total_num_tokens"] for r in info["dp_ranks"])


def _engine_error(path: str, tp: int, dp: int, attn: bool) -> str:
    with pytest.raises(ValueError) as err:
        Engine(model_path=path, tp_size=tp, dp_size=dp, enable_dp_attention=attn, device="cpu")
    return str(err.value)


@pytest.mark.parametrize(
    "model,tp,dp,attn",
    [
        (SMOLLM2, 2, 1, False),  # 9 attention heads over 2 ranks
        (SMOLLM2, 4, 2, True),
        ("deepseek_v2", 4, 3, True),  # dp does not divide tp
        ("llama", 3, 1, False),  # intermediate size 128 over 3 ranks
    ],
)
def test_invalid_layouts_carry_the_engines_reason(model_dirs, model, tp, dp, attn):
    path = _path(model_dirs, model)
    mem = planned(path, tp, dp, attn, KV_GB)
    assert not mem.valid
    assert mem.error == _engine_error(path, tp, dp, attn)


def test_json_schema(model_dirs, capsys):
    plan_main(
        ["--model-path", model_dirs["deepseek_v2"], "--device-profile", "h100", "--num-gpus", "4", "--json"]
        + ["--batch-size", "1", "8", "--tpot-ms", "50"]
    )
    out = json.loads(capsys.readouterr().out)
    assert out["schema"] == SCHEMA
    assert set(out) >= {
        "model",
        "arch",
        "num_gpus",
        "nnodes",
        "profile",
        "workload",
        "layouts",
        "recommendations",
    }
    names = [lay["name"] for lay in out["layouts"]]
    assert names == [
        "tp4",
        "tp2 x2 replicas",
        "tp1 x4 replicas",
        "tp4 dp2 dp-attn",
        "tp4 dp3 dp-attn",
        "tp4 dp4 dp-attn",
    ]
    keys = {
        "name", "flags", "tp", "dp", "dp_attention", "attn_tp", "valid", "fits", "reason",
        "weight_bytes_per_rank", "kv_bytes_per_token", "activation_bytes", "kv_budget_bytes",
        "kv_tokens_per_group", "groups", "kv_tokens_total", "max_concurrency", "prefill_chunk_tokens",
        "prefill_chunk_ms", "decode", "at_concurrency", "best_under_tpot",
    }  # fmt: skip
    for lay in out["layouts"]:
        assert set(lay) == keys
    bad = out["layouts"][4]
    assert not bad["valid"] and "divisible by dp_size=3" in bad["reason"]
    good = out["layouts"][3]
    assert good["valid"] and good["fits"] and good["reason"] is None
    assert [d["batch"] for d in good["decode"]] == [1, 8]
    assert set(good["decode"][0]) == {
        "batch",
        "step_ms",
        "tokens_per_s",
        "padding_mode",
        "mlp_rows",
        "parts_ms",
    }
    assert set(out["recommendations"]) == {"lowest_latency", "highest_throughput", "most_kv"}
    assert out["recommendations"]["most_kv"]["flags"].startswith("--tp")


def _agree(rank: int, port: int, values: list[int], queue) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=len(values))
    queue.put((rank, agree_min(values[rank], dist.group.WORLD)))
    dist.destroy_process_group()


def test_ranks_agree_on_the_smallest_pool():
    """Different per-rank budgets give one pool size for the instance (real gloo, two ranks)."""
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port, values = free_port(), [5000, 4321]
    procs = [ctx.Process(target=_agree, args=(r, port, values, queue)) for r in range(2)]
    for p in procs:
        p.start()
    got = dict(queue.get(timeout=60) for _ in procs)
    for p in procs:
        p.join(timeout=30)
    assert got == {0: 4321, 1: 4321}
    assert agree_min(77, None) == 77


def test_bundled_smollm2_config_matches_the_engines_conversion():
    """The bundled config (published numbers) gives the figures of the engine's own GGUF conversion."""
    for tp, dp, attn in [(1, 1, False), (4, 4, True)]:
        bundled, converted = (
            planned("smollm2-135m", tp, dp, attn, KV_GB),
            planned(SMOLLM2, tp, dp, attn, KV_GB),
        )
        assert (bundled.weight_bytes, bundled.kv_bytes_per_token, bundled.kv_tokens_per_group) == (
            converted.weight_bytes,
            converted.kv_bytes_per_token,
            converted.kv_tokens_per_group,
        )
