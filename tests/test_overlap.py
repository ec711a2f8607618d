"""Overlap scheduling (--disable-overlap-schedule turns it off): the next step is scheduled before
the previous step's samples are processed, its decode tokens taken from those samples on the
device. Outputs must equal the sequential loop's token for token, with retraction, stop tokens,
aborts, sampling, penalties, logprobs and grammars; no slot may leak."""

from __future__ import annotations

import json

import jsonschema
import pytest
from conftest import PRESSURE, engine_for
from test_grammar import PROMPTS, SCHEMAS
from test_scheduler import assert_slots_consistent, expected_output, make, next_token, run

from dpserve.bench.overlap import main as bench_main
from dpserve.messages import GenerateRequest
from dpserve.sampling_params import SamplingParams
from dpserve.scheduler.scheduler import Scheduler
from dpserve.step.records import PENDING_TOKEN

STOP = 7  # a token next_token yields now and then: three requests that may stop on it end early


class OverlappedGroup:
    """A group leader's loop with overlap: schedule step N + 1, run its "forward" (pending tokens
    from the step before's samples, kept by table row as the ranks keep them), then process step
    N's samples, then sample N + 1. The model is `next_token` over the sequence the KV pool holds:
    every token is read back through the request-to-slot table, so a slot freed while still in use
    would change the output."""

    def __init__(self, s: Scheduler):
        self.s = s
        self.slot_token: dict[int, int] = {}  # the "KV cache": the token each slot holds
        self.table: dict[int, dict[int, int]] = {}  # table row -> {position: slot}
        self.sampled: dict[int, int] = {}  # table row -> the token its last step sampled
        self.launched = None  # (step, tokens): the step whose samples are not processed yet
        self.outputs: dict[str, object] = {}
        self.pending_fed = 0

    def step(self) -> None:
        scheduled = self.s.schedule()
        tokens = []
        for part in scheduled.batch.reqs:
            row = self.table.setdefault(part.table_row, {})
            if part.start == 0 or part.prefix:
                row.clear()
            row.update(enumerate(part.prefix))
            fed = [self.sampled[part.table_row] if t == PENDING_TOKEN else t for t in part.tokens]
            self.pending_fed += sum(t == PENDING_TOKEN for t in part.tokens)
            for pos, slot, tok in zip(range(part.start, part.seq_len), part.slots, fed, strict=True):
                row[pos] = slot
                self.slot_token[slot] = tok
            if part.sample:
                tokens.append(next_token([self.slot_token[row[p]] for p in range(part.seq_len)]))
        self.process()
        for part, tok in zip([p for p in scheduled.batch.reqs if p.sample], tokens, strict=True):
            self.sampled[part.table_row] = tok
        if scheduled.batch.reqs:
            self.launched = (scheduled, tokens)

    def process(self) -> None:
        if self.launched is not None:
            scheduled, tokens = self.launched
            self.launched = None
            _, finished = self.s.process_samples(scheduled, [[t] for t in tokens], [[0.0] for _ in tokens])
            self.outputs.update((o.rid, o) for o in finished)

    def run(self, requests: list[GenerateRequest], abort: tuple[int, str] | None = None) -> dict:
        for msg in requests:
            assert self.s.add(msg) is None
        for n in range(10_000):
            if abort is not None and n == abort[0]:
                self.outputs[abort[1]] = self.s.abort(abort[1])
            self.step()
            if not self.s.running and not self.s.waiting and self.launched is None:
                return self.outputs
            if self.launched is None:
                assert_slots_consistent(self.s)
        raise AssertionError("requests did not finish")


def requests(stop: bool) -> list[GenerateRequest]:
    out = []
    for i in range(8):
        params = SamplingParams(
            max_new_tokens=20 + 3 * i, temperature=0, ignore_eos=True, stop_token_ids=[STOP] if stop else []
        )
        out.append(GenerateRequest(f"r{i}", [3 + (7 * i + j) % 90 for j in range(3 + 2 * i)], params))
    return out


