"""The DP-attention data flow of one decoder layer (design section 3), in one place.

Attention runs on the group's own n_g rows with heads split over ATTN_TP and returns
partial sums. `gather` finishes that sum and assembles the global rows the MoE/MLP
works on; `scatter` reduces the MLP partial sums over WORLD and hands each group its
own rows back. Two layouts of the global rows:

    sum_len: rows [off_g, off_g + n_g) of an S-row buffer; one all-reduce over WORLD each way.
    max_len: every group padded to M rows (a multiple of A); reduce-scatter + all-gather.

The residual is folded into the attention partials on attn_tp_rank 0 so the gather
also yields the post-attention residual of every row.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dpserve.distributed import Groups, all_gather, all_reduce, reduce_scatter


@dataclass(frozen=True)
class DPStep:
    """Layout of one forward step over the DP groups; identical on every rank."""

    mode: str  # "sum_len" or "max_len"
    tokens: tuple[int, ...]  # n_g for each DP group
    logit_rows: tuple[int, ...]  # rows to sample for each DP group
    dp_rank: int
    attn_tp_size: int

    @property
    def total_tokens(self) -> int:
        return sum(self.tokens)

    @property
    def local_tokens(self) -> int:
        return self.tokens[self.dp_rank]

    @property
    def offset(self) -> int:
        return sum(self.tokens[: self.dp_rank])

    @property
    def padded_len(self) -> int:
        """M: the largest group's tokens rounded up to a multiple of the attention TP size."""
        a = self.attn_tp_size
        return -(-max(self.tokens) // a) * a

    @property
    def mlp_rows(self) -> int:
        """Rows the MoE/MLP processes on every rank in this step."""
        if self.mode == "sum_len":
            return self.total_tokens
        return len(self.tokens) * self.padded_len


class DPAttentionComm:
    def __init__(self, groups: Groups):
        self.groups = groups
        self.is_leader = groups.topo.is_group_leader

    def gather(
        self, attn_partial: torch.Tensor, residual: torch.Tensor, step: DPStep
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns (global rows: attention output + residual, this rank's kept residual rows)."""
        hidden = attn_partial + residual if self.is_leader else attn_partial
        n = step.local_tokens
        if step.mode == "sum_len":
            buf = hidden.new_zeros((step.total_tokens, hidden.shape[1]))
            buf[step.offset : step.offset + n] = hidden
            all_reduce(buf, self.groups.world)
            return buf, buf[step.offset : step.offset + n]
        buf = hidden.new_zeros((step.padded_len, hidden.shape[1]))
        buf[:n] = hidden
        chunk = reduce_scatter(buf, self.groups.attn_tp)  # M/A summed rows of this group
        return all_gather(chunk, self.groups.world), chunk

    def scatter(self, mlp_partial: torch.Tensor, kept_residual: torch.Tensor, step: DPStep) -> torch.Tensor:
        """Reduces the MLP partial sums over WORLD, adds the residual, returns the group's n_g rows."""
        n = step.local_tokens
        if step.mode == "sum_len":
            all_reduce(mlp_partial, self.groups.world)
            return mlp_partial[step.offset : step.offset + n] + kept_residual
        chunk = reduce_scatter(mlp_partial, self.groups.world) + kept_residual
        return all_gather(chunk, self.groups.attn_tp)[:n]

    def gather_logit_rows(self, rows: torch.Tensor, step: DPStep) -> tuple[torch.Tensor, int]:
        """Assembles every group's rows to sample (for the WORLD vocab-parallel LM head).

        Returns the global rows and this group's offset into them.
        """
        offset = sum(step.logit_rows[: step.dp_rank])
        buf = rows.new_zeros((sum(step.logit_rows), rows.shape[1]))
        if self.is_leader:
            buf[offset : offset + rows.shape[0]] = rows
        return all_reduce(buf, self.groups.world), offset
