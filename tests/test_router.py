"""Load balancing across DP groups, on the router alone (exact counts)."""

from __future__ import annotations

import random

import pytest

from dpserve.config import EngineConfig
from dpserve.engine.router import Router


def router(groups: int, method: str = "cache_aware", **options) -> Router:
    """A router over `groups` replicas (routing is the same over DP attention groups)."""
    return Router(EngineConfig("unused", dp_size=groups, load_balance_method=method, **options))


def ids(n: int, first: int = 0) -> list[int]:
    return list(range(first, first + n))


def test_round_robin_alternates():
    r = router(3, "round_robin")
    assert [r.route(str(i), ids(100 * i + 1), 10) for i in range(7)] == [0, 1, 2, 0, 1, 2, 0]


def test_pinned_requests_count_but_keep_their_group():
    for method in ("minimum_tokens", "cache_aware"):
        r = router(2, method)
        assert [r.route(str(i), ids(50), 50, pinned=1) for i in range(3)] == [1, 1, 1]
        assert r.outstanding_tokens == [0, 300] and r.route("x", ids(10, 500), 10) == 0
        with pytest.raises(ValueError, match=r"data_parallel_rank=2 is outside \[0, 2\)"):
            r.route("y", ids(1), 1, pinned=2)


def test_outstanding_tokens_follow_progress():
    r = router(2)
    r.route("a", ids(30), 10)
    assert r.outstanding_tokens == [40, 0]
    r.on_token("a")  # the first token: the prompt is prefilled
    assert r.outstanding_tokens == [9, 0]
    r.on_token("a")
    assert r.outstanding_tokens == [8, 0]
    r.on_finish("a")
    assert r.outstanding_tokens == [0, 0] and r.requests == [0, 0]


def test_minimum_tokens_spreads_a_skewed_burst():
    """A few long requests among many short ones: counting tokens at routing time keeps the
    most-loaded group within one request's size of the least-loaded (shortest_queue does not)."""
    rng = random.Random(0)
    sizes = [(2000, 1000) if i % 10 == 0 else (rng.randint(20, 60), rng.randint(10, 40)) for i in range(100)]
    largest = max(p + d for p, d in sizes)
    spread = {}
    for method in ("minimum_tokens", "shortest_queue", "round_robin"):
        r = router(4, method)
        for i, (p, d) in enumerate(sizes):
            r.route(str(i), ids(p, 10 * i), d)
            if method == "minimum_tokens":
                assert max(r.outstanding_tokens) - min(r.outstanding_tokens) <= largest
        spread[method] = max(r.outstanding_tokens) / min(r.outstanding_tokens)
    # The stated factor: at most 1.5x once the burst is routed; the others are worse here.
    assert spread["minimum_tokens"] <= 1.5
    assert (
        spread["shortest_queue"] > spread["minimum_tokens"]
        and spread["round_robin"] > spread["minimum_tokens"]
    )


def test_cache_aware_keeps_a_conversation_on_its_group():
    """Each turn extends the previous prompt (history + answer + new question): it goes where the
    history went, whatever else arrives meanwhile."""
    rng = random.Random(1)
    r = router(4, "cache_aware")
    conversations = {c: [rng.randrange(3, 1000) for _ in range(40)] for c in range(8)}
    groups: dict[int, set[int]] = {c: set() for c in conversations}
    for turn in range(5):  # the conversations' turns are in flight together
        for c, history in conversations.items():
            groups[c].add(r.route(f"{c}-{turn}", history, 20))
        for c, history in conversations.items():
            r.on_finish(f"{c}-{turn}")
            history += [rng.randrange(3, 1000) for _ in range(30)]
    assert all(len(g) == 1 for g in groups.values())
    assert len(set().union(*groups.values())) == 4  # the conversations were spread over the groups


def test_cache_aware_flood_with_one_prefix_spreads_past_the_load_gap():
    r = router(2, balance_abs_threshold=1000, balance_rel_threshold=1.5)
    system = ids(200, 5000)
    routed = [r.route(str(i), system + [i], 100) for i in range(20)]  # never finishing: load grows
    first_switch = routed.index(1)
    # Requests of 301 outstanding tokens: group 0 takes them until it leads by more than 1000.
    assert routed[:first_switch] == [0] * 4 and first_switch == 4
    assert routed.count(1) >= 8  # both groups hold the prefix now; load decides between them
    gap = max(r.outstanding_tokens) - min(r.outstanding_tokens)
    assert gap <= 1000 + 301


def test_cache_aware_tree_is_bounded_and_forgets_least_recent():
    r = router(1, max_tree_size=100)
    for i in range(10):
        r.route(str(i), ids(30, 1000 * i), 1)
    assert r.trees[0].size <= 100
    assert r.trees[0].match_prefix(ids(30, 9000))[2] == 30  # the latest is kept
    assert r.trees[0].match_prefix(ids(30, 0))[2] == 0  # the oldest is gone


def test_cache_aware_policy_is_validated():
    with pytest.raises(ValueError, match="cache_threshold must be in"):
        router(2, cache_threshold=1.5)
    with pytest.raises(ValueError, match="balance thresholds"):
        router(2, balance_rel_threshold=0.5)


@pytest.mark.parametrize("method", ["cache_aware", "minimum_tokens", "shortest_queue", "round_robin"])
def test_no_request_waits_behind_a_full_group_while_another_has_room(method):
    """One running slot per group (--max-running-requests 2 over 2 DP attention groups, 3 over 3; 1
    for each replica) and requests sharing their whole prompt, as users sharing a system prompt do:
    while a group has a free slot the request goes there, whatever its prefix; with every group
    full, the method (the prefix, for cache_aware) decides again."""
    for groups, dp_attention in ((2, True), (3, True), (2, False)):
        layout = dict(tp_size=groups, enable_dp_attention=True) if dp_attention else {}
        r = router(groups, method, max_running_requests=groups if dp_attention else 1, **layout)
        prompt = ids(300, 7)
        assert sorted(r.route(str(i), prompt, 50) for i in range(groups)) == list(range(groups))
        r.on_finish("1")  # group 1's slot frees: the next request starts there
        assert r.route("again", prompt, 50) == 1
        queued = r.route("queued", prompt, 50)  # all full: it waits where the method puts it
        assert 0 <= queued < groups and r.requests[queued] == 2
    pinned = router(2, method, max_running_requests=1)
    pinned.route("a", ids(10), 5, pinned=0)
    assert pinned.route("b", ids(10), 5, pinned=0) == 0  # a pin is kept, full or not
    assert pinned.route("c", ids(10), 5) == 1
