"""N-gram drafts and the acceptance rules of speculative decoding (pure functions, CPU)."""

from __future__ import annotations

import math
import random
import time

import pytest
import torch

from dpserve.speculative.ngram import propose_ngram
from dpserve.speculative.rejection import greedy_accept, rejection_sample

# ---------------------------------------------------------------------------------------------- n-gram


def test_ngram_latest_occurrence_wins():
    # suffix [1, 2] occurs at 0..1 (followed by 3, 4) and at 4..5 (followed by 9, 8): the later one wins.
    tokens = [1, 2, 3, 4, 1, 2, 9, 8, 7, 1, 2]
    assert propose_ngram(tokens, 2, max_match=2) == [9, 8]
    assert propose_ngram(tokens, 5, max_match=2) == [9, 8, 7, 1, 2]


def test_ngram_longer_match_preferred():
    # last 3 tokens [5, 1, 2] occur only early (followed by 3); [1, 2] alone occurs later (followed by 9).
    tokens = [5, 1, 2, 3, 6, 1, 2, 9, 0, 5, 1, 2]
    assert propose_ngram(tokens, 1, max_match=3) == [3]
    assert propose_ngram(tokens, 1, max_match=2) == [9]
    assert propose_ngram(tokens, 1, max_match=3, min_match=3) == [3]


def test_ngram_truncation_and_overlap():
    # the latest earlier occurrence of [7] ends right before the last token: only one follower exists.
    assert propose_ngram([3, 7, 7], 4, max_match=1) == [7]
    # overlapping occurrence: [1, 1] at 1..2 is followed by the suffix's last token only.
    assert propose_ngram([1, 1, 1, 1], 3, max_match=2) == [1]
    assert propose_ngram([4, 5, 6, 4, 5], 10, max_match=2) == [6, 4, 5]


def test_ngram_no_match():
    assert propose_ngram([1, 2, 3, 4], 3) == []
    assert propose_ngram([], 3) == []
    assert propose_ngram([1], 3) == []
    assert propose_ngram([1, 2, 1], 0) == []
    # a match shorter than min_match does not count
    assert propose_ngram([1, 2, 3, 1], 2, max_match=4, min_match=2) == []
    assert propose_ngram([1, 2, 3, 1], 2, max_match=4, min_match=1) == [2, 3]


def _brute_force(tokens, num_draft, max_match, min_match):
    n = len(tokens)
    for k in range(max_match, min_match - 1, -1):
        if k >= n:
            continue
        for end in range(n - 1, k - 1, -1):  # occurrence tokens[end-k:end], end < n
            if tokens[end - k : end] == tokens[n - k :]:
                return tokens[end : end + num_draft]
    return []


def test_ngram_matches_brute_force_and_is_fast():
    rng = random.Random(0)
    for _ in range(300):
        tokens = [rng.randrange(4) for _ in range(rng.randrange(0, 30))]
        args = (rng.randrange(1, 5), rng.randrange(1, 5))
        max_match, min_match = max(args), min(args)
        num = rng.randrange(0, 6)
        assert propose_ngram(tokens, num, max_match, min_match) == _brute_force(
            tokens, num, max_match, min_match
        )
    # a 4000-token context without any repeated suffix: the worst case, every k scans everything
    tokens = [rng.randrange(1000, 100000) for _ in range(4000)]
    # Measured beside the brute force (a scan per k in Python, the same complexity): a third of its
    # time at most, whatever the machine's speed (it takes an eighth).
    start = time.perf_counter()
    for _ in range(10):
        propose_ngram(tokens, 4)
    fast = time.perf_counter() - start
    start = time.perf_counter()
    for _ in range(10):
        _brute_force(tokens, 4, 4, 1)
    assert fast < (time.perf_counter() - start) / 3


# ---------------------------------------------------------------------------------------------- greedy


def test_greedy_accept():
    assert greedy_accept([], [7]) == [7]
    assert greedy_accept([1, 2, 3], [1, 2, 3, 4]) == [1, 2, 3, 4]  # all accepted + bonus
    assert greedy_accept([1, 2, 3], [1, 5, 3, 4]) == [1, 5]  # first mismatch: the target's token
    assert greedy_accept([1, 2, 3], [9, 2, 3, 4]) == [9]
    with pytest.raises(ValueError):
        greedy_accept([1, 2], [1, 2])


# ---------------------------------------------------------------------------------------------- sampling

