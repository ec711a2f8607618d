"""Token sampling on a group leader: greedy, temperature, top-k, top-p, min-p, per-request seeds."""

from __future__ import annotations

import torch

from dpserve.sampling_params import SamplingParams


def sample(
    logits: torch.Tensor, params: list[SamplingParams], generators: list[torch.Generator]
) -> tuple[list[int], list[float]]:
    """Returns the chosen tokens and their log-probabilities under the model's distribution."""
    logits = logits.float().cpu()
    logprobs = logits.log_softmax(-1)
    tokens = logits.argmax(-1)
    for i, p in enumerate(params):
        if not p.greedy:
            tokens[i] = _sample_row(logits[i], p, generators[i])
    chosen = logprobs.gather(1, tokens[:, None]).squeeze(1)
    return tokens.tolist(), chosen.tolist()


def _sample_row(logits: torch.Tensor, p: SamplingParams, gen: torch.Generator) -> int:
    probs = (logits / p.temperature).softmax(-1)
    sorted_probs, order = probs.sort(descending=True)
    keep = torch.ones_like(sorted_probs, dtype=torch.bool)
    if p.top_k > 0:
        keep[p.top_k :] = False
    if p.top_p < 1.0:
        # Keep the smallest prefix whose mass reaches top_p (the top token always stays).
        keep &= (sorted_probs.cumsum(0) - sorted_probs) < p.top_p
    if p.min_p > 0.0:
        keep &= sorted_probs >= p.min_p * sorted_probs[0]
    sorted_probs = sorted_probs * keep
    choice = torch.multinomial(sorted_probs / sorted_probs.sum(), 1, generator=gen)
    return int(order[choice])
