"""Expert parallelism under DP attention (docs/design.md, section 3): whole experts per rank, rows
reaching them by the gathered path (`none`) or by all-to-all dispatch, in every layout and padding
mode where the data flow differs, against transformers' greedy tokens; the DP LM head and
replicated dense layers; the fixed-capacity dispatch under a routing that sends every row to one
rank; start-up errors. In every layout the planner's memory figures and the bytes each rank sent in
every step (counted by the engine's collectives) equal the planner's."""

from __future__ import annotations

import json
import re
from dataclasses import fields

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from conftest import GREEDY, SMALL_POOL, assert_expert_load, assert_matches_reference, engine_for

from dpserve import Engine
from dpserve.config import EngineConfig
from dpserve.engine.worker_pool import free_port
from dpserve.layers.ep_dispatch import dispatch_combine
from dpserve.models.config import ModelConfig
from dpserve.plan.comm import ID_BYTES, forward_bytes, logged_layout
from dpserve.plan.layouts import Layout, layout_memory, meta_model, moe_placement
from dpserve.testing.reference import hf_greedy_reference
from dpserve.testing.trained_mtp import synthetic_sequences, trained_mtp_model

# (arch, tp, dp, options): every (tp, dp, ep) the issue names, each dispatch path in both padding
# modes, padded (fixed capacity) and unpadded (exchanged counts) steps, one and A > 1 ranks per group.
CASES = [
    ("deepseek_v2", 2, 2, dict(moe_a2a_backend="all_to_all", dp_padding_mode="sum_len")),
    ("deepseek_v3", 4, 2, dict(moe_a2a_backend="all_to_all", dp_padding_mode="max_len")),
    (
        "deepseek_v3",
        4,
        4,
        dict(moe_a2a_backend="all_to_all", dp_padding_mode="sum_len", disable_cuda_graph=True),
    ),
    ("deepseek_v2", 4, 4, dict(moe_a2a_backend="none", dp_padding_mode="max_len")),
    ("deepseek_v3", 2, 2, dict(moe_a2a_backend="none", dp_padding_mode="sum_len")),
    ("deepseek_v2", 4, 2, dict(moe_a2a_backend="none", dp_padding_mode="sum_len")),
    # The DP LM head and replicated dense layers beside each dispatch path.
    (
        "deepseek_v2",
        4,
        2,
        dict(
            moe_a2a_backend="all_to_all",
            enable_dp_lm_head=True,
            moe_dense_tp_size=1,
            dp_padding_mode="sum_len",
        ),
    ),
    (
        "deepseek_v2",
        4,
        4,
        dict(moe_a2a_backend="none", enable_dp_lm_head=True, moe_dense_tp_size=1, dp_padding_mode="max_len"),
    ),
]