@pytest.mark.parametrize("capacity", [400, 70])  # plenty, and retraction under pressure
@pytest.mark.parametrize("stop", [False, True])
def test_the_overlapped_loop_gives_the_sequential_outputs_and_frees_every_slot(capacity, stop):
    sequential = run(make(capacity=capacity), requests(stop))
    group = OverlappedGroup(make(capacity=capacity))
    outputs = group.run(requests(stop))
    assert {rid: o.output_ids for rid, o in outputs.items()} == {
        rid: o.output_ids for rid, o in sequential.items()
    }
    assert {rid: o.finish_reason for rid, o in outputs.items()} == {
        rid: o.finish_reason for rid, o in sequential.items()
    }
    if not stop:
        assert all(outputs[m.rid].output_ids == expected_output(m) for m in requests(stop))
    else:
        assert any(o.finish_reason.wire()["type"] == "stop" for o in outputs.values())
    assert group.pending_fed > 0  # decode tokens came from the samples of the step before
    if capacity == 70:
        assert group.s.counters["retractions"] > 0
    assert_slots_consistent(group.s)
    assert group.s.kv.stats()["kv_used"] == 0


def test_a_request_whose_token_in_flight_is_its_last_takes_no_step_more():
    s = make()
    s.add(GenerateRequest("a", [3, 4, 5], SamplingParams(max_new_tokens=2, temperature=0, ignore_eos=True)))
    first = s.schedule()  # the prompt; samples the first token
    second = s.schedule()  # before the first is processed: decodes it from the device
    assert [p.tokens for p in second.batch.reqs] == [[PENDING_TOKEN]]
    assert s.process_samples(first, [[7]], [[0.0]])[1] == []
    third = s.schedule()  # the token in flight is the second and last: nothing to run
    assert third.batch.reqs == [] and s.running[0].ending
    (out,) = s.process_samples(second, [[8]], [[0.0]])[1]
    assert out.output_ids == [7, 8] and out.finish_reason.wire() == {"type": "length", "length": 2}
    assert_slots_consistent(s)


def test_an_abort_while_its_step_runs_drops_the_late_token_and_frees_its_slots():
    group = OverlappedGroup(make())
    msgs = requests(stop=False)[:3]
    outputs = group.run(msgs, abort=(4, "r2"))
    assert outputs["r2"].finish_reason.wire()["type"] == "abort"
    aborted = outputs["r2"].output_ids
    assert aborted == expected_output(msgs[2])[: len(aborted)]
    assert [outputs[m.rid].output_ids for m in msgs[:2]] == [expected_output(m) for m in msgs[:2]]
    assert group.s.kv.stats()["kv_used"] == 0


# --- through the engine ----------------------------------------------------------------------------

MIXED = [
    {"max_new_tokens": 24, "temperature": 0.0, "ignore_eos": True},
    {"max_new_tokens": 20, "temperature": 1.0, "seed": 11, "top_p": 0.9},
    {"max_new_tokens": 20, "temperature": 0.0, "frequency_penalty": 0.8, "presence_penalty": -0.3},
    {"max_new_tokens": 16, "temperature": 0.7, "seed": 3, "min_new_tokens": 6, "stop_token_ids": [5, 7, 9]},
]


def _generate_both(engine_cache, model_dirs, arch, tp, dp, prompts, params, **kwargs):
    """The outputs and step logs of the same requests with and without overlap scheduling."""
    runs = []
    for disable in (False, True):
        engine = engine_for(
            engine_cache, model_dirs, arch, tp, dp, disable_overlap_schedule=disable, **kwargs
        )
        assert engine.get_server_info()["overlap_schedule"] is not disable
        engine.get_step_log()
        params = [{**p, "top_logprobs_num": 2} for p in params]
        outs = engine.generate(input_ids=prompts, sampling_params=params, return_logprob=True)
        runs.append((outs, engine.get_step_log(), engine.get_metrics()))
    return runs


