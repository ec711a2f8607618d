"""Token sampling on a group leader, every row at once on the logits' device: greedy, temperature,
top-k, top-p, min-p, per-request seeds."""

from __future__ import annotations

import torch

from dpserve.sampling_params import SamplingParams


def sample(
    logits: torch.Tensor, params: list[SamplingParams], generators: list[torch.Generator]
) -> tuple[list[int], list[float]]:
    """Returns the chosen tokens and their log-probabilities under the model's distribution.

    Rows that sample draw by the exponential race (argmax of p / E with E ~ Exp(1), a draw of p):
    the filters are masks over the sorted probabilities of all rows together, and each request's
    noise comes from its own generator (on the logits' device), so seeded outputs do not depend on
    the batch they ran in."""
    logits = logits.float()
    logprobs = logits.log_softmax(-1)
    tokens = logits.argmax(-1)
    rows = [i for i, p in enumerate(params) if not p.greedy]
    if rows:
        dev, vocab = logits.device, logits.shape[1]
        chosen = [params[i] for i in rows]

        def column(values: list[float]) -> torch.Tensor:
            return torch.tensor(values, dtype=torch.float32, device=dev)[:, None]

        idx = torch.tensor(rows, device=dev)
        probs = (logits[idx] / column([p.temperature for p in chosen])).softmax(-1)
        sorted_probs, order = probs.sort(-1, descending=True)
        rank = torch.arange(vocab, device=dev)[None]
        keep = rank < column([p.top_k if p.top_k > 0 else vocab for p in chosen])
        # top_p: the smallest prefix whose mass reaches it (the top token always stays).
        keep &= sorted_probs.cumsum(-1) - sorted_probs < column(
            [p.top_p if p.top_p < 1 else 2 for p in chosen]
        )
        keep &= sorted_probs >= column([p.min_p for p in chosen]) * sorted_probs[:, :1]
        noise = torch.stack(
            [torch.empty(vocab, device=dev).exponential_(generator=generators[i]) for i in rows]
        )
        pick = (sorted_probs * keep / noise).argmax(-1, keepdim=True)
        tokens[idx] = order.gather(1, pick).squeeze(1)
    return tokens.tolist(), logprobs.gather(1, tokens[:, None]).squeeze(1).tolist()
