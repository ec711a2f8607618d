"""Padding modes and graph (padded) decode steps under DP attention (docs/design.md, section 4)."""

from __future__ import annotations

import random

import pytest
from conftest import GREEDY, NEW_TOKENS, assert_matches_reference, engine_for

from dpserve.distributed import Topology
from dpserve.step.padding import CostModel, Curve, PaddingPolicy

# (tp, dp, arch); the unpadded sum_len engine of each layout is the baseline.
LAYOUTS = [(2, 2, "deepseek_v2"), (4, 4, "deepseek_v3")]
# (dp_padding_mode, padded): every mode padded, and auto's eager choice unpadded. Ordered so that
# the next test starts on the last engine.
MODES = [("auto", False), ("auto", True), ("max_len", True), ("sum_len", True)]

_baselines: dict[tuple[int, int], dict[str, list[dict]]] = {}


def padding_engine(engine_cache, model_dirs, arch, tp, dp, mode, padded, **kwargs):
    """DP attention in padding mode `mode`, padded decode steps or none."""
    return engine_for(
        engine_cache, model_dirs, arch, tp, dp, dp_padding_mode=mode, disable_cuda_graph=not padded, **kwargs
    )


def run_loads(engine, prompts) -> dict[str, list[dict]]:
    """Balanced (round robin over the groups) and very unbalanced (every request on group 0)."""
    balanced = engine.generate(input_ids=prompts, sampling_params=GREEDY, return_logprob=True)
    rids = [engine.submit(p, GREEDY, return_logprob=True, dp_rank=0) for p in prompts]
    return {"balanced": balanced, "unbalanced": [engine.wait(r) for r in rids]}


def layout_log(log: list) -> list[tuple]:
    """What every DP group must log identically for a step (not its local mode or timing)."""
    return [(s.kind, s.padding_mode, s.tokens, s.real_rows, s.mlp_rows, s.padded) for s in log]


def assert_same_outputs(outputs: list[dict], expected: list[dict]) -> None:
    for i, (out, ref) in enumerate(zip(outputs, expected, strict=True)):
        assert out["output_ids"] == ref["output_ids"], f"request {i}: tokens differ"
        assert out["meta_info"]["output_token_logprobs"] == pytest.approx(
            ref["meta_info"]["output_token_logprobs"], abs=1e-4
        ), f"request {i}: logprobs differ"


def baseline(engine_cache, model_dirs, prompts, references, tp, dp, arch) -> dict[str, list[dict]]:
    if (tp, dp) not in _baselines:
        engine = padding_engine(engine_cache, model_dirs, arch, tp, dp, "sum_len", padded=False)
        loads = run_loads(engine, prompts)
        for outputs in loads.values():
            assert_matches_reference(outputs, references[arch])
        steps = [s for log in engine.get_step_log() for s in log]
        assert steps and not any(s.padded for s in steps)
        assert all(s.mlp_rows == s.real_rows == sum(s.tokens) for s in steps)
        _baselines[(tp, dp)] = loads
    return _baselines[(tp, dp)]


