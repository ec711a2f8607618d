"""Accepting draft tokens: greedy prefix matching and speculative rejection sampling.

Rejection sampling follows Leviathan et al. 2023 ("Fast Inference from Transformers via Speculative
Decoding") and Chen et al. 2023: draft ``x_i ~ q_i`` is accepted with probability ``min(1, p_i(x_i) /
q_i(x_i))``; at the first rejection the emitted token is drawn from ``normalize(max(0, p_i - q_i))``; when
all ``k`` drafts are accepted a bonus token is drawn from ``p_k``. Every emitted token is then distributed
exactly as the target model would have sampled it. A deterministic draft (n-gram lookup, a greedy draft
chain) is the special case ``q_i = one_hot(x_i)``: accept with probability ``p_i(x_i)``, else sample from
``p_i`` with ``x_i`` removed.

Drafts here are deterministic (n-gram lookups, NEXTN's greedy chains): ``rejection_sample`` verifies
every sampling request's drafts of a step at once, on the tensors' device, with no host sync.
"""

from __future__ import annotations

import torch


def greedy_accept(draft_tokens: list[int], target_tokens: list[int]) -> list[int]:
    """Tokens emitted by a greedy verify step: the longest prefix of ``draft_tokens`` that matches the
    target's argmax tokens, then the target's own token at the first mismatch (or the bonus token).

    ``target_tokens[i]`` is the target's argmax after the last verified token and ``draft_tokens[:i]``;
    it has ``len(draft_tokens) + 1`` entries. Returns 1..len(draft_tokens)+1 tokens.
    """
    if len(target_tokens) != len(draft_tokens) + 1:
        raise ValueError(f"need len(draft)+1 target tokens, got {len(target_tokens)} for {len(draft_tokens)}")
    n = 0
    while n < len(draft_tokens) and draft_tokens[n] == target_tokens[n]:
        n += 1
    return list(target_tokens[: n + 1])


def rejection_sample(
    probs: torch.Tensor,
    drafts: torch.Tensor,
    has_draft: torch.Tensor,
    accept_u: torch.Tensor,
    noise: torch.Tensor,
    segments: torch.Tensor,
    row_req: torch.Tensor,
    row_j: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Speculative rejection sampling of deterministic drafts for a batch of requests, rows flat.

    Row s of ``probs [S, V]`` is a target distribution (filtered); ``drafts[s]`` the draft verified
    there (``has_draft[s]`` False on each request's last row); ``accept_u [S]`` uniforms and
    ``noise [S, V]`` Exp(1) draws; ``segments [R, K+1]`` each request's rows in order (index S:
    padding); ``row_req``, ``row_j``: each row's request and position in it. Returns each row's
    token (its draft while accepted, else the token drawn there, by the exponential race, from p
    with the rejected draft removed, or from p itself past the drafts) and each request's accepted
    draft count: request r emits tokens[segments[r, :accepted[r] + 1]]."""
    p_draft = probs.gather(1, drafts[:, None])[:, 0]
    accept = has_draft & (accept_u < p_draft)
    padded = torch.cat([accept, accept.new_zeros(1)]).long()
    accepted = padded[segments].cumprod(1).sum(1)
    # The residual max(0, p - one_hot(draft)) is p with the draft's entry zeroed; when p(draft) = 1
    # it is empty, but then the draft is never rejected (a row drawn from p there is never used).
    residual = probs.scatter(1, drafts[:, None], (p_draft * ~has_draft)[:, None])
    residual = torch.where(residual.sum(1, keepdim=True) > 0, residual, probs)
    drawn = (residual / noise).argmax(-1)  # the race needs no normalization
    return torch.where(row_j < accepted[row_req], drafts, drawn), accepted
