"""The sampler's filters, checked on a hand-made distribution."""

from __future__ import annotations

import torch

from dpserve.engine.sampler import sample
from dpserve.sampling_params import SamplingParams

PROBS = torch.tensor([0.4, 0.3, 0.2, 0.1])


def draws(params: SamplingParams, n: int = 300) -> set[int]:
    logits = PROBS.log().repeat(n, 1)
    gen = torch.Generator().manual_seed(0)
    tokens, _ = sample(logits, [params] * n, [gen] * n)
    return set(tokens)


def test_filters():
    assert draws(SamplingParams(temperature=1.0)) == {0, 1, 2, 3}
    assert draws(SamplingParams(temperature=1.0, top_k=2)) == {0, 1}
    assert draws(SamplingParams(temperature=1.0, top_p=0.65)) == {0, 1}
    assert draws(SamplingParams(temperature=1.0, top_p=0.3)) == {0}
    assert draws(SamplingParams(temperature=1.0, min_p=0.45)) == {0, 1, 2}
    assert draws(SamplingParams(temperature=0.0)) == {0}


def test_logprob_is_of_the_model_distribution():
    logits = PROBS.log()[None]
    tokens, logprobs = sample(logits, [SamplingParams(temperature=0.0)], [torch.Generator()])
    assert tokens == [0] and abs(logprobs[0] - PROBS[0].log().item()) < 1e-6
