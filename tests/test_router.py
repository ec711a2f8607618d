"""Load balancing across DP groups, on the router alone (exact counts)."""

from __future__ import annotations

import random

import pytest

from dpserve.server.router import Router


def test_round_robin_alternates():
    r = Router(3, "round_robin")
    assert [r.route(str(i), 100 * i, 10) for i in range(7)] == [0, 1, 2, 0, 1, 2, 0]


def test_pinned_requests_count_but_keep_their_group():
    r = Router(2, "minimum_tokens")
    assert [r.route(str(i), 50, 50, pinned=1) for i in range(3)] == [1, 1, 1]
    assert r.outstanding_tokens == [0, 300] and r.route("x", 10, 10) == 0
    with pytest.raises(ValueError, match=r"data_parallel_rank=2 is outside \[0, 2\)"):
        r.route("y", 1, 1, pinned=2)


def test_outstanding_tokens_follow_progress():
    r = Router(2)
    r.route("a", 30, 10)
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
        r = Router(4, method)
        for i, (p, d) in enumerate(sizes):
            r.route(str(i), p, d)
            if method == "minimum_tokens":
                assert max(r.outstanding_tokens) - min(r.outstanding_tokens) <= largest
        spread[method] = max(r.outstanding_tokens) / min(r.outstanding_tokens)
    # The stated factor: at most 1.5x once the burst is routed; the others are worse here.
    assert spread["minimum_tokens"] <= 1.5
    assert (
        spread["shortest_queue"] > spread["minimum_tokens"]
        and spread["round_robin"] > spread["minimum_tokens"]
    )
