"""Expert placement from recorded load (dpserve/eplb/placement.py), against placements computed by
hand, and its command line on a load file as bench.one_batch writes it."""

from __future__ import annotations

import json
from dataclasses import replace

import httpx
import pytest
import torch
from conftest import GREEDY, NEW_TOKENS, assert_matches_reference, http_outputs, metrics

from dpserve.eplb import __main__ as eplb_main
from dpserve.eplb.placement import identity, imbalance, pack, place, replicate
from dpserve.eplb.rebalance import align, moves


def test_replicas_go_to_the_highest_load_per_replica():
    # 8 / 1 is the highest, then 8 / 2 ties with 4 / 1: the lower index.
    assert replicate([8, 4, 2, 2], 6) == [3, 1, 1, 1]
    assert replicate([1, 5, 5], 5) == [1, 2, 2]
    assert replicate([3, 3], 2) == [1, 1]
    with pytest.raises(ValueError, match="3 slots cannot hold 4 experts"):
        replicate([1, 1, 1, 1], 3)


def test_packing_fills_the_lightest_bin_with_room():
    # 10 -> 0; 9 -> 1; 3 -> 1 (12); 2 -> 0 (12); 1 -> 0 (a tie: the lower bin, now full); 1 -> 1.
    assert pack([10, 9, 3, 2, 1, 1], 2) == [0, 1, 1, 0, 0, 1]
    with pytest.raises(ValueError, match="5 items cannot be split evenly over 2 bins"):
        pack([1] * 5, 2)


def test_one_layer_by_hand():
    """4 experts with loads 8, 4, 2, 2 on 6 slots over 2 ranks: expert 0 three times (8/3 per
    replica); packing gives rank 0 experts 1, 0, 3 (4 + 8/3 + 2) and rank 1 experts 0, 0, 2."""
    load = torch.tensor([[8, 4, 2, 2]])
    p = place(load, num_slots=6, ranks=2)
    assert p.phy_to_log.tolist() == [[0, 1, 3, 0, 0, 2]]
    assert p.replicas.tolist() == [[3, 1, 1, 1]]
    assert imbalance(load, p, 2).tolist() == pytest.approx([(4 + 8 / 3 + 2) / 8])
    # Without EPLB: experts 0, 1 on rank 0 and 2, 3 on rank 1 -> 12 vs 4; whole experts moved by
    # load but no replica: 8 + 2 vs 4 + 2.
    assert imbalance(load, identity(1, 4), 2).tolist() == pytest.approx([12 / 8])
    assert imbalance(load, place(load, 4, 2), 2).tolist() == pytest.approx([10 / 8])


def test_hierarchical_keeps_a_group_on_one_node():
    """8 experts in 4 groups of 2 on 2 nodes of 2 ranks, 12 slots. Groups (loads 10, 6, 3, 1) go to
    nodes 0, 1, 1, 0; node 0 (experts 0, 1, 6, 7) gives expert 0 three slots, node 1 (experts 2-5)
    expert 2; each node packs its 6 slots over its 2 ranks."""
    load = torch.tensor([[10, 0, 6, 0, 3, 0, 1, 0]])
    p = place(load, num_slots=12, ranks=4, nodes=2, groups=4)
    assert p.phy_to_log.tolist() == [[0, 0, 7, 0, 1, 6, 2, 4, 5, 2, 2, 3]]
    node = p.phy_to_log[0].view(2, 6)
    for group, home in enumerate([0, 1, 1, 0]):
        for e in (2 * group, 2 * group + 1):
            assert (node[home] == e).any() and not (node[1 - home] == e).any()
    # Ranks: 20/3, 1 + 10/3, 2 + 3, 2 + 2 rows: 1.33x the mean, the price of keeping groups whole.
    assert imbalance(load, p, 4).tolist() == pytest.approx([(20 / 3) / 5])
    # The same load on one node: a global pass (groups need not stay together).
    assert imbalance(load, place(load, 12, 4), 4).tolist()[0] < 4 / 3


