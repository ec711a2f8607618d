"""What one rank feeds the model in one step."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dpserve.attention.backend import AttentionMetadata
from dpserve.layers.dp_attention import DPStep


@dataclass
class ForwardBatch:
    # A graph (padded) step appends padded rows after the n_g real ones: each a one-token request
    # on the all-zero table row 0, token 0 at position 0 written to the reserved pool slot 0,
    # never sampled.
    input_ids: torch.Tensor  # [n_g] this group's new tokens
    positions: torch.Tensor  # [n_g]
    out_slots: torch.Tensor  # [n_g] KV pool slots the new tokens are written to
    attn: AttentionMetadata
    logit_idx: torch.Tensor  # indices into the n_g tokens whose next token is sampled
    step: DPStep
    row_index: torch.Tensor  # [local rows] row of the gathered buffer of each local row (DPStep.row_index)
