"""Token sampling on a group leader, every row at once on the logits' device: greedy, temperature,
top-k, top-p, min-p, per-request seeds; and the acceptance of speculative drafts."""

from __future__ import annotations

from itertools import accumulate

import torch

from dpserve.sampling_params import SamplingParams
from dpserve.speculative.rejection import greedy_accept, rejection_sample


def sample(
    logits: torch.Tensor,
    params: list[SamplingParams],
    generators: list[torch.Generator],
    drafts: list[list[int]] | None = None,
) -> tuple[list[list[int]], list[list[float]]]:
    """Chooses each request's new tokens; returns them and their log-probabilities under the model's
    distribution.

    Request i owns 1 + len(drafts[i]) consecutive rows of `logits` (its last token and its drafts,
    verified in one step) and gets 1 to 1 + len(drafts[i]) tokens: greedy keeps the longest prefix
    of drafts equal to the argmax plus the next argmax; sampling accepts drafts by speculative
    rejection sampling, which leaves the (filtered) target distribution exactly as it is. A row
    without drafts draws by the exponential race (argmax of p / E with E ~ Exp(1)), the filters
    being masks over all rows' sorted probabilities at once; each request's randomness comes from
    its own generator, so seeded outputs do not depend on the batch they ran in."""
    drafts = drafts or [[] for _ in params]
    logits = logits.float()
    logprobs = logits.log_softmax(-1)
    starts = [0]
    for d in drafts:
        starts.append(starts[-1] + 1 + len(d))
    argmax = logits.argmax(-1).tolist()
    sampled = [i for i, p in enumerate(params) if not p.greedy]
    rows = torch.tensor([r for i in sampled for r in range(starts[i], starts[i + 1])], device=logits.device)
    probs = (
        filtered_probs(logits[rows], [params[i] for i in sampled for _ in range(1 + len(drafts[i]))])
        if sampled
        else None
    )
    tokens, offset = [], 0
    for i, p in enumerate(params):
        first, last = starts[i], starts[i + 1]
        if p.greedy:
            tokens.append(greedy_accept(drafts[i], argmax[first:last]))
            continue
        target = probs[offset : offset + last - first]
        offset += last - first
        if drafts[i]:
            tokens.append(rejection_sample(drafts[i], None, target, generators[i]))
        else:
            noise = torch.empty_like(target[0]).exponential_(generator=generators[i])
            tokens.append([int((target[0] / noise).argmax())])
    # One gather for every emitted token: request i's j-th token sits on its row starts[i] + j.
    dev = logits.device
    at = torch.tensor([starts[i] + j for i, t in enumerate(tokens) for j in range(len(t))], device=dev)
    chosen = logprobs[at, torch.tensor([x for t in tokens for x in t], device=dev)].tolist()
    ends = list(accumulate(len(t) for t in tokens))
    return tokens, [chosen[end - len(t) : end] for t, end in zip(tokens, ends, strict=True)]


def filtered_probs(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """Each row's distribution after temperature, top-k, top-p and min-p (renormalized)."""
    dev, vocab = logits.device, logits.shape[1]

    def column(values: list[float]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.float32, device=dev)[:, None]

    probs = (logits / column([p.temperature for p in params])).softmax(-1)
    sorted_probs, order = probs.sort(-1, descending=True)
    rank = torch.arange(vocab, device=dev)[None]
    keep = rank < column([p.top_k if p.top_k > 0 else vocab for p in params])
    # top_p: the smallest prefix whose mass reaches it (the top token always stays).
    keep &= sorted_probs.cumsum(-1) - sorted_probs < column([p.top_p if p.top_p < 1 else 2 for p in params])
    keep &= sorted_probs >= column([p.min_p for p in params]) * sorted_probs[:, :1]
    kept = sorted_probs * keep
    filtered = torch.zeros_like(probs).scatter_(1, order, kept)
    return filtered / filtered.sum(-1, keepdim=True)
