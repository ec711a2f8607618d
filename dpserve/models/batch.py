"""What one rank feeds the model in one step."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dpserve.attention.backend import AttentionMetadata
from dpserve.step.records import StepLayout


@dataclass
class ForwardBatch:
    # A padded step appends padded rows after the n_g real ones: each a one-token request
    # on the all-zero table row 0, token 0 at position 0 written to the reserved pool slot 0,
    # never sampled.
    input_ids: torch.Tensor  # [n_g] this group's new tokens
    positions: torch.Tensor  # [n_g]
    out_slots: torch.Tensor  # [n_g] KV pool slots the new tokens are written to
    attn: AttentionMetadata
    logit_idx: torch.Tensor  # indices into the n_g tokens whose next token is sampled
    layout: StepLayout
    row_index: torch.Tensor  # sum_len: [local rows] row of the gathered buffer of each local row
    moe_rows: torch.Tensor  # 1 for each real row the MoE sees, 0 for padding (StepLayout.real_rows)

    @classmethod
    def build(
        cls,
        layout: StepLayout,
        req_to_token: torch.Tensor,
        input_ids: list[int] | torch.Tensor,
        positions: list[int],
        out_slots: list[int] | torch.Tensor,
        req_rows: list[int],
        q_lens: list[int],
        seq_lens: list[int],
        logit_idx: list[int],
        own_rank: int | None = None,
    ) -> ForwardBatch:
        """The batch of `layout.local_rows` rows (padding included) from per-token and per-request
        lists (`req_rows`, `q_lens`, `seq_lens`: one entry per attention request); `own_rank`: the
        attention TP rank, when the MoE runs on each rank's own rows."""
        dev = req_to_token.device

        def ids(values: list[int] | torch.Tensor) -> torch.Tensor:
            return torch.as_tensor(values, dtype=torch.long, device=dev)

        q_start = torch.tensor([0, *q_lens], dtype=torch.int32).cumsum(0, dtype=torch.int32)
        attn = AttentionMetadata(
            req_to_token=req_to_token,
            req_idx=torch.tensor(req_rows, dtype=torch.int32, device=dev),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=dev),
            q_start=q_start.to(dev),
            num_tokens=layout.local_rows,
            max_q_len=max(q_lens, default=0),
            max_seq_len=max(seq_lens, default=0),
            q_lens_host=list(q_lens),
            seq_lens_host=list(seq_lens),
        )
        return cls(
            ids(input_ids),
            ids(positions),
            ids(out_slots),
            attn,
            ids(logit_idx),
            layout,
            layout.row_index(dev),
            layout.real_rows(dev, own_rank),
        )
