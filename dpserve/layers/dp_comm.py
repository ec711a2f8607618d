"""The DP-attention data flow of one decoder layer (docs/design.md, section 3), in one place.

Attention runs on the group's own n_g rows with heads split over ATTN_TP and returns
partial sums. `gather` finishes that sum and assembles the global rows the MoE/MLP
works on; `scatter` reduces the MLP partial sums over WORLD and hands each group its
own rows back. Two layouts of the global rows:

    sum_len: rows [off_g, off_g + n_g) of an S-row buffer; one all-reduce over WORLD each way.
    max_len: every group padded to M rows (a multiple of A); reduce-scatter + all-gather.

Padded steps (CUDA graphs on the GPU) fix the shapes to a bucket (docs/design.md, section 4): sum_len's buffer has
bucket(S) rows and every rank's local batch bucket(S) rows, of which its group's n_g are
real; max_len's M is the bucket. Where a local sum_len row lands is a device tensor
(`row_index`, written before a graph replays), so one graph serves any split of the tokens;
padded local rows land in a spare row past the end of the buffer and are zeroed there.

The residual is folded into the attention partials on attn_tp_rank 0 so the gather
also yields the post-attention residual of every row.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from dpserve.distributed import Groups, all_gather, all_reduce, all_to_all, reduce_scatter
from dpserve.step.records import PaddingMode, StepLayout, round_up


class DPComm:
    """Moves rows between the DP groups inside a forward; every rank calls each method in the same order."""

    def __init__(self, groups: Groups):
        self.groups = groups
        self.is_leader = groups.topo.is_group_leader

    def gather(
        self, attn_partial: torch.Tensor, residual: torch.Tensor, layout: StepLayout, row_index: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns (global rows: attention output + residual, this rank's kept residual rows).

        Shapes depend only on the step's bucket (or sizes when unpadded); `row_index` is
        `layout.row_index()`.
        """
        hidden = attn_partial + residual if self.is_leader else attn_partial
        if layout.padding_mode == PaddingMode.SUM_LEN:
            rows = layout.mlp_rows
            buf = hidden.new_zeros((rows + 1, hidden.shape[1]))
            buf.index_copy_(0, row_index, hidden)
            all_reduce(buf, self.groups.world)
            buf[rows] = 0  # the spare row summed every padded row; zero keeps them zero in later layers
            return buf[:rows], buf.index_select(0, row_index)
        buf = hidden.new_zeros((layout.padded_len, hidden.shape[1]))
        buf[: hidden.shape[0]] = hidden
        chunk = reduce_scatter(buf, self.groups.attn_tp)  # M/A summed rows of this group
        return all_gather(chunk, self.groups.world), chunk

    def scatter(
        self,
        mlp_partial: torch.Tensor,
        kept_residual: torch.Tensor,
        layout: StepLayout,
        row_index: torch.Tensor,
    ) -> torch.Tensor:
        """Reduces the MLP partial sums over WORLD, adds the residual, returns this rank's local rows."""
        if layout.padding_mode == PaddingMode.SUM_LEN:
            all_reduce(mlp_partial, self.groups.world)
            return F.pad(mlp_partial, (0, 0, 0, 1)).index_select(0, row_index) + kept_residual
        chunk = reduce_scatter(mlp_partial, self.groups.world) + kept_residual
        return all_gather(chunk, self.groups.attn_tp)[: layout.local_rows]

    def own_rows(
        self, attn_partial: torch.Tensor, residual: torch.Tensor, layout: StepLayout
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """For an MLP on each rank's own rows: attention's sum over ATTN_TP, each rank keeping 1/A of
        its group's rows (padded to a multiple of A); (rows + residual, the same rows as residual)."""
        hidden = attn_partial + residual if self.is_leader else attn_partial
        if self.groups.attn_tp is None:
            return hidden, hidden
        buf = hidden.new_zeros((round_up(hidden.shape[0], layout.attn_tp_size), hidden.shape[1]))
        buf[: hidden.shape[0]] = hidden
        chunk = reduce_scatter(buf, self.groups.attn_tp)
        return chunk, chunk

    def from_own_rows(self, rows: torch.Tensor, layout: StepLayout) -> torch.Tensor:
        """The group's rows back on every rank of the group (after `own_rows` and the MLP)."""
        if self.groups.attn_tp is None:
            return rows
        return all_gather(rows, self.groups.attn_tp)[: layout.local_rows]

    def gather_logit_rows(self, rows: torch.Tensor, layout: StepLayout) -> torch.Tensor:
        """Assembles every group's rows to sample (for the WORLD vocab-parallel LM head), in the
        rows' dtype. An all-gather of uneven parts: each rank of a group sends its 1/A of the group's
        rows to every rank (half the bytes of all-reducing a zero-padded buffer)."""
        if self.groups.world is None:
            return rows
        a, own = layout.attn_tp_size, self.groups.topo.attn_tp_rank
        parts = [near_equal_part(n, a, j) for n in layout.logit_rows for j in range(a)]  # rows of each rank
        mine = rows[sum(parts[layout.dp_rank * a : layout.dp_rank * a + own]) :][
            : near_equal_part(rows.shape[0], a, own)
        ]
        return all_to_all(mine.repeat(len(parts), 1), [mine.shape[0]] * len(parts), parts, self.groups.world)

    def scatter_logits(self, shard: torch.Tensor, layout: StepLayout) -> torch.Tensor:
        """From every rank's vocabulary shard of every group's rows [rows, vocab_shard], returns this
        group's rows with the whole vocabulary [own rows, world * vocab_shard]: each rank receives
        only what its group samples."""
        counts, a = layout.logit_rows, layout.attn_tp_size
        starts = [sum(counts[:g]) for g in range(len(counts))]
        dests = [g for g in range(len(counts)) for _ in range(a)]  # DP group of each rank, in rank order
        send = torch.cat([shard[starts[g] : starts[g] + counts[g]] for g in dests])
        n = counts[layout.dp_rank]
        world = len(dests)
        recv = all_to_all(send, [counts[g] for g in dests], [n] * world, self.groups.world)
        return recv.view(world, n, shard.shape[1]).transpose(0, 1).reshape(n, world * shard.shape[1])


def near_equal_part(n: int, parts: int, j: int) -> int:
    """Rows of part j when n rows are cut into `parts` near-equal consecutive parts."""
    size = -(-n // parts)
    return max(0, min(size, n - j * size))
