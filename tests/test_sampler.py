"""The sampler's filters, checked on a hand-made distribution."""

from __future__ import annotations

import torch
from conftest import CountOps

from dpserve.grammar import token_bitmask
from dpserve.sampling_params import SamplingParams
from dpserve.worker.sampler import GrammarMask, Penalties, sample, uniforms
from dpserve.worker.token_counts import TokenCounts

PROBS = torch.tensor([0.4, 0.3, 0.2, 0.1])


def draws(params: SamplingParams, n: int = 300) -> set[int]:
    logits = PROBS.log().repeat(n, 1)
    tokens = sample(logits, [params] * n, [(r, 0) for r in range(n)]).tokens
    return {t for (t,) in tokens}


def test_filters():
    assert draws(SamplingParams(temperature=1.0)) == {0, 1, 2, 3}
    assert draws(SamplingParams(temperature=1.0, top_k=2)) == {0, 1}
    assert draws(SamplingParams(temperature=1.0, top_p=0.65)) == {0, 1}
    assert draws(SamplingParams(temperature=1.0, top_p=0.3)) == {0}
    assert draws(SamplingParams(temperature=1.0, min_p=0.45)) == {0, 1, 2}
    assert draws(SamplingParams(temperature=0.0)) == {0}


def test_logprob_is_of_the_model_distribution():
    logits = PROBS.log()[None]
    tokens, logprobs, _, _ = sample(logits, [SamplingParams(temperature=0.0)], [(0, 0)])
    assert tokens == [[0]] and abs(logprobs[0][0] - PROBS[0].log().item()) < 1e-6


def test_sampled_frequencies_follow_the_filtered_distribution():
    """4,000 draws (fixed seed): each token's frequency within 0.03 of its probability (over 6
    standard deviations at these sizes), for the plain and the top-k renormalized distribution."""
    n = 4000
    for params, expected in (
        (SamplingParams(temperature=1.0), PROBS),
        (SamplingParams(temperature=1.0, top_k=2), torch.tensor([4 / 7, 3 / 7, 0, 0])),
    ):
        tokens = sample(PROBS.log().repeat(n, 1), [params] * n, [(0, r) for r in range(n)]).tokens
        freq = torch.bincount(torch.tensor(tokens).flatten(), minlength=4) / n
        assert (freq - expected).abs().max() < 0.03, (params, freq)


def test_seeded_rows_do_not_depend_on_their_batch():
    seeded = SamplingParams(temperature=0.8, seed=7)
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(1))
    alone = sample(logits[1:2], [seeded], [(7, 5)]).tokens
    other = SamplingParams(temperature=1.0, top_p=0.5)
    batch = sample(logits, [other, seeded, SamplingParams(temperature=0.0)], [(3, 0), (7, 5), (3, 0)]).tokens
    assert batch[1] == alone[0]


def test_every_row_chosen_at_once():
    """Greedy and sampled rows of a batch chosen by two argmaxes over all rows, whatever the batch
    size, with no scalar read back per request (each is a device sync on a GPU); the same tokens
    as each request sampled alone."""
    logits = torch.randn(12, 50, generator=torch.Generator().manual_seed(2))
    params = [SamplingParams(temperature=0.0 if i % 3 == 0 else 0.7, top_k=20, seed=i) for i in range(12)]
    with CountOps() as ops:
        batch = sample(logits, params, [(i, 0) for i in range(12)])
    assert ops.calls["argmax"] == 2 and ops.calls["_local_scalar_dense"] == 0, ops.calls
    for i in range(12):
        alone = sample(logits[i : i + 1], params[i : i + 1], [(i, 0)])
        assert alone.tokens[0] == batch.tokens[i] and alone.logprobs[0] == batch.logprobs[i]


def mixed_batch(n: int) -> tuple:
    """n requests cycling through every kind of row a step samples: greedy and sampled, with and
    without drafts, penalties with the min_new_tokens floor, logit bias, top logprobs."""
    kinds = [
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=0.7, top_k=5, top_p=0.9, min_p=0.05),
        SamplingParams(temperature=1.0, frequency_penalty=0.5, min_new_tokens=4, logit_bias={3: 2.0}),
        SamplingParams(temperature=0.0, repetition_penalty=1.3, top_logprobs_num=3),
    ]
    params = [kinds[i % 4] for i in range(n)]
    drafts = [[(5 * i + j) % 50 for j in range(i % 3)] for i in range(n)]
    counts = TokenCounts(50, n)
    for i, p in enumerate(params):
        if p.penalized:
            counts.acquire(str(i), [1, 2, i % 50], [i % 7])
    penalties = Penalties(
        counts,
        [counts.rows.get(str(i), -1) for i in range(n)],
        [4 if p.min_new_tokens else 0 for p in params],
        [[0, 7] if p.min_new_tokens else [] for p in params],
    )
    rows = sum(1 + len(d) for d in drafts)
    logits = torch.randn(rows, 50, generator=torch.Generator().manual_seed(n))
    return logits, params, [(i, 3) for i in range(n)], drafts, penalties


