"""Accepting draft tokens: greedy prefix matching and speculative rejection sampling.

Rejection sampling follows Leviathan et al. 2023 ("Fast Inference from Transformers via Speculative
Decoding") and Chen et al. 2023: draft ``x_i ~ q_i`` is accepted with probability ``min(1, p_i(x_i) /
q_i(x_i))``; at the first rejection the emitted token is drawn from ``normalize(max(0, p_i - q_i))``; when
all ``k`` drafts are accepted a bonus token is drawn from ``p_k``. Every emitted token is then distributed
exactly as the target model would have sampled it. A deterministic draft (n-gram lookup, a greedy draft
chain) is the special case ``q_i = one_hot(x_i)``: accept with probability ``p_i(x_i)``, else sample from
``p_i`` with ``x_i`` removed.

The batched functions work on whole batches on the tensors' device (one host sync when the caller reads
the results); the per-request ones are thin wrappers.
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


def greedy_accept_batch(
    draft_tokens: torch.Tensor, target_tokens: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Batched :func:`greedy_accept`: ``draft_tokens [B, k]``, ``target_tokens [B, k+1]``.

    Returns ``(tokens [B, k+1], num_emitted [B])``: row ``b`` emits ``tokens[b, :num_emitted[b]]``
    (which equals ``target_tokens[b, :num_emitted[b]]``); entries past it are ``-1``.
    """
    k = draft_tokens.shape[1]
    match = (draft_tokens == target_tokens[:, :k]).to(torch.int64)
    num_accepted = match.cumprod(dim=1).sum(dim=1)
    return _emit(target_tokens, num_accepted)


def rejection_sample_batch(
    draft_tokens: torch.Tensor,
    draft_probs: torch.Tensor | None,
    target_probs: torch.Tensor,
    generator: torch.Generator | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Speculative rejection sampling for a batch of chains.

    ``draft_tokens [B, k]`` (int64), ``draft_probs [B, k, V]`` the distributions the drafts were sampled
    from (``None``: deterministic drafts, ``q_i = one_hot(x_i)``), ``target_probs [B, k+1, V]`` the target's
    distributions after the last verified token and after each draft (already temperature/top-p processed).
    Returns ``(tokens [B, k+1], num_emitted [B])`` as :func:`greedy_accept_batch`: the accepted drafts, then
    one token from the residual distribution (first rejection) or from ``p_k`` (all accepted).
    """
    batch, k = draft_tokens.shape
    vocab = target_probs.shape[-1]
    if target_probs.shape[:2] != (batch, k + 1):
        raise ValueError(f"target_probs must be [B, k+1, V], got {tuple(target_probs.shape)} for k={k}")
    probs = target_probs.float()
    if draft_probs is None:
        q = torch.nn.functional.one_hot(draft_tokens, vocab).to(probs.dtype)
    else:
        if draft_probs.shape != (batch, k, vocab):
            raise ValueError(f"draft_probs must be [B, k, V], got {tuple(draft_probs.shape)}")
        q = draft_probs.float()
    p_draft = probs[:, :k].gather(2, draft_tokens[..., None])[..., 0]
    q_draft = q.gather(2, draft_tokens[..., None])[..., 0]
    u = torch.rand((batch, k), generator=generator, device=probs.device, dtype=probs.dtype)
    accept = (u * q_draft < p_draft).to(torch.int64)  # P(accept) = min(1, p/q), no division by q
    num_accepted = accept.cumprod(dim=1).sum(dim=1)  # [B] in 0..k
    # The distribution of the token emitted after the accepted drafts: residual at the first rejection,
    # p_k itself when every draft was accepted (q padded with a zero row at index k).
    q_pad = torch.cat([q, q.new_zeros(batch, 1, vocab)], dim=1)
    rows = torch.arange(batch, device=probs.device)
    p_at = probs[rows, num_accepted]
    residual = (p_at - q_pad[rows, num_accepted]).clamp_(min=0)
    # An all-zero residual means p == q at that position, where rejection has probability 0; fall back to p.
    empty = residual.sum(dim=1, keepdim=True) <= 0
    residual = torch.where(empty, p_at, residual)
    last = torch.multinomial(residual, 1, generator=generator)[:, 0]
    tokens = torch.cat([draft_tokens, draft_tokens.new_zeros(batch, 1)], dim=1)
    tokens[rows, num_accepted] = last
    return _emit(tokens, num_accepted)


def rejection_sample(
    draft_tokens: list[int],
    draft_probs: torch.Tensor | None,
    target_probs: torch.Tensor,
    generator: torch.Generator | None = None,
) -> list[int]:
    """One request's :func:`rejection_sample_batch`: ``draft_probs [k, V]`` or ``None``,
    ``target_probs [k+1, V]``; returns the 1..k+1 emitted tokens."""
    drafts = torch.tensor([draft_tokens], dtype=torch.int64, device=target_probs.device).reshape(1, -1)
    tokens, num = rejection_sample_batch(
        drafts, None if draft_probs is None else draft_probs[None], target_probs[None], generator
    )
    return tokens[0, : int(num[0])].tolist()


def _emit(tokens: torch.Tensor, num_accepted: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    num_emitted = num_accepted + 1
    cols = torch.arange(tokens.shape[1], device=tokens.device)
    return torch.where(cols[None] < num_emitted[:, None], tokens, -1), num_emitted
