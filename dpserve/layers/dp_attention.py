"""The DP-attention data flow of one decoder layer (design section 3), in one place.

Attention runs on the group's own n_g rows with heads split over ATTN_TP and returns
partial sums. `gather` finishes that sum and assembles the global rows the MoE/MLP
works on; `scatter` reduces the MLP partial sums over WORLD and hands each group its
own rows back. Two layouts of the global rows:

    sum_len: rows [off_g, off_g + n_g) of an S-row buffer; one all-reduce over WORLD each way.
    max_len: every group padded to M rows (a multiple of A); reduce-scatter + all-gather.

Padded (graph) steps fix the shapes to a bucket (design section 4): sum_len's buffer has
bucket(S) rows and every rank's local batch bucket(S) rows, of which its group's n_g are
real; max_len's M is the bucket. Where a local row lands is a device tensor (`row_index`,
written before a graph replays), so one graph serves any split of the tokens; padded local
rows land in a spare row past the end of the sum_len buffer and are zeroed there.

The residual is folded into the attention partials on attn_tp_rank 0 so the gather
also yields the post-attention residual of every row.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from dpserve.distributed import Groups, all_gather, all_reduce, all_to_all, reduce_scatter


def round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


@dataclass(frozen=True)
class DPStep:
    """Layout of one forward step over the DP groups; identical on every rank."""

    mode: str  # "sum_len" or "max_len"
    tokens: tuple[int, ...]  # n_g for each DP group
    logit_rows: tuple[int, ...]  # rows to sample for each DP group
    dp_rank: int
    attn_tp_size: int
    bucket: int | None = None  # graph size (sum_len: global rows, max_len: M); None: eager, unpadded

    @property
    def graph(self) -> bool:
        return self.bucket is not None

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
        return round_up(self.bucket or max(self.tokens), self.attn_tp_size)

    @property
    def mlp_rows(self) -> int:
        """Rows the MoE/MLP processes on every rank in this step (the gathered buffer)."""
        if self.mode == "sum_len":
            return self.bucket or self.total_tokens
        return len(self.tokens) * self.padded_len

    @property
    def local_rows(self) -> int:
        """Rows of this rank's batch: its group's tokens, padded up in a graph step."""
        if not self.graph:
            return self.local_tokens
        return self.bucket if self.mode == "sum_len" else self.padded_len

    def row_index(self) -> list[int]:
        """Row of the gathered buffer of each local row; padded sum_len rows get the spare row."""
        n, pad = self.local_tokens, self.local_rows - self.local_tokens
        if self.mode == "sum_len":
            return list(range(self.offset, self.offset + n)) + [self.mlp_rows] * pad
        return list(range(self.dp_rank * self.padded_len, (self.dp_rank + 1) * self.padded_len))[: n + pad]


class DPAttentionComm:
    def __init__(self, groups: Groups):
        self.groups = groups
        self.is_leader = groups.topo.is_group_leader

    def gather(
        self, attn_partial: torch.Tensor, residual: torch.Tensor, step: DPStep, row_index: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns (global rows: attention output + residual, this rank's kept residual rows).

        Shapes depend only on the step's bucket (or sizes when eager); `row_index` is
        `step.row_index()` as a device tensor.
        """
        hidden = attn_partial + residual if self.is_leader else attn_partial
        if step.mode == "sum_len":
            rows = step.mlp_rows
            buf = hidden.new_zeros((rows + 1, hidden.shape[1]))
            buf.index_copy_(0, row_index, hidden)
            all_reduce(buf, self.groups.world)
            buf[rows] = 0  # the spare row summed every padded row; zero keeps them zero in later layers
            return buf[:rows], buf.index_select(0, row_index)
        buf = hidden.new_zeros((step.padded_len, hidden.shape[1]))
        buf[: hidden.shape[0]] = hidden
        chunk = reduce_scatter(buf, self.groups.attn_tp)  # M/A summed rows of this group
        return all_gather(chunk, self.groups.world), chunk

    def scatter(
        self, mlp_partial: torch.Tensor, kept_residual: torch.Tensor, step: DPStep, row_index: torch.Tensor
    ) -> torch.Tensor:
        """Reduces the MLP partial sums over WORLD, adds the residual, returns this rank's local rows."""
        if step.mode == "sum_len":
            all_reduce(mlp_partial, self.groups.world)
            return F.pad(mlp_partial, (0, 0, 0, 1)).index_select(0, row_index) + kept_residual
        chunk = reduce_scatter(mlp_partial, self.groups.world) + kept_residual
        return all_gather(chunk, self.groups.attn_tp)[: step.local_rows]

    def gather_logit_rows(self, rows: torch.Tensor, step: DPStep) -> torch.Tensor:
        """Assembles every group's rows to sample (for the WORLD vocab-parallel LM head)."""
        offset = sum(step.logit_rows[: step.dp_rank])
        buf = rows.new_zeros((sum(step.logit_rows), rows.shape[1]))
        if self.is_leader:
            buf[offset : offset + rows.shape[0]] = rows
        return all_reduce(buf, self.groups.world)

    def scatter_logits(self, shard: torch.Tensor, step: DPStep) -> torch.Tensor:
        """From every rank's vocabulary shard of every group's rows [rows, vocab_shard], returns this
        group's rows with the whole vocabulary [own rows, world * vocab_shard]: each rank receives
        only what its group samples."""
        counts, a = step.logit_rows, step.attn_tp_size
        starts = [sum(counts[:g]) for g in range(len(counts))]
        dests = [g for g in range(len(counts)) for _ in range(a)]  # DP group of each rank, in rank order
        send = torch.cat([shard[starts[g] : starts[g] + counts[g]] for g in dests])
        n = counts[step.dp_rank]
        world = len(dests)
        recv = all_to_all(send, [counts[g] for g in dests], [n] * world, self.groups.world)
        return recv.view(world, n, shard.shape[1]).transpose(0, 1).reshape(n, world * shard.shape[1])