@pytest.mark.parametrize("mode,padded", MODES)  # the top decorator varies fastest: one layout at a time
@pytest.mark.parametrize("tp,dp,arch", LAYOUTS)
def test_padded_matches_unpadded(engine_cache, model_dirs, prompts, references, tp, dp, arch, mode, padded):
    expected = baseline(engine_cache, model_dirs, prompts, references, tp, dp, arch)
    engine = padding_engine(engine_cache, model_dirs, arch, tp, dp, mode, padded)
    engine.get_step_log()
    loads = run_loads(engine, prompts)
    for load, outputs in loads.items():
        assert_same_outputs(outputs, expected[load])
        assert {o["meta_info"]["dp_rank"] for o in outputs} == (set(range(dp)) if load == "balanced" else {0})
    logs = engine.get_step_log()
    assert all(layout_log(log) == layout_log(logs[0]) for log in logs), "DP groups logged different steps"
    decode = [s for s in logs[0] if s.kind == "decode"]
    assert any(s.tokens[0] == sum(s.tokens) > 1 for s in decode), "no unbalanced decode step"
    for s in logs[0]:
        assert s.real_rows == sum(s.tokens)
        assert s.padded == (padded and s.kind == "decode")  # the default buckets hold every decode step
        if mode != "auto":
            assert s.padding_mode == mode
        a = tp // dp
        if not s.padded:
            m = -(-max(s.tokens) // a) * a
            assert s.mlp_rows == (s.real_rows if s.padding_mode == "sum_len" else dp * m)
        elif s.padding_mode == "sum_len":
            assert s.real_rows <= s.mlp_rows <= 2 * s.real_rows  # bucket(S) with buckets 1, 2, 4, 8, 16...
        else:
            assert s.mlp_rows % dp == 0 and max(s.tokens) <= s.mlp_rows // dp <= 2 * max(s.tokens) + a


@pytest.mark.parametrize("mode,rows", [("sum_len", 1), ("max_len", 4)])
def test_one_request_moe_rows(engine_cache, model_dirs, prompts, references, mode, rows):
    """At (4,4) with one request in flight, sum_len's MoE runs 1 row where max_len's runs 4."""
    engine = padding_engine(engine_cache, model_dirs, "deepseek_v3", 4, 4, mode, padded=True)
    engine.get_step_log()
    out = engine.generate(input_ids=prompts[0], sampling_params=GREEDY, return_logprob=True)
    assert_matches_reference([out], references["deepseek_v3"][:1])
    decode = [s for s in engine.get_step_log()[0] if s.kind == "decode"]
    assert len(decode) == NEW_TOKENS - 1
    assert {(s.padding_mode, s.real_rows, s.mlp_rows, s.padded) for s in decode} == {(mode, 1, rows, True)}


def test_auto_keeps_graphs_past_the_largest_bucket(engine_cache, model_dirs, prompts, references):
    """Buckets 1, 2, 4: six requests over two groups sum to 6 > 4, so auto takes max_len's
    bucket(3) = 4 and stays padded; only a group of more than 4 requests runs eager, and says so."""
    engine = padding_engine(
        engine_cache, model_dirs, "deepseek_v2", 2, 2, "auto", padded=True, cuda_graph_max_bs=4
    )
    engine.get_step_log()
    outputs = engine.generate(input_ids=prompts, sampling_params=GREEDY, return_logprob=True)
    assert_matches_reference(outputs, references["deepseek_v2"])
    decode = [s for s in engine.get_step_log()[0] if s.kind == "decode"]
    full = [s for s in decode if s.tokens == (3, 3)]
    assert full and all(s.padded and s.padding_mode == "max_len" and s.mlp_rows == 8 for s in full)
    assert all(s.padded for s in decode if max(s.tokens) <= 4)
    # All on group 0, finishing one after another: 6, 5, ... requests decode there.
    lengths = [NEW_TOKENS - 2 * i for i in range(len(prompts))]
    rids = [
        engine.submit(p, {**GREEDY, "max_new_tokens": n}, dp_rank=0)
        for p, n in zip(prompts, lengths, strict=True)
    ]
    for rid, n, ref in zip(rids, lengths, references["deepseek_v2"], strict=True):
        k = min(n, ref.compare_len)
        assert engine.wait(rid)["output_ids"][:k] == ref.output_ids[:k]
    decode = [s for s in engine.get_step_log()[0] if s.kind == "decode"]
    assert {s.padded for s in decode if s.tokens[0] > 4} == {False}
    assert {s.padded for s in decode if s.tokens[0] <= 4} == {True}


def test_ranks_agree_under_shifting_loads(engine_cache, model_dirs, prompts, references):
    """(4,2) with auto and small buckets: requests of different lengths arrive on either group
    while others decode, so every step has a different split; no rank disagrees or hangs."""
    engine = padding_engine(
        engine_cache, model_dirs, "deepseek_v3", 4, 2, "auto", padded=True, cuda_graph_bs=(1, 2, 4)
    )
    engine.get_step_log()
    rng = random.Random(0)
    requests, outputs = [], {}
    for wave in range(6):
        # Five of six requests on one group, the other group's share moving from wave to wave.
        for i, p in enumerate(prompts):
            n = rng.randint(2, NEW_TOKENS)
            group = (i + wave) % 5 // 4
            requests.append((i, n, engine.submit(p, {**GREEDY, "max_new_tokens": n}, dp_rank=group)))
        outputs[requests[-1][2]] = engine.wait(requests[-1][2])  # the rest still run into the next wave
    for i, n, rid in requests:
        out = outputs.get(rid) or engine.wait(rid)
        ref = references["deepseek_v3"][i]
        k = min(n, ref.compare_len)
        assert len(out["output_ids"]) == n and out["output_ids"][:k] == ref.output_ids[:k]
    logs = engine.get_step_log()
    assert len(logs[0]) > 40 and layout_log(logs[0]) == layout_log(logs[1])
    kinds = {(s.kind, s.padding_mode, s.padded) for s in logs[0]}
    assert ("decode", "max_len", True) in kinds  # sums past 4 with both groups at most 4
    assert any(s.kind == "decode" and not s.padded for s in logs[0])  # a group past 4: eager, counted
    assert len({s.tokens for s in logs[0]}) > 10


# --- pieces on their own --------------------------------------------------------------------


def policy(mode: str, tp: int, dp: int, rank: int = 0, cost: CostModel | None = None) -> PaddingPolicy:
    p = PaddingPolicy(mode, [1, 2, 4, 8], Topology(tp, dp, rank), max_kv_len=512)
    p.cost = cost
    return p


def linear_cost(sum_len_per_row: float, max_len_per_row: float) -> CostModel:
    """A cost model of 1 s per step plus the given seconds per row (max_len: per row of a group)."""
    return CostModel(
        sum_len=Curve((1.0, 2.0), (1 + sum_len_per_row, 1 + 2 * sum_len_per_row)),
        max_len=Curve((1.0, 2.0), (1 + max_len_per_row, 1 + 2 * max_len_per_row)),
    )


def test_policy_choices():
    auto = policy("auto", 4, 4, cost=linear_cost(1.0, 4.0))  # MoE-bound: max_len pays 4 rows per M
    one = auto.layout([1, 0, 0, 0], [1, 0, 0, 0], can_pad=True)
    assert (one.padding_mode, one.bucket, one.mlp_rows, one.local_rows) == ("sum_len", 1, 1, 1)
    # Balanced 8 x 4 = 32 > 8: sum_len has no graph, max_len's bucket(8) = 8 does.
    full = auto.layout([8, 8, 8, 8], [8] * 4, can_pad=True)
    assert (full.padding_mode, full.bucket, full.mlp_rows, full.padded) == ("max_len", 8, 32, True)
    # Past every bucket, or a prefill in some group: eager, the cheaper mode at the real sizes.
    eager = auto.layout([9, 1, 0, 0], [1, 1, 0, 0], can_pad=True)
    assert (eager.padding_mode, eager.bucket, eager.padded, eager.mlp_rows) == ("sum_len", None, False, 10)
    prefill = auto.layout([1, 1, 1, 1], [1] * 4, can_pad=False)
    assert (prefill.padding_mode, prefill.padded, prefill.mlp_rows) == ("sum_len", False, 4)
    # When the all-reduce path is dear, auto takes max_len even though sum_len has a graph.
    dear_sum = policy("auto", 4, 4, cost=linear_cost(10.0, 1.0))
    assert dear_sum.layout([1, 1, 1, 1], [1] * 4, can_pad=True).padding_mode == "max_len"
    # Padded sum_len rows of group 2 land after groups 0 and 1; padding goes to the spare row.
    s = policy("sum_len", 4, 4, rank=2).layout([2, 1, 2, 0], [2, 1, 2, 0], can_pad=True)
    assert (s.bucket, s.local_rows, s.row_index("cpu").tolist()) == (8, 8, [3, 4] + [8] * 6)
    m = policy("max_len", 4, 2, rank=2).layout([3, 1], [3, 1], can_pad=True)
    assert (m.bucket, m.padded_len, m.mlp_rows, m.local_rows) == (4, 4, 8, 4)


def test_policy_agrees_on_every_rank():
    """The choice depends only on the gathered sizes: every rank of a (8, 4) layout agrees."""
    policies = [policy("auto", 8, 4, rank=r, cost=linear_cost(1.0, 3.0)) for r in range(8)]
    rng = random.Random(0)
    for _ in range(500):
        tokens = [rng.choice([0, 0, 1, 2, 3, 7, 12, 40]) for _ in range(4)]
        can_pad = rng.random() < 0.8
        steps = [p.layout(tokens, tokens, can_pad) for p in policies]
        assert len({(s.padding_mode, s.bucket, s.mlp_rows) for s in steps}) == 1


def test_curve_interpolates_and_extends():
    c = Curve((1.0, 4.0, 8.0), (1.0, 4.0, 6.0))
    assert [c(1), c(2), c(6), c(16)] == [1.0, 2.0, 5.0, 10.0]