@pytest.mark.parametrize(
    "arch,tp,dp,options", CASES, ids=[f"{a}-{t}-{d}-{i}" for i, (a, t, d, _) in enumerate(CASES)]
)
def test_ep_greedy_matches_reference(engine_cache, model_dirs, prompts, references, arch, tp, dp, options):
    engine = engine_for(engine_cache, model_dirs, arch, tp, dp, ep_size=tp, **options)
    engine.get_step_log()
    engine.get_expert_load()
    outputs = engine.generate(input_ids=prompts, sampling_params=GREEDY, return_logprob=True)
    assert_matches_reference(outputs, references[arch])
    logs = engine.get_step_log()
    assert any(s.padded for s in logs[0]) != options.get("disable_cuda_graph", False)
    assert_expert_load(engine, logs[0])  # every group logs every step
    assert_comm_bytes_planned(engine, logs)
    assert_memory_planned(engine)
    # One request alone: the other groups join every dispatch with zero rows.
    alone = engine.generate(input_ids=prompts[1], sampling_params=GREEDY, return_logprob=True)
    assert alone["output_ids"] == outputs[1]["output_ids"]
    # Prompts sharing a cached beginning with those above, then diverging.
    diverging = [p[: len(p) // 2] + [7, 8, 9] for p in prompts[:3]]
    again = engine.generate(input_ids=diverging, sampling_params=GREEDY, return_logprob=True)
    assert sum(o["meta_info"]["cached_tokens"] for o in again) > 0
    assert_matches_reference(
        again, hf_greedy_reference(model_dirs[arch], diverging, len(outputs[0]["output_ids"]))
    )


def assert_memory_planned(engine) -> None:
    """The planner's weights per rank, KV bytes per token and KV tokens per group of this EP layout
    equal the started engine's (as tests/test_plan.py checks for TP MoE)."""
    cfg = engine.cfg
    layout = Layout(
        cfg.tp_size, cfg.dp_size, cfg.enable_dp_attention, moe_placement(cfg.ep_size, cfg.moe_a2a_backend)
    )
    planned = (
        "model_path",
        "tp_size",
        "dp_size",
        "enable_dp_attention",
        "ep_size",
        "moe_a2a_backend",
        "device",
    )
    options = {f.name: getattr(cfg, f.name) for f in fields(cfg) if f.name not in planned}
    mem = layout_memory(layout, cfg.model_path, engine.model_cfg, "cpu", 0, options)
    assert mem.valid, mem.error
    for rank in engine.get_server_info()["dp_ranks"]:
        assert rank["weight_bytes"] == mem.weight_bytes
        assert rank["kv_bytes_per_token"] == mem.kv_bytes_per_token
        assert rank["max_total_num_tokens"] == mem.kv_tokens_per_group


def assert_comm_bytes_planned(engine, logs) -> None:
    """The bytes each group leader counted in every step equal the planner's, collective by
    collective. all_to_all's unpadded steps move the pairs their routing sends to other ranks, which
    the planner cannot know: with every rank a leader, the counted bytes over the ranks exceed the
    planner's without any such pair by a whole number of pairs (each out with its id, and back)."""
    cfg = engine.cfg
    model = meta_model(engine.model_cfg, cfg)
    a = cfg.attn_tp_size
    pair = 2 * cfg.torch_dtype.itemsize * engine.model_cfg.hidden_size + ID_BYTES
    for steps in zip(*logs, strict=True):
        counted, planned = [], []
        for g, s in enumerate(steps):
            counted.append(s.comm_bytes)
            planned.append(forward_bytes(model, logged_layout(s, g, a), dispatched=(0, 0)))
        if cfg.moe_a2a_backend == "all_to_all" and not steps[0].padded:
            extra = sum(counted) - sum(planned)
            assert extra >= 0 and (a > 1 or extra % pair == 0), (counted, planned)
        else:
            assert counted == planned, steps[0]


def test_ep_with_retraction(engine_cache, model_dirs, prompts, references):
    """A pool several times too small: requests retracted and resumed under all_to_all dispatch."""
    engine = engine_for(
        engine_cache,
        model_dirs,
        "deepseek_v2",
        2,
        2,
        ep_size=2,
        moe_a2a_backend="all_to_all",
        max_total_tokens=SMALL_POOL,
        chunked_prefill_size=32,  # 16 per group
        load_balance_method="round_robin",
    )
    outputs = engine.generate(input_ids=prompts * 3, sampling_params=GREEDY, return_logprob=True)
    for k in range(3):
        assert_matches_reference(
            outputs[k * len(prompts) : (k + 1) * len(prompts)], references["deepseek_v2"]
        )
    assert sum(m["retractions"] for m in engine.get_metrics()) > 0


def test_ep_without_dp_attention(engine_cache, model_dirs, prompts, references):
    """--ep-size 2 on plain TP ranks: each rank runs half the experts on every row."""
    engine = engine_for(engine_cache, model_dirs, "deepseek_v3", 2, 1, ep_size=2)
    engine.get_step_log()
    outputs = engine.generate(input_ids=prompts, sampling_params=GREEDY, return_logprob=True)
    assert_matches_reference(outputs, references["deepseek_v3"])
    assert_comm_bytes_planned(engine, engine.get_step_log())


def test_ep_with_nextn_and_live_rebalancing(engine_cache, tmp_path):
    """NEXTN's MTP layer is a MoE layer too: expert-parallel with all_to_all dispatch in its forwards,
    with redundant slots rebalanced while generating (every 2 steps, the MTP layer's experts by its
    own load); the load it records (an MTP row after the layers') is a start placement for NEXTN."""
    path = str(trained_mtp_model())
    prompts = [synthetic_sequences(1, n, seed=100 + i)[0] for i, n in enumerate((5, 41, 17))]
    options = dict(
        tp_size=2,
        dp_size=2,
        enable_dp_attention=True,
        ep_size=2,
        moe_a2a_backend="all_to_all",
        speculative_algorithm="NEXTN",
        ep_num_redundant_experts=2,
    )
    engine = engine_cache.get(
        path, **options, max_total_tokens=2048, enable_eplb=True, eplb_rebalance_num_iterations=2
    )
    engine.get_step_log(), engine.get_expert_load()
    outputs = engine.generate(input_ids=prompts, sampling_params=GREEDY, return_logprob=True)
    assert_matches_reference(outputs, hf_greedy_reference(path, prompts, len(outputs[0]["output_ids"])))
    meta = [o["meta_info"] for o in outputs]
    assert sum(m["completion_tokens"] for m in meta) > 1.5 * sum(m["spec_verify_ct"] for m in meta)
    rebalances = [s.rebalance for s in engine.get_step_log()[0] if s.rebalance is not None]
    assert len(rebalances) >= 2 and sum(r.bytes_moved for r in rebalances) > 0
    load = engine.get_expert_load()
    model_cfg = ModelConfig.load(path)
    assert len(load) == model_cfg.num_layers - len(model_cfg.dense_layers) + 1  # the MTP layer's last
    location = tmp_path / "load.jsonl"
    location.write_text(json.dumps({"rows_per_expert": load}) + "\n")
    cfg = EngineConfig(path, **options, init_expert_location=str(location))
    placement = model_cfg.expert_placement(cfg)
    assert placement.phy_to_log.shape[0] == len(load)


def _dispatch_rank(rank: int, world: int, port: int, results) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(rank)
    experts, top_k, m, hidden = 16, 3, 5, 6
    per_rank = experts // world
    w = torch.randn(experts, hidden, generator=torch.Generator().manual_seed(99))  # expert e: x * w[e]
    x = torch.randn(m, hidden, generator=g)
    weights = torch.rand(m, top_k, generator=g)
    ids = torch.stack([torch.randperm(per_rank, generator=g)[:top_k] for _ in range(m)])  # all on rank 0

    def run(rows: torch.Tensor, local: torch.Tensor) -> torch.Tensor:
        own = w[rank * per_rank : (rank + 1) * per_rank]
        return torch.where((local >= 0)[:, None], rows * own[local.clamp(min=0)], 0.0)

    expected = sum(weights[:, k, None] * x * w[ids[:, k]] for k in range(top_k))
    for fixed in (True, False):
        got = dispatch_combine(x, weights, ids, per_rank, world, dist.group.WORLD, run, fixed)
        results[(rank, fixed)] = (got - expected).abs().max().item()
    dist.destroy_process_group()


def test_fixed_capacity_dispatch_when_every_row_goes_to_one_rank():
    """Every rank sends all its rows' top-3 copies to rank 0's experts: the fixed capacity per
    destination (m * min(top_k, experts per rank)) holds them all, and both dispatch layouts give
    each row its weighted experts' sum exactly."""
    world = 4
    with mp.Manager() as manager:
        results = manager.dict()
        mp.start_processes(
            _dispatch_rank, args=(world, free_port(), results), nprocs=world, start_method="spawn"
        )
        assert len(results) == 2 * world and max(results.values()) < 1e-6, dict(results)


@pytest.mark.parametrize(
    "model,options,message",
    [
        ("deepseek_v2", dict(tp_size=2, ep_size=3), "ep_size=3 must be 1 (TP MoE) or tp_size=2"),
        (
            "deepseek_v2",
            dict(tp_size=2, dp_size=2, enable_dp_attention=True, moe_a2a_backend="all_to_all"),
            "moe_a2a_backend=all_to_all dispatches rows",
        ),
        (
            "deepseek_v2",
            dict(tp_size=2, ep_size=2, moe_a2a_backend="all_to_all"),
            "needs enable_dp_attention and ep_size=tp_size",
        ),
        (
            "llama",
            dict(tp_size=2, ep_size=2),
            "ep_size=2 splits routed experts, but LlamaForCausalLM has none",
        ),
        (
            "deepseek_v2",
            dict(tp_size=3, dp_size=3, enable_dp_attention=True, ep_size=3),
            "n_routed_experts=8 is not divisible by ep_size=3",
        ),
    ],
)
def test_ep_start_up_errors(model_dirs, model, options, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        Engine(model_path=model_dirs[model], device="cpu", **options)
