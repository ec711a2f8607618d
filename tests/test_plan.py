"""dpserve.plan against the engine: at every layout the engine starts here, the planner's KV tokens
per group, KV bytes per token and weight bytes per rank equal what the started engine reports;
invalid layouts carry the engine's own reason; the --json schema; the pool agreed by all ranks."""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import sys
from dataclasses import asdict
from datetime import datetime, timedelta, timezone

import pytest

from dpserve import Engine
from dpserve.config import EngineConfig
from dpserve.engine.worker_pool import free_port
from dpserve.memory import agree_min
from dpserve.plan import profiles
from dpserve.plan.__main__ import dry_run
from dpserve.plan.__main__ import main as plan_main
from dpserve.plan.layouts import Layout, LayoutMemory, layout_memory
from dpserve.plan.model import load
from dpserve.plan.planner import StepModel
from dpserve.plan.report import SCHEMA, _ranges

SMOLLM2 = "smollm2-135m-instruct"
KV_GB = 0.004

# (model, tp, dp, DP attention, kv_cache_memory_gb): every layout kind the engine can start here.
CASES = [
    ("deepseek_v2", 1, 1, False, None),  # the CPU default budget, through dpserve.memory
    ("deepseek_v2", 2, 2, True, KV_GB),
    ("deepseek_v3", 4, 2, True, KV_GB),
    ("deepseek_v2", 4, 4, True, KV_GB),
    ("llama", 2, 1, False, KV_GB),  # tp=2 without DP attention
    ("qwen3_moe", 4, 2, True, KV_GB),  # GQA + MoE: one KV head per attention-TP rank
    ("gpt_oss", 2, 2, True, KV_GB),  # sinks, biases (o's on one rank), fused experts with biases
    ("glm4_moe_mtp", 4, 4, True, KV_GB),  # q/k/v biases, shared expert, dense first layer
    ("deepseek_v32", 2, 2, True, KV_GB),  # the indexer's key cached beside the latent
    (SMOLLM2, 2, 2, True, KV_GB),
]


def _path(model_dirs, model: str) -> str:
    return model_dirs.get(model, model)


def planned(model_path: str, tp: int, dp: int, attn: bool, kv_gb: float | None, **extra):
    path, model_cfg = load(model_path, extra.get("quantization"))
    kwargs = {"kv_cache_memory_gb": kv_gb, "dtype": "float32", **extra}
    return layout_memory(Layout(tp, dp, attn), path, model_cfg, "cpu", 0, kwargs)


@pytest.mark.parametrize("model,tp,dp,attn,kv_gb", CASES, ids=lambda v: str(v))
def test_planner_memory_equals_engine(model_dirs, model, tp, dp, attn, kv_gb):
    assert_planned_memory(_path(model_dirs, model), tp, dp, attn, kv_gb)


def test_planner_memory_with_nextn():
    """NEXTN's MTP layer: its weights and one more layer of KV per token, as the engine holds them."""
    from dpserve.testing.trained_mtp import trained_mtp_model

    assert_planned_memory(str(trained_mtp_model()), 2, 2, True, KV_GB, speculative_algorithm="NEXTN")


def test_planner_memory_of_8_bit_checkpoints(model_dirs, tmp_path):
    """Block-FP8 weights and W8A8-INT8 quantized at load: the planner counts the bytes and scales a
    started engine holds. (Blocks of 16 divide every tp 2 part of the tiny model; a rank whose part
    starts inside a block holds the scales of one more block row or column per part than the
    planner's rank 0.)"""
    from dpserve.testing.tiny_models import quantize_fp8

    fp8 = str(quantize_fp8(model_dirs["deepseek_v3"], tmp_path / "fp8", (16, 16)))
    assert_planned_memory(fp8, 2, 2, True, KV_GB)
    assert_planned_memory(model_dirs["qwen3_moe"], 2, 1, False, KV_GB, quantization="w8a8_int8")


