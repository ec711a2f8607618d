"""Expert load read back from the forward: rows per logical expert since the front end last asked
(POST /dump_expert_load, `--enable-eplb`'s input) and each step's imbalance between EP ranks."""

from __future__ import annotations

import torch

from dpserve.layers.mlp import MoE


class LoadCounter:
    def __init__(self, moes: list[MoE], device: torch.device):
        self.moes = moes
        experts = moes[0].gate.shape[0] if moes else 0
        # [layers, experts], on the device: read only when asked.
        self.rows = torch.zeros(len(moes), experts, dtype=torch.long, device=device)

    def expert_rows(self, slot_rows: torch.Tensor) -> torch.Tensor:
        """A step's rows per logical expert ([layers, experts]) from its rows per slot ([layers,
        slots]) under the layers' placements now (a replica's rows added to its expert's)."""
        moes = self.moes
        if moes[0].phy_to_log is None:
            return slot_rows
        table = torch.stack([m.phy_to_log for m in moes]).to(slot_rows.device)
        out = slot_rows.new_zeros(len(moes), moes[0].gate.shape[0])
        return out.scatter_add_(1, table, slot_rows)

    def add(self, rows: torch.Tensor) -> None:
        self.rows += rows

    def take(self) -> torch.Tensor:
        """The rows counted since the last call (on the host), then zeroed."""
        out = self.rows.to("cpu", copy=True)  # a copy on the CPU too: the counts are zeroed next
        self.rows.zero_()
        return out

    def imbalance(self, load: torch.Tensor) -> tuple[torch.Tensor, torch.cuda.Event | None]:
        """A step's MoE rows of the busiest EP rank over the mean rank's, from its rows per slot: its
        copy to the host queued, and the event that says the copy is done (GPU), for `StepLog`."""
        ep = self.moes[0].ep_ranks
        per_rank = load.view(load.shape[0], ep, -1).sum((0, 2)).float()
        imbalance = torch.where(per_rank.sum() > 0, per_rank.max() / per_rank.mean(), 1.0)
        host = imbalance.to("cpu", non_blocking=True)
        done = None
        if imbalance.is_cuda:  # recorded after the copy: its completion says the host value is there
            done = torch.cuda.Event()
            done.record()
        return host, done