def test_layouts_that_do_not_split_are_named():
    with pytest.raises(ValueError, match="10 expert slots over 4 ranks on 1 node"):
        place(torch.ones(1, 8), 10, 4)
    with pytest.raises(ValueError, match="4 slots cannot hold the 8 experts"):
        place(torch.ones(1, 8), 4, 4)


def test_skewed_load_balances_within_the_goal():
    """A router that sends most rows to a few experts (Zipf-like): 16 redundant slots bring the
    busiest rank within 1.15x of the mean where whole experts per rank are far above it."""
    gen = torch.Generator().manual_seed(0)
    ranks = torch.arange(1, 65, dtype=torch.float64)
    load = torch.stack([(1000 / ranks**1.2)[torch.randperm(64, generator=gen)] for _ in range(3)]).round()
    before = imbalance(load, identity(3, 64), 8)
    after = imbalance(load, place(load, 64 + 16, 8), 8)
    assert (before > 1.5).all() and (after <= 1.15).all()


def test_a_rebalance_moves_only_experts_that_arrive_at_a_rank():
    """Two ranks of three slots. Rank 0 keeps 0 and 2 where they are and takes a replica of 5 from
    rank 1; rank 1 keeps 5 and 3 in their slots and takes 1 (rank 0's) for its 4."""
    old = [0, 1, 2, 3, 4, 5]
    new = align(old, [0, 2, 5, 1, 3, 5], ranks=2)
    assert new == [0, 5, 2, 3, 1, 5]
    assert moves(old, new, ranks=2) == [(5, 1), (1, 4)]
    # An expert the destination's rank already holds is copied there, not sent: 3 from slot 3.
    assert moves([0, 1, 2, 3], [0, 1, 3, 3], ranks=2) == [(3, 2)]
    # Replicas of an expert that arrives at several ranks are sent from its holders in turn.
    assert moves([7, 7, 1, 2, 3, 4], [7, 7, 7, 1, 7, 4], ranks=3) == [(0, 2), (2, 3), (1, 4)]
    assert align([0, 1, 2, 3], [1, 0, 3, 2], ranks=2) == [0, 1, 2, 3]  # same experts per rank: no move


def test_the_command_line_reads_one_batchs_load_file(tmp_path, capsys):
    path = tmp_path / "load.jsonl"
    lines = [
        {"batch_size": 1, "rows_per_expert": [[6, 2, 1, 1]]},
        {"batch_size": 4, "rows_per_expert": [[2, 2, 1, 1]]},
    ]
    path.write_text("".join(json.dumps(x) + "\n" for x in lines))
    out = tmp_path / "placement.json"
    eplb_main.main(
        [
            "--expert-load",
            str(path),
            "--ep-size",
            "2",
            "--ep-num-redundant-experts",
            "2",
            "--output",
            str(out),
            "--json",
        ]
    )
    r = json.loads(capsys.readouterr().out)
    assert r["load"] == [[8, 4, 2, 2]]  # the lines summed
    assert r["imbalance_without"] == pytest.approx([12 / 8]) and r["imbalance_with"] == pytest.approx(
        [(4 + 8 / 3 + 2) / 8]
    )
    saved = json.loads(out.read_text())
    assert saved["phy_to_log"] == [[0, 1, 3, 0, 0, 2]] and saved["num_experts"] == 4 and saved["ep_size"] == 2


def test_the_skewed_checkpoint_biases_two_experts(tmp_path):
    """`router_skew` (the checkpoint of EPLB's figures) raises experts 0 and 1 in every MoE layer's
    correction bias and changes nothing else."""
    from safetensors.torch import load_file

    from dpserve.testing.tiny_models import write_tiny_model

    plain, skewed = (
        load_file(str(write_tiny_model("deepseek_v3", tmp_path / name, router_skew=s) / "model.safetensors"))
        for name, s in (("plain", 0.0), ("skewed", 0.3))
    )
    assert plain.keys() == skewed.keys()
    biased = [k for k in plain if k.endswith("e_score_correction_bias")]
    assert len(biased) == 2  # the tiny V3's two MoE layers
    for k in plain:
        expected = torch.tensor([0.3, 0.3] + [0.0] * 6) if k in biased else torch.zeros(())
        assert torch.allclose((skewed[k] - plain[k]).float(), expected, atol=1e-6), k


