"""All-to-all dispatch of routed rows to the ranks that own their experts, and back (expert
parallelism with `--moe-a2a-backend all_to_all`, docs/design.md section 3).

Each rank holds only its own rows (its slice of its DP group's). Every (row, choice) pair goes to
the rank owning the chosen expert (experts are split into equal contiguous blocks, rank r owning
[r * E/T, (r + 1) * E/T)), runs there unweighted, comes back in the same order and is weighted and
summed at its origin. Two ways to lay the pairs out:

- counts exchanged first (SGLang's "normal" mode, eager steps): each rank tells every other how
  many pairs it sends; exactly the pairs travel.
- a fixed capacity per destination (SGLang's "low latency" mode, padded decode steps): rank j's
  block of the send buffer has room for m * min(top_k, E/T) pairs, the most m rows can send one
  rank, so no routing overflows it and the shapes depend on m alone (one captured graph serves any
  routing); empty slots carry expert -1 and cost no expert work.

Idle ranks take part with zero rows (and, in the capacity mode, an all-empty block per rank).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from dpserve.distributed import all_to_all

# (rows [n, hidden], local expert of each [n], -1 for none) -> each row's expert output [n, hidden]
ExpertsFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def dispatch_combine(
    x: torch.Tensor,
    weights: torch.Tensor,
    ids: torch.Tensor,
    experts_per_rank: int,
    world: int,
    group,
    run_experts: ExpertsFn,
    fixed_capacity: bool,
) -> torch.Tensor:
    """sum_k weights[:, k] * expert_{ids[:, k]}(x), every expert run on the rank that owns it.
    x [m, hidden]; weights, ids [m, top_k] (global expert ids)."""
    m, top_k = ids.shape
    dest = (ids // experts_per_rank).flatten()  # [pairs]
    order = torch.argsort(dest, stable=True)  # pairs grouped by destination, rows in order
    # scatter_add_, not bincount: bincount reads its maximum back to the host (illegal in a capture).
    counts = torch.zeros(world, dtype=torch.long, device=x.device).scatter_add_(
        0, dest, torch.ones_like(dest)
    )
    local_ids = (ids.flatten() % experts_per_rank)[order]
    rows = order // top_k
    if fixed_capacity:
        cap = m * min(top_k, experts_per_rank)
        first = torch.cumsum(counts, 0) - counts  # index in `order` of each destination's first pair
        sorted_dest = dest[order]
        slot = sorted_dest * cap + torch.arange(dest.numel(), device=x.device) - first[sorted_dest]
        send = x.new_zeros((world * cap, x.shape[1])).index_copy_(0, slot, x[rows])
        send_ids = torch.full((world * cap,), -1, dtype=torch.long, device=x.device)
        send_ids.index_copy_(0, slot, local_ids)
        splits = [cap] * world
        recv = all_to_all(send, splits, splits, group)
        recv_ids = all_to_all(send_ids, splits, splits, group)
        back = all_to_all(run_experts(recv, recv_ids), splits, splits, group)[slot]
    else:
        recv_counts = all_to_all(counts, [1] * world, [1] * world, group)
        sent, received = counts.tolist(), recv_counts.tolist()
        recv = all_to_all(x[rows], sent, received, group)
        recv_ids = all_to_all(local_ids, sent, received, group)
        back = all_to_all(run_experts(recv, recv_ids), received, sent, group)
    weighted = back * weights.flatten()[order, None].to(back.dtype)
    return x.new_zeros(x.shape).index_add_(0, rows, weighted)
