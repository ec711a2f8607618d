"""The group scheduler on its own: admission by KV reservation, chunking, rejection, abort."""

from __future__ import annotations

from dpserve.sampling_params import SamplingParams
from dpserve.scheduler.plan import RequestSlots
from dpserve.scheduler.request import GenerateRequest
from dpserve.scheduler.scheduler import Scheduler


def make(capacity: int = 50, chunk: int = 8) -> Scheduler:
    return Scheduler(0, capacity, 4, chunk, context_len=100, eos_ids=(1,), seed=0, slots=RequestSlots())


def request(rid: str, prompt_len: int, new: int = 10) -> GenerateRequest:
    return GenerateRequest(
        rid, list(range(3, 3 + prompt_len)), SamplingParams(max_new_tokens=new, temperature=0)
    )


def step(s: Scheduler, token: int = 7):
    plan = s.schedule()
    s.slots.apply(plan)
    _, finished = s.process_samples(plan, [token] * plan.num_samples, [0.0] * plan.num_samples)
    return plan, finished


def test_reservation_queues_and_chunks():
    s = make()
    assert s.add(request("a", 20)) is None and s.add(request("b", 20)) is None  # 30 + 30 > 50
    plan, _ = step(s)
    assert plan.mode == "extend" and plan.rids == ["a"] and plan.new_tokens[0] == list(range(3, 11))
    assert plan.sample == [False] and [r.rid for r in s.waiting] == ["b"]
    step(s), step(s)  # the last chunk of "a" (4 tokens) samples its first token
    assert len(s.running[0].output_ids) == 1
    for _ in range(9):
        plan, finished = step(s)
        assert plan.mode == "decode" and plan.rids == ["a"]
    assert [f["finish_reason"] for f in finished] == [{"type": "length", "length": 10}]
    assert s.allocator.num_free == 50 and s.reserved == 0
    plan, _ = step(s)
    assert plan.rids == ["b"] and plan.freed == ["a"]


def test_rejects_what_never_fits_and_aborts():
    s = make()
    err = s.add(request("big", 45, new=10))
    assert err["finish_reason"]["type"] == "abort"
    assert "needs 55 KV tokens" in err["finish_reason"]["message"]
    s.add(request("a", 5))
    step(s)
    out = s.abort("a")
    assert out["finish_reason"] == {"type": "abort", "message": "aborted"}
    assert s.allocator.num_free == 50 and not s.running
    assert s.abort("unknown") is None


def test_stop_on_eos():
    s = make()
    s.add(request("a", 5))
    _, finished = step(s, token=1)
    assert finished[0]["finish_reason"] == {"type": "stop", "matched": 1}
    assert finished[0]["output_ids"] == [1]


def test_decoding_requests_ride_along_in_prefill_steps():
    s = make(capacity=100, chunk=8)
    s.add(request("a", 4))
    step(s)  # a prefills and samples its first token
    s.add(request("b", 20))
    plan, _ = step(s)
    # b's first chunk (8 - 1 tokens: a's decode token counts against the budget) and a's decode.
    assert plan.mode == "extend" and plan.rids == ["b", "a"]
    assert [len(t) for t in plan.new_tokens] == [7, 1] and plan.sample == [False, True]
    assert plan.new_tokens[1] == [7] and len(s.running[0].output_ids) == 2