@pytest.fixture(scope="module")
def skewed(tmp_path_factory, prompts):
    """The skewed tiny V3, transformers' greedy outputs on it, and a load recorded on it."""
    from dpserve.testing.reference import hf_greedy_reference
    from dpserve.testing.tiny_models import write_tiny_model

    root = tmp_path_factory.mktemp("skewed")
    model = str(write_tiny_model("deepseek_v3", root / "model", router_skew=0.3))
    return {"model": model, "refs": hf_greedy_reference(model, prompts, NEW_TOKENS), "root": root}


@pytest.mark.parametrize(
    "tp,dp,a2a,redundant,from_load,live,padding",
    [
        (2, 2, "none", 2, False, True, "sum_len"),
        (4, 2, "all_to_all", 4, False, True, "max_len"),
        (4, 4, "all_to_all", 4, True, False, "auto"),
    ],
    ids=["2-2-2-none-even-live-sum_len", "4-2-4-a2a-even-live-max_len", "4-4-4-a2a-from-load"],
)
def test_redundant_experts_leave_outputs_unchanged(
    engine_cache, skewed, prompts, tp, dp, a2a, redundant, from_load, live, padding
):
    """Replicas hold the same weights: greedy tokens equal transformers' with redundant slots, placed
    from an even load or from one recorded on the engine itself, or rebalanced while generating
    (every 2 steps, one layer per step boundary); the recorded load comes back per logical expert
    (replicas' rows summed), and the busiest rank carries less than without."""
    location = None
    if from_load:
        plain = engine_cache.get(
            skewed["model"], tp_size=tp, dp_size=dp, enable_dp_attention=True, ep_size=tp, moe_a2a_backend=a2a
        )
        plain.get_expert_load(), plain.get_step_log()
        plain.generate(input_ids=prompts, sampling_params=GREEDY)
        load = plain.get_expert_load()
        before = [s.expert_imbalance for g in plain.get_step_log() for s in g if s.kind == "extend"]
        location = skewed["root"] / "load.jsonl"
        location.write_text(json.dumps({"rows_per_expert": load}) + "\n")
        location = str(location)
    engine = engine_cache.get(
        skewed["model"],
        tp_size=tp,
        dp_size=dp,
        enable_dp_attention=True,
        ep_size=tp,
        moe_a2a_backend=a2a,
        ep_num_redundant_experts=redundant,
        init_expert_location=location,
        enable_eplb=live,
        dp_padding_mode=padding,
        eplb_rebalance_num_iterations=2,
        eplb_rebalance_layers_per_chunk=1,
    )
    engine.get_expert_load(), engine.get_step_log()
    outputs = engine.generate(input_ids=prompts, sampling_params=GREEDY, return_logprob=True)
    assert_matches_reference(outputs, skewed["refs"])
    routed = engine.get_expert_load()
    assert len(routed[0]) == 8 and sum(map(sum, routed)) > 0  # logical experts, replicas folded in
    logs = engine.get_step_log()
    done = [[s.rebalance for s in g if s.rebalance is not None] for g in logs]
    if live:  # every group leader logs the same rebalances, after the same steps
        assert {(s.padding_mode, s.padded) for g in logs for s in g if s.kind == "decode"} == {
            (padding, True)
        }
        same = [[replace(r, seconds=0.0) for r in g] for g in done]
        assert same == [same[0]] * dp
        assert len(done[0]) >= NEW_TOKENS // 4 and sum(r.bytes_moved for r in done[0]) > 0
        assert all(r.imbalance_after <= r.imbalance_before for r in done[0])  # else nothing moves
        assert any(r.imbalance_after < r.imbalance_before for r in done[0])
    else:
        assert done == [[]] * dp
    if from_load:
        assert routed == load  # the same rows went to the same experts
        after = [s.expert_imbalance for g in logs for s in g if s.kind == "extend"]
        assert max(after) < max(before)