def test_deepseek_v3_in_fp8_fits_one_node_of_h200(capsys):
    """The seed's own deployment: the bundled DeepSeek-V3 is block FP8 as published, and tp8 dp8 DP
    attention fits 8 x H200 with KV room, and nothing in it is refused at start-up."""
    args = ["--model", "deepseek-v3", "--device", "cuda", "--device-profile", "h200", "--num-gpus", "8"]
    assert plan_main([*args, "--layout", "8:8:attn", "8:1", "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert plan["quantization"] == "fp8"
    assert not any("refused" in n for n in plan["notes"])
    dp8, tp8 = plan["layouts"]
    assert dp8["valid"] and tp8["valid"] and dp8["kv_tokens_per_group"] > 100_000
    # at least a byte per parameter (671 B over 8 ranks at tp8), far from bfloat16's two
    assert 671e9 / 8 < tp8["weight_bytes_per_rank"] < 1.05 * 671e9 / 8
    assert tp8["weight_bytes_per_rank"] < dp8["weight_bytes_per_rank"] < 0.75 * 141e9


def test_planner_memory_of_an_8_bit_kv_cache(model_dirs):
    """FP8 codes and a float32 scale per token and KV head, in the hybrid window pool (gpt-oss) and
    beside V3.2's indexer keys: the planner counts the bytes and tokens a started engine holds."""
    assert_planned_memory(model_dirs["gpt_oss"], 2, 2, True, KV_GB, kv_cache_dtype="fp8_e4m3")
    assert_planned_memory(model_dirs["deepseek_v32"], 2, 2, True, KV_GB, kv_cache_dtype="fp8_e5m2")


def test_an_8_bit_kv_cache_doubles_deepseek_v3s_tokens_on_h200(capsys):
    """tp8 dp8 on 8 x H200: an 8-bit KV cache holds 1152 / 580 times the tokens per group (MLA's
    576-wide latent + rope key per layer: 1 byte an element and a 4-byte scale, against bfloat16's
    2); the GPU's attention kernels read it."""
    args = ["--model", "deepseek-v3", "--device", "cuda", "--device-profile", "h200", "--num-gpus", "8"]
    figures = []
    for kv in ("auto", "fp8_e4m3"):
        assert plan_main([*args, "--layout", "8:8:attn", "--kv-cache-dtype", kv, "--json"]) == 0
        plan = json.loads(capsys.readouterr().out)
        figures.append(plan["layouts"][0])
    auto, fp8 = figures
    assert auto["kv_bytes_per_token"] == 61 * 576 * 2 and fp8["kv_bytes_per_token"] == 61 * 580
    assert fp8["kv_tokens_per_group"] == pytest.approx(auto["kv_tokens_per_group"] * 1152 / 580, rel=1e-4)
    assert not any("kv_cache_dtype" in n for n in plan["notes"])


def test_planner_memory_with_the_hybrid_window_pool(model_dirs):
    """gpt-oss's window layers in a pool of their own, a quarter of the full one (over the floor
    of 8 running requests' windows and a 16-token chunk per group): more tokens for the full layers
    from the same budget, as the engine holds them."""
    mem = assert_planned_memory(
        model_dirs["gpt_oss"],
        2,
        2,
        True,
        KV_GB,
        max_running_requests=16,
        chunked_prefill_size=32,
        swa_full_tokens_ratio=0.25,
    )
    assert mem.window_tokens_per_group == mem.kv_tokens_per_group // 4 > 8 * 8 + 16
    assert mem.kv_tokens_per_group > 1.5 * mem.tokens_without_hybrid


def assert_planned_memory(
    path: str, tp: int, dp: int, attn: bool, kv_gb: float | None, **extra
) -> LayoutMemory:
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
        assert rank["window_tokens"] == mem.window_tokens_per_group
        assert rank["kv_bytes_per_token"] == mem.kv_bytes_per_token
        assert rank["weight_bytes"] == mem.weight_bytes
    assert mem.kv_tokens_total == sum(r["max_total_num_tokens"] for r in info["dp_ranks"])
    return mem


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
    dp_attn = [f"tp4 dp{d} dp-attn{m}" for d in (2, 3, 4) for m in ("", " ep", " ep a2a")]
    assert names == ["tp4", "tp2 x2 replicas", "tp1 x4 replicas", *dp_attn]
    keys = {
        "name", "flags", "tp", "dp", "dp_attention", "attn_tp", "moe", "valid", "fits", "reason",
        "weight_bytes_per_rank", "kv_bytes_per_token", "activation_bytes", "kv_budget_bytes",
        "kv_tokens_per_group", "groups", "kv_tokens_total", "max_concurrency", "prefill_chunk_tokens",
        "prefill_chunk_ms", "prefill_chunk_comm_bytes", "decode", "at_concurrency", "best_under_tpot",
        "window_bytes_per_token", "window_tokens_per_group", "kv_tokens_per_group_without_hybrid",
    }  # fmt: skip
    for lay in out["layouts"]:
        assert set(lay) == keys
    bad = out["layouts"][6]
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
        "comm_bytes",
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


def _markdown_table(out: str) -> list[dict[str, str]]:
    lines = [line for line in out.splitlines() if line.startswith("| ")]
    cols = [c.strip() for c in lines[0].strip("|").split("|")]
    return [
        dict(zip(cols, (c.strip() for c in line.strip("|").split("|")), strict=True)) for line in lines[1:]
    ]


def test_tpot_target_sets_the_tables_figures(capsys):
    """With --tpot-ms the table shows, per layout, the largest concurrency whose step is within the
    target and its throughput; the recommendation quotes a figure of the table; --json the same."""
    base = ["--model", "deepseek-v2-lite", "--device-profile", "h100", "--num-gpus", "8"]
    plan_main([*base, "--markdown"])
    assert list(_markdown_table(capsys.readouterr().out)[0]) == [
        "layout",
        "weights/rank GiB",
        "KV B/token/rank",
        "KV tokens/group",
        "KV tokens total",
        "max conc",
        "step ms @1",
        "step ms @conc",
        "tok/s @conc",
        "mode @conc",
        "prefill chunk ms",
    ]  # fmt: skip: without a target, the columns of before

    plan_main([*base, "--tpot-ms", "8", "--markdown"])
    out = capsys.readouterr().out
    table = {row["layout"]: row for row in _markdown_table(out)}
    assert "tok/s @conc" not in table["tp8"]  # the most that fits, far over the target
    for row in table.values():
        assert float(row["step ms @TPOT"]) <= 8
    best = max(table.values(), key=lambda r: float(r["tok/s @TPOT"]))
    rec = f"({best['layout']}): {best['tok/s @TPOT']} tok/s at concurrency {best['conc @TPOT']} "
    assert rec in out

    plan_main([*base, "--tpot-ms", "8", "--json"])
    data = json.loads(capsys.readouterr().out)
    assert data["recommendations"]["highest_throughput"]["step"]["batch"] == int(best["conc @TPOT"])
    for lay in data["layouts"]:
        if lay["name"] in table:
            got = lay["best_under_tpot"]
            assert (str(got["batch"]), f"{got['tokens_per_s']:.0f}") == (
                table[lay["name"]]["conc @TPOT"],
                table[lay["name"]]["tok/s @TPOT"],
            )
    # the largest such batch: one more request takes longer than the target
    tp8 = table["tp8"]
    b = int(tp8["conc @TPOT"])
    plan_main([*base, "--layout", "8:1", "--batch-size", str(b), str(b + 1), "--json"])
    steps = json.loads(capsys.readouterr().out)["layouts"][0]["decode"]
    assert steps[0]["step_ms"] <= 8 < steps[1]["step_ms"]


def test_indivisible_dp_summarised_in_one_line(capsys):
    """DP attention layouts whose dp does not divide tp: one line; other reasons keep their own."""
    assert _ranges([3, 5, 6, 7, 9, 10, 11, 12, 13, 14, 15]) == "3, 5-7, 9-15"
    assert _ranges([3, 5, 6]) == "3, 5, 6"
    plan_main(["--model", "smollm2-135m", "--device-profile", "h100", "--num-gpus", "8"])
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("not possible")]
    assert "not possible: dp 3, 5-7: tp 8 must be divisible by dp (attention TP = tp / dp)" in lines
    assert not any("dp3" in line for line in lines)
    # 9 attention heads over 2, 4 or 8 ranks: the engine's reason, per layout
    assert any(line.startswith("not possible: tp8: num_attention_heads=9") for line in lines)


def _fake_cpu_profile() -> profiles.DeviceProfile:
    return profiles.DeviceProfile(
        name="cpu", device="cpu", memory_bytes=0, mem_bw=10e9, flops=100e9, intra_bw=1e9,
        intra_alpha=100e-6, inter_bw=1e9, inter_alpha=100e-6, cores=os.cpu_count() or 1, op_overhead=5e-6,
    )  # fmt: skip


@pytest.fixture
def cpu_cache(tmp_path, monkeypatch):
    """A cpu profile cache in tmp_path, measured by a fake: returns the list of measurements made."""
    monkeypatch.setenv("DPSERVE_CACHE", str(tmp_path))
    measured = []

    def measure():
        measured.append(1)
        return _fake_cpu_profile()

    monkeypatch.setattr(profiles, "measure_cpu", measure)
    return measured


def _rewrite_cache(**provenance) -> None:
    path = profiles.cpu_profile_path()
    data = json.loads(path.read_text())
    data["provenance"].update(provenance)
    path.write_text(json.dumps(data))


def test_cpu_profile_remeasured_when_stale_or_foreign(cpu_cache, monkeypatch, capsys):
    monkeypatch.setattr(os, "getloadavg", lambda: (0.25, 0.0, 0.0))
    profiles.get_profile("cpu")
    assert len(cpu_cache) == 1
    prov = json.loads(profiles.cpu_profile_path().read_text())["provenance"]
    assert prov["load"] == 0.25 and prov["cores"] == os.cpu_count()
    assert set(prov) == {"measured_at", "load", "cores", "torch", "cpu_model"}
    profiles.get_profile("cpu")
    assert len(cpu_cache) == 1  # fresh and from this machine: reused
    old = datetime.now(timezone.utc) - profiles.MAX_AGE - timedelta(hours=1)
    _rewrite_cache(measured_at=old.isoformat())
    profiles.get_profile("cpu")
    assert len(cpu_cache) == 2 and "days old" in capsys.readouterr().err
    _rewrite_cache(torch="1.0.0")
    profiles.get_profile("cpu")
    assert len(cpu_cache) == 3 and "torch '1.0.0'" in capsys.readouterr().err
    # a cache of before provenance was recorded
    path = profiles.cpu_profile_path()
    path.write_text(json.dumps(asdict(_fake_cpu_profile()) | {"provenance": {}}))
    profiles.get_profile("cpu")
    assert len(cpu_cache) == 4
    profiles.get_profile("cpu", remeasure=True)
    assert len(cpu_cache) == 5


@pytest.mark.parametrize("load_per_core", [0.1, 0.9])
def test_cpu_profile_provenance_printed(cpu_cache, monkeypatch, capsys, load_per_core):
    cores = os.cpu_count() or 1
    monkeypatch.setattr(os, "getloadavg", lambda: (load_per_core * cores, 0.0, 0.0))
    plan_main(["--model", "smollm2-135m", "--device-profile", "cpu", "--layout", "1:1", "--markdown"])
    out = capsys.readouterr().out.splitlines()
    when = datetime.now(timezone.utc).strftime("%Y-%m-%d")
    assert out[0].startswith(f"cpu profile measured {when} ")
    assert out[0].endswith(
        f" UTC, load {load_per_core * cores:.1f} on {cores} cores; --remeasure to measure again"
    )
    busy = out[1].startswith("warning: the machine was busy")
    assert busy == (load_per_core > 0.5)
    assert out[1 + busy].startswith("smollm2-135m")  # then the table


def test_plot_without_matplotlib(monkeypatch, capsys, tmp_path):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib raises ImportError
    argv = ["--model", "smollm2-135m", "--device-profile", "h100", "--plot", str(tmp_path / "p.png")]
    assert plan_main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "pip install matplotlib" in err


def test_layout_syntax_rejected(capsys):
    for spec in ("8-2", "8:2:atn", "8", "8:2:attn:a2a", "8:2:ep:attn"):
        with pytest.raises(SystemExit) as exit_:
            plan_main(["--model", "deepseek-v3", "--layout", spec])
        assert exit_.value.code == 2
        assert f"'{spec}': expected TP:DP[:attn][:ep|:ep-a2a], e.g. 8:2:attn" in capsys.readouterr().err


def test_dry_run_of_an_impossible_layout(capsys):
    """launch_server --dry-run: exit code 2 and the engine's reason; a bundled name as --model-path."""
    too_big = EngineConfig(model_path="deepseek-v3", tp_size=8)
    assert dry_run(too_big, "h100") == 2
    out, err = capsys.readouterr()
    assert out == "" and "--tp 8 --dp 1 cannot run deepseek-v3: does not fit: weights" in err
    heads = EngineConfig(model_path="smollm2-135m", tp_size=2)
    assert dry_run(heads, "h100") == 2
    assert "num_attention_heads=9 is not divisible by 2" in capsys.readouterr().err
    ok = EngineConfig(model_path="deepseek-v2-lite", tp_size=8, dp_size=8, enable_dp_attention=True)
    assert dry_run(ok, "h100") == 0
    assert "tp8 dp8 dp-attn" in capsys.readouterr().out


def test_sparse_attention_shortens_long_context_decode_steps():
    """DeepSeek-V3.2 against V3 on the same layout: about the same step at 8k tokens of context
    (the indexer's cost beside 2,048 chosen keys), shorter at 128k (MLA reads index_topk keys, not
    all); its indexer keys make each token's KV 22% larger."""
    prof = profiles.get_profile("h200")
    steps, kv = {}, {}
    for name in ("deepseek-v3", "deepseek-v3.2"):
        path, cfg = load(name)
        kwargs = {"nnodes": 2, "dist_init_addr": "node0:29500"}
        mem = layout_memory(Layout(16, 8, True), path, cfg, "cuda", prof.memory_bytes, kwargs)
        model = StepModel(mem, cfg, prof, 2, "engine")
        steps[name] = [model.decode(64, ctx).seconds for ctx in (8192, 131072)]
        kv[name] = mem.kv_bytes_per_token
    assert abs(steps["deepseek-v3.2"][0] / steps["deepseek-v3"][0] - 1) < 0.05
    assert steps["deepseek-v3.2"][1] < 0.8 * steps["deepseek-v3"][1]
    assert kv["deepseek-v3.2"] / kv["deepseek-v3"] == (512 + 64 + 128) / (512 + 64)


@pytest.mark.parametrize(
    "model,decode,per_token",
    [
        ("deepseek-v2-lite", "2:2:attn", 27 * 576 * 2),  # MLA: one latent per rank, attention TP 1
        ("qwen3-30b-a3b", "4:1", 48 * 2 * 4 * 128 * 2),  # GQA: 4 ranks with one KV head each
        ("gpt-oss-20b", "8:1", None),  # the hybrid pool: window layers receive the last 127 only
    ],
)
def test_pd_mode_counts_the_kv_each_request_moves(capsys, model, decode, per_token):
    flags = ["--model", model, "--device", "cuda", "--device-profile", "h100", "--json"]
    args = [
        *flags,
        "--pd",
        "2:1",
        decode,
        "--input-len",
        "1000",
        "--output-len",
        "100",
        "--request-rate",
        "4",
    ]
    assert plan_main(args) == 0
    out = json.loads(capsys.readouterr().out)
    # gpt-oss-20b: 12 full and 12 window layers, one KV head of 64 per rank, over 8 ranks.
    moved = 8 * (1000 + 127) * 12 * 2 * 64 * 2 if per_token is None else 1000 * per_token
    t, p, d = out["transfer"], out["prefill"], out["decode"]
    assert t["bytes_per_request"] == moved
    groups = int(decode.split(":")[1])
    per_rank = moved / (int(decode.split(":")[0]) // groups)
    assert t["rank_bytes_per_s"] == pytest.approx(4 / groups * per_rank)
    assert t["link_share"] == pytest.approx(t["rank_bytes_per_s"] / profiles.get_profile("h100").inter_bw)
    assert p["requests_per_s"] * p["prefill_ms_per_request"] / 1e3 == pytest.approx(1)  # one group
    assert d["requests_per_s"] > 0 and d["max_concurrency"] > 0


def test_pd_mode_names_a_side_that_cannot_run(capsys):
    args = [
        "--model",
        "deepseek-v2-lite",
        "--device",
        "cuda",
        "--device-profile",
        "h100",
        "--pd",
        "2:1",
        "3:2:attn",
    ]
    assert plan_main(args) == 2
    assert "the decode layout tp3 dp2 dp-attn cannot run" in capsys.readouterr().err


def test_redundant_experts_cost_weights_and_kv(capsys):
    """--ep-num-redundant-experts: each rank holds (E + R) / T experts; the planner counts their
    weights exactly (DeepSeek-V3 at tp16 ep16, R = 32: two more experts per rank in each of the 58
    MoE layers) and the KV they displace; a layout without expert parallelism names why it cannot."""
    out = {}
    for r in (0, 32):
        args = ["--model", "deepseek-v3", "--device", "cuda", "--device-profile", "h200", "--num-gpus", "16"]
        args += ["--nnodes", "2", "--layout", "16:16:attn:ep", "16:16:attn", "--json"]
        assert plan_main([*args, "--ep-num-redundant-experts", str(r)]) == 0
        out[r] = json.loads(capsys.readouterr().out)["layouts"]
    ep = {r: out[r][0] for r in out}
    # block FP8 as published: 1 byte per element, a float32 scale per 128 x 128 block (2688 per expert)
    expert = 3 * 7168 * 2048 + 4 * (2 * 16 * 56 + 56 * 16)
    assert ep[32]["weight_bytes_per_rank"] - ep[0]["weight_bytes_per_rank"] == 2 * 58 * expert
    assert ep[32]["kv_tokens_per_group"] < ep[0]["kv_tokens_per_group"]
    assert not out[32][1]["valid"] and "they need ep_size=tp_size > 1 (got ep_size=1" in out[32][1]["reason"]