def test_device_ops_per_step_do_not_depend_on_the_batch_size():
    """Every op a step runs on the logits' device (host-to-device copies, draws, verification of all
    drafts) is one op for the whole batch: 8 and 32 requests run exactly the same ops."""
    calls = []
    for n in (8, 32):
        batch = mixed_batch(n)
        with CountOps() as ops:
            samples = sample(*batch)
        assert len(samples.tokens) == n and all(samples.tokens)
        calls.append(ops.calls)
    assert calls[0] == calls[1], set(calls[0].items()) ^ set(calls[1].items())
    assert calls[0]["_local_scalar_dense"] == 0 and calls[0]["exponential_"] == 0


def test_extreme_valid_values_never_sample_nan():
    """Values the API allows that underflow float32: a temperature of 1e-300 samples greedily,
    a top_p of 5e-324 keeps the most likely token, a top_k past int64's reach of the vocabulary
    keeps all of it; none yields NaN or token 0 by default."""
    logits = torch.tensor([[0.0, 3.0, 1.0, 2.0]]).repeat(50, 1)
    for params, expected in (
        (SamplingParams(temperature=1e-300), {1}),
        (SamplingParams(temperature=1.0, top_p=5e-324), {1}),
        (SamplingParams(temperature=1.0, top_p=5e-324, min_p=1.0, top_k=2**63 - 1), {1}),
        (SamplingParams(temperature=1e300, top_k=2**63 - 1), {0, 1, 2, 3}),
    ):
        samples = sample(logits, [params] * 50, [(r, 0) for r in range(50)])
        assert {t for (t,) in samples.tokens} == expected, params
        assert all(lp[0] == lp[0] for lp in samples.logprobs) and samples.errors == [None] * 50


def test_a_row_that_allows_no_token_ends_with_an_error():
    """min_tokens forbidding every token (all stop ids), or NaN logits: the row is not sampled;
    its request gets no token and an error, and the other rows of the batch are served as usual."""
    logits = torch.tensor([[0.0, 3.0, 1.0, 2.0]]).repeat(3, 1)
    logits[2, 1] = float("nan")
    params = [SamplingParams(temperature=0.0), SamplingParams(temperature=0.7, seed=1, min_new_tokens=3)]
    params.append(SamplingParams(temperature=0.0))
    penalties = Penalties(TokenCounts(4, 4), [-1] * 3, [0, 3, 0], [[], [0, 1, 2, 3], []])
    samples = sample(logits, params, [(0, 0)] * 3, penalties=penalties)
    assert samples.tokens == [[1], [], []]
    assert samples.errors[0] is None and "no token can be sampled" in samples.errors[1] == samples.errors[2]


def test_huge_penalties_and_biases_stay_finite():
    """A repetition penalty below 1 multiplies a huge logit past float32 (+inf, then NaN in the
    softmax): penalties and biases are clamped to finite logits, so the token is still drawn."""
    logits = torch.tensor([[0.0, -3e38, 3e38, 1.0]])
    counts = TokenCounts(4, 1)
    counts.acquire("r", [1, 2], [2] * 1000)
    params = SamplingParams(repetition_penalty=0.5, frequency_penalty=-2.0, logit_bias={1: -100.0})
    samples = sample(logits, [params], [(0, 0)], penalties=Penalties(counts, [0], [0], [[]]))
    assert samples.errors == [None] and samples.tokens == [[2]]


def test_a_token_of_probability_zero_is_never_drawn():
    """A token the grammar masks or a filter cuts has probability 0 and must never win the race.
    With 24 random bits the generator's top value rounded to u = 1.0 (key (1, 16377) did at column
    390): its Exp(1) draw was 0, and 0 / 0 = NaN won argmax for a forbidden token. 16,384 keys over
    512 tokens (8.4 M draws, 2^23 possible values each), the only allowed tokens 7 and 8."""
    n, vocab = 16384, 512
    keys = [(1, c) for c in range(n)]
    lo, hi = torch.tensor([k[0] for k in keys]), torch.zeros(n, dtype=torch.long)
    u = uniforms(lo, hi, torch.tensor([k[1] for k in keys]), vocab + 1)
    assert u.min().item() > 0 and u.max().item() < 1
    bitmask = token_bitmask(n, vocab)
    bitmask[:] = 0
    bitmask[:, 0] = (1 << 7) | (1 << 8)
    logits = torch.zeros(n, vocab)
    masked = sample(
        logits, [SamplingParams(temperature=1.0)] * n, keys, grammar=GrammarMask(bitmask, list(range(n)))
    )
    assert {t for (t,) in masked.tokens} == {7, 8}
    logits[:, 7:9] = 5.0  # top-k keeps 7 and 8 only
    cut = sample(logits, [SamplingParams(temperature=1.0, top_k=2)] * n, keys)
    assert {t for (t,) in cut.tokens} == {7, 8}