def test_the_server_rebalances_and_dumps_its_load(skewed, prompts):
    """`--enable-eplb` behind the HTTP server: the same greedy tokens, each rebalance logged and
    counted in /metrics; POST /dump_expert_load gives the rows per expert since the last dump, in
    the form --init-expert-location reads."""
    from dpserve.eplb.placement import read_load
    from dpserve.testing.server import ServerProcess

    args = ["--tp", "2", "--dp", "2", "--enable-dp-attention", "--ep-size", "2", "--dtype", "float32"]
    eplb = ["--enable-eplb", "--eplb-rebalance-num-iterations", "3", "--ep-num-redundant-experts", "2"]
    with ServerProcess("--model-path", skewed["model"], *args, *eplb, "--log-level", "info") as srv:
        body = {"input_ids": prompts, "sampling_params": GREEDY, "return_logprob": True}
        r = httpx.post(f"{srv.url}/generate", json=body, timeout=120)
        assert_matches_reference(http_outputs(r.json()), skewed["refs"])
        dump = httpx.post(f"{srv.url}/dump_expert_load", timeout=60)
        again = httpx.post(f"{srv.url}/dump_expert_load", timeout=60).json()["rows_per_expert"]
        scraped = metrics(srv)
        logged = srv.output.count("expert rebalance after step")
    path = skewed["root"] / "dumped.jsonl"
    path.write_text(dump.text + "\n")
    load = read_load(str(path))
    # Every token of every prompt and output (but the last) went through both MoE layers, top-2.
    tokens = sum(map(len, prompts)) + len(prompts) * (NEW_TOKENS - 1)
    assert load.shape == (2, 8) and load.sum(1).tolist() == [2 * tokens] * 2
    assert again == [[0] * 8] * 2  # cleared by the first dump
    rebalances = [v for k, v in scraped.items() if k.startswith("dpserve_eplb_rebalances_total")]
    assert rebalances == [logged / 2] * 2 and logged >= 2  # both leaders, each rebalance once
    moved = [v for k, v in scraped.items() if k.startswith("dpserve_eplb_bytes_moved_total")]
    assert moved and all(v > 0 for v in moved)


def test_placements_that_cannot_serve_are_named_at_start(skewed, tmp_path):
    from dpserve.config import EngineConfig
    from dpserve.models.config import ModelConfig

    def check(**kwargs):
        cfg = EngineConfig(skewed["model"], tp_size=4, dp_size=4, enable_dp_attention=True, **kwargs)
        ModelConfig.load(skewed["model"]).validate(cfg)

    with pytest.raises(ValueError, match="they need ep_size=tp_size > 1 .got ep_size=1"):
        check(ep_num_redundant_experts=4)
    with pytest.raises(
        ValueError, match=r"enable_eplb .* needs ep_size=tp_size > 1 \(got ep_size=1, tp_size=4\)"
    ):
        check(enable_eplb=True)
    with pytest.raises(
        ValueError,
        match=r"n_routed_experts=8 \+ ep_num_redundant_experts=2 is not divisible by "
        r"ep_size=4 .*; redundant experts that spread evenly: 0 \+ a multiple of 4",
    ):
        check(ep_size=4, ep_num_redundant_experts=2)
    other = tmp_path / "other.jsonl"
    other.write_text(json.dumps({"rows_per_expert": [[1] * 16] * 3}) + "\n")
    with pytest.raises(ValueError, match="records 3 MoE layers x 16 experts; this model has 2 x 8"):
        check(ep_size=4, init_expert_location=str(other))
    with pytest.raises(ValueError, match="No such file"):
        check(ep_size=4, init_expert_location=str(tmp_path / "missing.json"))