N_DRAWS = 40_000
# Binomial standard error of an empirical frequency from n draws is sqrt(p(1-p)/n) <= 0.5/sqrt(n); with
# n = 40,000 that is <= 0.0025, so the 0.0125 bound on the first token is 5 sigma for the worst category
# (a false failure has probability ~1e-6 per category; the seed is fixed anyway). Conditional checks on
# fewer rows use the same 5-sigma rule computed from their own row count.
TOL_FIRST = 5 * 0.5 / math.sqrt(N_DRAWS)

P = torch.tensor(
    [
        [0.10, 0.40, 0.05, 0.25, 0.20],  # target at position 0
        [0.30, 0.05, 0.30, 0.15, 0.20],  # target at position 1 (after draft 0)
        [0.05, 0.15, 0.20, 0.50, 0.10],  # target at position 2 (bonus for k=2)
    ]
)


def _frequencies(tokens: torch.Tensor, vocab: int) -> torch.Tensor:
    return torch.bincount(tokens, minlength=vocab).double() / max(len(tokens), 1)


def _check(tokens: torch.Tensor, num: torch.Tensor, draft: torch.Tensor, k: int) -> None:
    vocab = P.shape[1]
    assert ((num >= 1) & (num <= k + 1)).all()
    err0 = (_frequencies(tokens[:, 0], vocab) - P[0].double()).abs().max().item()
    assert err0 < TOL_FIRST, (err0, TOL_FIRST)
    if k >= 2:
        # Rows that emitted a second token accepted draft 0, so their first token is draft 0 and the
        # target's distribution for the second token is P[1] (conditioned on draft 0 in a real model).
        second = num >= 2
        assert (tokens[second, 0] == draft[second, 0]).all()
        n2 = int(second.sum())
        err1 = (_frequencies(tokens[second, 1], vocab) - P[1].double()).abs().max().item()
        assert n2 > 5000 and err1 < 5 * 0.5 / math.sqrt(n2), (err1, n2)


def verify(drafts: torch.Tensor, p: torch.Tensor, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """`rejection_sample` on B requests of k drafts each (p: [k+1, V], every request's targets):
    (tokens [B, k+1], emitted [B]) with tokens past the emitted ones left as drawn."""
    batch, k = drafts.shape
    rows = batch * (k + 1)
    flat = torch.cat([drafts, drafts.new_zeros(batch, 1)], 1).flatten()
    has = torch.arange(k + 1).repeat(batch) < k
    tokens, accepted = rejection_sample(
        p.repeat(batch, 1),
        flat,
        has,
        torch.rand(rows, generator=gen),
        torch.empty(rows, p.shape[1]).exponential_(generator=gen),
        torch.arange(rows).view(batch, k + 1),
        torch.arange(batch).repeat_interleave(k + 1),
        torch.arange(k + 1).repeat(batch),
    )
    return tokens.view(batch, k + 1), accepted + 1


@pytest.mark.parametrize("k", [1, 2])
def test_rejection_sampling_deterministic_drafts(k):
    gen = torch.Generator().manual_seed(99 + k)
    # fixed drafts (n-gram / greedy chain) on half the rows, another fixed chain on the other half
    draft = torch.tensor([[1, 2], [3, 0]][0][:k]).repeat(N_DRAWS, 1)
    draft[N_DRAWS // 2 :] = torch.tensor([3, 0][:k])
    tokens, num = verify(draft, P[: k + 1], gen)
    _check(tokens, num, draft, k)
    # a deterministic draft is accepted with probability p(x)
    accept0 = (num[: N_DRAWS // 2] >= 2).double().mean().item()
    assert abs(accept0 - P[0, 1].item()) < 5 * 0.5 / math.sqrt(N_DRAWS // 2)


def test_rejection_sample_edge_cases():
    gen = torch.Generator().manual_seed(0)
    # a draft the target gives probability 0 is always rejected; the replacement is never that token
    p = torch.tensor([[0.0, 0.5, 0.5, 0.0, 0.0], [0.2, 0.2, 0.2, 0.2, 0.2]])
    tokens, num = verify(torch.zeros(200, 1, dtype=torch.long), p, gen)
    assert (num == 1).all() and set(tokens[:, 0].tolist()) == {1, 2}
    # one-hot targets agreeing with the drafts: greedy-like, all accepted, then the bonus token
    tokens, num = verify(torch.tensor([[4, 3]] * 20), torch.eye(5)[[4, 3, 2]], gen)
    assert (num == 3).all() and (tokens == torch.tensor([4, 3, 2])).all()