def _same_outputs(a: list[dict], b: list[dict]) -> None:
    for x, y in zip(a, b, strict=True):
        assert x["output_ids"] == y["output_ids"]
        assert x["meta_info"]["finish_reason"] == y["meta_info"]["finish_reason"]
        lps = [o["meta_info"]["output_token_logprobs"] for o in (x, y)]
        assert lps[0] == pytest.approx(lps[1], abs=1e-4)
        tops = [[[t for t, _ in top] for top in o["meta_info"]["output_top_logprobs"]] for o in (x, y)]
        assert tops[0] == tops[1]


@pytest.mark.parametrize(
    "tp,dp,kwargs",
    [
        (2, 1, {}),  # attention TP: the leader's samples reach the other rank by a broadcast
        (
            2,
            2,
            {k: v for k, v in PRESSURE.items() if k not in ("tp_size", "dp_size", "enable_dp_attention")},
        ),  # DP attention, retraction
    ],
)
def test_served_outputs_equal_the_sequential_loops(engine_cache, model_dirs, prompts, tp, dp, kwargs):
    params = [MIXED[i % len(MIXED)] for i in range(len(prompts))]
    (overlap, log_on, metrics_on), (sequential, log_off, _) = _generate_both(
        engine_cache, model_dirs, "deepseek_v2", tp, dp, prompts * 2, params * 2, **kwargs
    )
    _same_outputs(overlap, sequential)
    assert sum(r.pending_tokens for group in log_on for r in group) > 0
    assert sum(r.pending_tokens for group in log_off for r in group) == 0
    assert all(m["kv_used"] == 0 for m in metrics_on)
    if "max_total_tokens" in kwargs:
        assert sum(m["retractions"] for m in metrics_on) > 0


@pytest.mark.parametrize("name", ["nested", "bounded array"])
def test_grammar_outputs_equal_the_sequential_loops(engine_cache, model_dirs, name):
    schema = SCHEMAS[name]
    runs = []
    for disable in (False, True):
        engine = engine_for(
            engine_cache,
            model_dirs,
            "llama",
            1,
            1,
            grammar_max_whitespace=0,
            disable_overlap_schedule=disable,
        )
        params = {"max_new_tokens": 96, "json_schema": json.dumps(schema), "temperature": 1.0, "seed": 5}
        outs = engine.generate(prompt=PROMPTS, sampling_params=params)
        for o in outs:
            assert o["meta_info"]["finish_reason"]["type"] == "stop", o
            jsonschema.validate(json.loads(o["text"]), schema)
        runs.append([o["output_ids"] for o in outs])
    assert runs[0] == runs[1]


def test_speculative_decoding_runs_the_sequential_loop(engine_cache, model_dirs, prompts):
    engine = engine_for(
        engine_cache, model_dirs, "deepseek_v2", 1, 1, speculative_algorithm="NGRAM", speculative_num_steps=2
    )
    engine.get_step_log()
    engine.generate(input_ids=prompts[:2], sampling_params=MIXED[0])
    assert sum(r.pending_tokens for group in engine.get_step_log() for r in group) == 0
    info = engine.get_server_info()
    assert info["overlap_schedule"] is False and info["disable_overlap_schedule"] is False


def test_the_benchmark_prints_both_loops_figures(model_dirs, capsys):
    bench_main(
        ["--model-path", model_dirs["llama"], "--dtype", "float32", "--batch-size", "3", "--input-len", "12"]
        + ["--output-len", "6", "--repeats", "1"]
    )
    out = capsys.readouterr().out
    rows = [line for line in out.splitlines() if line.startswith(("| overlap |", "| sequential |"))]
    assert len(rows) == 2 and all(len(r.split("|")) == 8 for r in rows)
    assert out.rstrip().endswith("outputs: equal")
