"""The group scheduler on its own: admission by estimate, chunking, retraction, the prefix cache,
rejection and abort. Tokens are "sampled" by a fixed rule, so runs are exact and repeatable."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from dpserve.kvcache.radix_cache import RadixTree
from dpserve.messages import GenerateRequest
from dpserve.sampling_params import SamplingParams
from dpserve.scheduler.request import check_request
from dpserve.scheduler.scheduled import ScheduledStep
from dpserve.scheduler.scheduler import MAX_RETRACTIONS, Scheduler, largest_step
from dpserve.speculative.rejection import greedy_accept
from dpserve.worker.drafter import draft_batch
from dpserve.worker.model_runner import peak_step
from dpserve.worker.sampling_batch import count_tokens, follow_counts
from dpserve.worker.token_counts import TokenCounts


def make(
    capacity: int = 50, chunk: int = 8, max_running: int = 4, radix: bool = True, drafts: int = 0
) -> Scheduler:
    return Scheduler(
        0, capacity, max_running, chunk, 100, 300, eos_ids=(1,), seed=0, radix_cache=radix, num_drafts=drafts
    )


def request(rid: str, prompt_len: int, new: int = 10, first: int = 3) -> GenerateRequest:
    params = SamplingParams(max_new_tokens=new, temperature=0, ignore_eos=True)
    return GenerateRequest(rid, list(range(first, first + prompt_len)), params)


def next_token(fill: list[int]) -> int:
    return 2 + sum(fill) % 97  # a function of the whole sequence, as a model's greedy choice is


def periodic_token(fill: list[int]) -> int:
    return 3 + (fill[-1] * 7) % 11  # repeats soon, as copy-heavy text does: n-gram drafts get accepted


def step(s: Scheduler, rule=next_token, counts: TokenCounts | None = None):
    """Runs one step: checks the plan against the request-to-slot table a rank keeps; the "model"
    verifies drafts greedily by `rule`; `counts`: the penalties' token counts, kept as a leader
    keeps them."""
    scheduled = s.schedule()
    plan = scheduled.batch
    # Never more tokens than the step whose activation peak the workers measure at start-up.
    prompts, decoding = largest_step(s.chunk_size, s.max_running, s.num_drafts, s.context_len)
    assert plan.num_tokens <= sum(prompts) + decoding * (1 + s.num_drafts)
    table = s.__dict__.setdefault("rank_table", {})  # row -> {position: slot}, as a rank's table
    for r in plan.reqs:
        row = table.setdefault(r.table_row, {})
        row.update(enumerate(r.prefix))
        row.update(zip(range(r.start, r.seq_len), r.slots, strict=True))
        assert all(p in row for p in range(r.seq_len)), "a position the step attends has no slot"
    tokens = []
    for r in scheduled.sampled:
        targets = [rule(r.fill_ids + r.drafts[:j]) for j in range(len(r.drafts) + 1)]
        tokens.append(greedy_accept(r.drafts, targets))
    if counts is not None:
        follow_counts(counts, s.running, scheduled.sampled)
    new, finished = s.process_samples(scheduled, tokens, [[0.0] * len(t) for t in tokens])
    if counts is not None:
        count_tokens(counts, new)
    return scheduled, finished


def run(
    s: Scheduler, requests: list[GenerateRequest], max_steps: int = 10_000, rule=next_token
) -> dict[str, dict]:
    for msg in requests:
        assert s.add(msg) is None
    outputs = {}
    for _ in range(max_steps):
        _, finished = step(s, rule)
        outputs.update((o.rid, o) for o in finished)
        if not s.running and not s.waiting:
            return outputs
        assert_slots_consistent(s)
    raise AssertionError("requests did not finish")


def expected_output(msg: GenerateRequest, rule=next_token) -> list[int]:
    fill = list(msg.input_ids)
    for _ in range(msg.params.max_new_tokens):
        fill.append(rule(fill))
    return fill[len(msg.input_ids) :]


def assert_slots_consistent(s: Scheduler) -> None:
    """Every slot is free, in the tree, or held by exactly one running request."""
    held = [slot for r in s.running for slot in r.slots[r.cached_len :] + r.dup_slots]
    tree, stack = [], list(s.kv.tree.root.children.values()) if isinstance(s.kv.tree, RadixTree) else []
    while stack:
        node = stack.pop()
        tree += node.value
        stack += node.children.values()
    free = s.kv.allocator.alloc(s.kv.allocator.num_free)
    s.kv.allocator.free(free)  # put back: the test goes on
    everything = held + tree + free
    assert sorted(everything) == list(range(1, s.kv.capacity + 1))


def test_chunked_prefill_then_decode():
    s = make()
    s.add(request("a", 20))
    scheduled, _ = step(s)
    plan = scheduled.batch
    assert plan.kind == "extend" and len(plan.reqs) == 1 and plan.reqs[0].tokens == list(range(3, 11))
    assert plan.reqs[0].sample is False and plan.reqs[0].start == 0
    step(s), step(s)  # the last chunk of "a" (4 tokens) samples its first token
    assert len(s.running[0].output_ids) == 1
    for _ in range(9):
        scheduled, finished = step(s)
        plan = scheduled.batch
        assert plan.kind == "decode" and len(plan.reqs) == 1 and plan.reqs[0].sample
    assert [f.finish_reason.wire() for f in finished] == [{"type": "length", "length": 10}]
    # Nothing is held once it finished; its tokens stay cached.
    assert s.stats()["kv_used"] == 0 and s.kv.tree.size == 29 == s.kv.tree.evictable


def test_admission_by_estimate_runs_requests_side_by_side():
    """Whole needs (60 + 60) exceed the pool of 100, estimates (10 + 0.7 * 50) do not: both run."""
    s = make(capacity=100)
    s.add(request("a", 10, new=50))
    s.add(request("b", 10, new=50, first=50))
    scheduled, _ = step(s)
    plan = scheduled.batch
    assert len(plan.reqs) == 1  # the chunk of 8 goes to a; b waits for budget, not memory
    scheduled, _ = step(s)
    plan = scheduled.batch
    assert len(s.running) == 2 and [len(r.tokens) for r in plan.reqs] == [2, 6]


def test_prefill_budget_is_not_eaten_by_decodes():
    """As many decoding requests as the chunk size: new prompts still get prefilled."""
    s = make(capacity=200, chunk=4, max_running=8)
    for i in range(4):
        s.add(request(f"d{i}", 1, new=50, first=10 * i + 3))
    step(s)
    assert len(s.running) == 4 and all(r.prefill_done for r in s.running)
    s.add(request("late", 6, first=100))
    scheduled, _ = step(s)
    plan = scheduled.batch
    assert plan.kind == "extend" and plan.num_tokens == 4 + 4  # a 4-token chunk beside 4 decodes


def test_largest_step_is_reached_and_measured():
    """A prefill chunk beside every other running request's token and drafts: more than
    --chunked-prefill-size rows in one step, exactly the largest step, which is what the workers
    run to measure their activation peak at start-up."""
    s = Scheduler(0, 200, 4, 4, 100, 300, eos_ids=(1,), seed=0, num_drafts=2, speculative_algorithm="NEXTN")
    for i in range(3):
        s.add(request(f"d{i}", 1, new=50, first=10 * i + 3))
    scheduled, _ = step(s)
    s.set_drafts(draft_batch(scheduled)[1], [[5, 6]] * 3)  # the MTP layer's chains
    s.add(request("late", 6, first=100))
    scheduled, _ = step(s)
    plan = scheduled.batch
    assert plan.kind == "extend" and plan.num_tokens == 4 + 3 * (1 + 2) > s.chunk_size
    assert largest_step(4, 4, 2, 100) == ([4], 3) and largest_step(10, 4, 2, 4) == ([4, 4], 2)
    cfg = SimpleNamespace(chunk_per_group=4, running_per_group=4, num_drafts=2)
    measured = peak_step(cfg, 100)
    assert measured.num_tokens == plan.num_tokens and measured.num_logit_rows == 1 + 3 * 3
    assert [len(r.tokens) for r in measured.reqs] == [4, 3, 3, 3]


def test_oversubscribed_pool_retracts_and_every_output_is_unchanged():
    s = make(capacity=60, chunk=16, max_running=8)
    msgs = [request(f"r{i}", 5 + i, new=30, first=7 * i + 3) for i in range(8)]
    assert sum(len(m.input_ids) + 30 for m in msgs) >= 4 * 60
    outputs = run(s, msgs)
    assert s.counters["retractions"] > 0
    for m in msgs:
        assert outputs[m.rid].output_ids == expected_output(m), m.rid
    assert s.stats()["kv_used"] == 0 and s.new_token_ratio >= 0.1


def test_retraction_order_and_protection():
    s = make(capacity=80, chunk=40, max_running=8, radix=False)
    s.add(request("short", 4, new=30))
    s.add(request("long", 8, new=30, first=40))
    step(s)
    assert len(s.running) == 2
    s.kv.allocator.alloc(s.kv.allocator.num_free)  # the pool is suddenly full: the next step must retract
    step(s)
    # Both generated one token: the longer prompt goes first, back to the front of the queue.
    assert [r.rid for r in s.waiting] == ["long"] and [r.rid for r in s.running] == ["short"]
    assert s.waiting[0].retractions == 1 and not s.waiting[0].slots and s.counters["retractions"] == 1

    # Retracted MAX_RETRACTIONS times: admitted with its whole need reserved, never retracted again.
    s = make(capacity=80, chunk=40, max_running=8, radix=False)
    s.add(request("veteran", 8, new=30, first=40))
    s.waiting[0].retractions = MAX_RETRACTIONS
    s.add(request("young", 4, new=30))
    step(s)
    veteran, young = s.running
    assert veteran.protected and not young.protected
    s.kv.allocator.alloc(s.kv.allocator.num_free)
    step(s)
    assert s.running == [veteran] and s.waiting[0] is young


def test_prefix_cache_hit_prefills_only_the_suffix():
    s = make(capacity=100, chunk=64)
    shared = request("a", 30, new=4)
    first = run(s, [shared])["a"]
    assert first.cached_tokens == 0
    again = GenerateRequest("b", shared.input_ids, shared.params)
    s.add(again)
    scheduled, _ = step(s)
    plan = scheduled.batch
    # The whole prompt was cached but one token: its logits give the first new token.
    assert plan.reqs[0].start == 29 and plan.reqs[0].prefix and plan.reqs[0].tokens == shared.input_ids[-1:]
    out = run(s, [])["b"]
    assert out.cached_tokens == 29 and out.output_ids == first.output_ids
    extended = GenerateRequest("c", shared.input_ids[:20] + [250, 251], shared.params)
    assert run(s, [extended])["c"].cached_tokens == 20


def test_eviction_under_pressure_keeps_cached_prefixes_right():
    s = make(capacity=64, chunk=32, max_running=4)
    base = list(range(3, 23))
    msgs = [
        GenerateRequest(f"r{i}", base + [100 + i] * (i + 1), SamplingParams(max_new_tokens=12, temperature=0))
        for i in range(10)
    ]
    outputs = run(s, msgs)
    assert s.counters["cache_evicted_tokens"] > 0 and s.counters["cache_hit_tokens"] > 0
    for m in msgs:
        assert outputs[m.rid].output_ids == expected_output(m)
    assert_slots_consistent(s)


def test_abort_releases_locks_and_what_never_fits_is_refused_before_it_is_queued():
    s = make()
    big = request("big", 45, new=10)
    with pytest.raises(ValueError, match="needs 55 KV tokens"):  # the front end's one check
        check_request(big.input_ids, big.params, s.vocab_size, s.context_len, s.kv.capacity)
    with pytest.raises(ValueError, match=r"^token id 400 is outside the vocabulary \[0, 300\)$"):
        check_request([5, 400], SamplingParams(), s.vocab_size, s.context_len, s.kv.capacity)
    s.add(request("a", 5))
    s.add(request("w", 45, new=5))
    step(s)
    assert s.abort("a").finish_reason.wire() == {"type": "abort", "message": "aborted"}
    assert s.abort("w").finish_reason.wire()["type"] == "abort"
    assert not s.running and not s.waiting and s.stats()["kv_used"] == 0
    assert s.kv.tree.evictable == s.kv.tree.size and s.abort("unknown") is None


def test_stop_on_eos():
    s = make()
    s.add(GenerateRequest("a", [5, 6], SamplingParams(max_new_tokens=10, temperature=0)))
    scheduled = s.schedule()
    _, finished = s.process_samples(scheduled, [[1]], [[0.0]])
    assert (
        finished[0].finish_reason.wire() == {"type": "stop", "matched": 1} and scheduled.batch.reqs[0].sample
    )


def test_radix_tree_split_lock_evict():
    t = RadixTree()
    assert t.insert([1, 2, 3, 4], [11, 12, 13, 14]) == 0
    assert t.insert([1, 2, 9], [21, 22, 29]) == 2  # 21, 22 stay the caller's
    slots, node, n = t.match_prefix([1, 2, 3, 7])
    assert (slots, n) == ([11, 12, 13], 3) and t.size == 5
    t.lock(node)
    assert t.evictable == 2  # the [9] leaf and the [4] leaf below the locked node
    assert sorted(t.evict(10)) == [14, 29]
    t.unlock(node)
    assert sorted(t.evict(10)) == [11, 12, 13] and t.size == 0


@pytest.mark.parametrize("radix", [True, False])
@pytest.mark.parametrize("drafts,rule", [(0, next_token), (3, next_token), (3, periodic_token)])
def test_many_random_requests_finish_exactly(radix, drafts, rule):
    import random

    rng = random.Random(radix)
    s = make(capacity=80, chunk=12, max_running=6, radix=radix, drafts=drafts)
    prefixes = [[rng.randrange(3, 290) for _ in range(rng.randrange(5, 20))] for _ in range(3)]
    msgs = []
    for i in range(40):
        prompt = rng.choice(prefixes) + [rng.randrange(3, 290) for _ in range(rng.randrange(1, 10))]
        new = rng.randrange(1, 80 - len(prompt))
        params = SamplingParams(max_new_tokens=new, temperature=0, ignore_eos=True)
        msgs.append(GenerateRequest(f"r{i}", prompt, params))
    outputs = run(s, msgs, rule=rule)
    for m in msgs:
        assert outputs[m.rid].output_ids == expected_output(m, rule), m.rid
    stats = s.stats()
    assert stats["kv_used"] == 0
    if drafts:  # a token comes from a (re)started prefill, or a verify step: accepted drafts + the next
        steps = sum(o.spec_verify_ct for o in outputs.values())
        prefills = len(msgs) + stats["retractions"]
        assert stats["spec_verify_steps"] == steps
        assert stats["generated_tokens"] == prefills + steps + stats["spec_accepted_tokens"]
        if rule is periodic_token:
            assert stats["spec_accepted_tokens"] > stats["generated_tokens"] / 3


def test_penalty_counts_follow_outputs_through_retraction():
    """The device token counts of requests with penalties, kept beside the scheduler as a group
    leader keeps them, equal a recount of their tokens after every step, across retractions
    (re-admission refills them) and verify steps; every row is given back when its request ends."""
    counts = TokenCounts(300, 8)
    s = make(capacity=60, chunk=16, max_running=8, drafts=2)
    msgs = [request(f"r{i}", 5 + i, new=30, first=7 * i + 3) for i in range(8)]
    for m in msgs[::2]:
        m.params.repetition_penalty = 1.2
    for m in msgs:
        s.add(m)
    finished = {}
    while s.running or s.waiting:
        _, done = step(s, periodic_token, counts)
        finished.update((o.rid, o) for o in done)
        for r in s.running:
            row = counts.rows.get(r.rid)
            if r.prefill_done:  # it sampled since its (re)admission
                assert (row is not None) == (r.params.repetition_penalty != 1), r.rid
            if row is not None:
                assert counts.output[row].tolist() == [r.output_ids.count(t) for t in range(300)]
                assert counts.prompt[row].nonzero().flatten().tolist() == sorted(set(r.input_ids))
    assert s.counters["retractions"] > 0 and s.counters["spec_accepted_tokens"] > 0
    follow_counts(counts, s.running, [])
    assert counts.rows == {} and len(finished) == len(msgs)


def test_flush_cache_drops_what_no_running_request_holds():
    s = make(capacity=100)
    run(s, [request("a", 20)])
    assert s.kv.tree.size == 29
    s.add(request("b", 12, first=50))
    step(s), step(s)  # b is running: its cached prefix is locked
    s.flush_cache()
    assert s.kv.tree.size == s.running[0].kv_len and s.kv.tree.evictable == 0
    assert s.counters["cache_evicted_tokens"] == 29


def test_a_cached_prefix_reaches_the_table_even_when_its_admitting_step_adds_nothing():
    """The cached prefix of an admitted request goes into its table row with its first chunk, in
    whichever step that comes: here the admitting step is made to add no token (as if it had no
    room left), and the request still attends its cached tokens (`step` checks every position it
    attends has a slot), gives the same tokens, and leaves nothing held."""
    s = make(capacity=60)
    first = request("a", 20)
    run(s, [first])
    other = request("c", 6, first=50)  # takes the table row a had, so b gets a row never written
    follow = request("b", 24)  # its first 20 tokens are a's prompt, cached
    assert s.add(other) is None and s.add(follow) is None
    admitting = ScheduledStep()
    assert s._admit(admitting, s.waiting[0], reserved=0) and s.waiting.popleft() is s.running[-1]
    assert s._admit(admitting, s.waiting[0], reserved=0)
    req = s.waiting.popleft()
    assert req.cached_len == 20 and s._add_chunk(admitting, req, budget=0, reserved=0) == 0
    outputs = run(s, [])
    assert outputs["b"].output_ids == expected_output(follow)
    assert outputs["c"].output_ids == expected_output(other)
    assert outputs["b"].cached_tokens == 20
    assert s.stats()["kv_used"] == 0 and not s.running
    assert_slots_consistent(s)
