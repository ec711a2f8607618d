"""NEXTN drafting: the MTP forwards every rank runs after each step (docs/design.md, section 8).

After a step's tokens are accepted, every group runs the same forwards, an idle group with zero
rows (the MTP layer's MoE joins WORLD collectives like any layer's):

1. draft extend: one MTP row per position the step kept (prefilled, or verified and accepted),
   pairing its hidden state with the token after it. This writes the MTP layer's KV for exactly
   the positions the main model holds, and the last row of a decoding request yields its first
   draft;
2. `num_steps - 1` chained forwards: one row per drafting request, the previous step's normed
   output paired with its draft, at the next position. Their KV goes to scratch slots (the next
   step has not allocated those positions yet); the next draft extend rewrites them for real.

Row counts come from the exchanged `DraftSizes`, so every rank lays out the same steps.
Drafts are greedy (top-1 chains): verification treats them as deterministic proposals, which
keeps sampled outputs distributed exactly as the target model's.
"""

from __future__ import annotations

import time

import torch

from dpserve.kvcache.pool import KVPool
from dpserve.models.base import CausalLM
from dpserve.models.batch import group_inputs, stage
from dpserve.scheduler.request import Req
from dpserve.scheduler.scheduled import ScheduledStep
from dpserve.step.padding import PaddingPolicy
from dpserve.step.records import (
    PENDING_TOKEN,
    BatchReq,
    DraftBatch,
    DraftReq,
    DraftSizes,
    GroupBatch,
    StepLayout,
)
from dpserve.worker.graph_runner import CudaGraphRunner


def draft_batch(step: ScheduledStep) -> tuple[DraftBatch, list[Req]]:
    """The MTP rows after `step`, its samples taken: every position it kept, paired with the token
    after it; and the requests that draft (running and decoding next), in order."""
    batch, drafting, offset = DraftBatch(), [], 0
    for req, part in zip(step.reqs, step.batch.reqs, strict=True):
        kept = min(len(part.tokens), req.seq_len - 1 - part.start)
        next_tokens = req.fill_ids[part.start + 1 : part.start + 1 + kept]
        draft = req.table_row > 0 and req.prefill_done
        batch.reqs.append(DraftReq(part.table_row, part.start, offset, next_tokens, part.slots[:kept], draft))
        if draft:
            drafting.append(req)
        offset += len(part.tokens)
    return batch, drafting


class NextNDrafter:
    def __init__(
        self,
        model: CausalLM,
        req_to_token: torch.Tensor,
        policy: PaddingPolicy,
        capacity: int,
        num_steps: int,
        context_len: int,
        cache_dtype: torch.dtype,
        graph_pool: tuple | None = None,
    ):
        """`capacity`: the main pool's tokens (the MTP pool mirrors its slots); `cache_dtype`: what
        the pools store; `graph_pool`: the target's CUDA graphs' memory pool, where the MTP
        forwards' graphs are captured too (None: no graphs)."""
        self.model, self.req_to_token, self.policy = model, req_to_token, policy
        self.num_steps, self.context_len = num_steps, context_len
        # Scratch slots past the pool's real ones: num_steps - 1 per request-table row.
        self.scratch_base = capacity + 1
        scratch = (req_to_token.shape[0] - 1) * (num_steps - 1)
        dtype = model.lm_head.dtype
        self.pool = KVPool(
            1,
            capacity + scratch,
            model.kv_entry_shapes(),
            dtype,
            req_to_token.device,
            cache_dtype=cache_dtype,
        )
        self.graphs = None
        if graph_pool is not None:
            self.graphs = CudaGraphRunner(
                model,
                req_to_token,
                policy.padded_layouts(),
                policy.max_kv_len,
                lambda batch, hidden: model.draft_hidden(hidden, batch, self.pool),
                graph_pool,
                "MTP forwards",
                hidden_inputs=True,
            )
        # Each table row's latest draft: the next chained forward's input token (`PENDING_TOKEN`).
        self.tokens = torch.zeros(req_to_token.shape[0], dtype=torch.long, device=req_to_token.device)
        self.seconds = 0.0  # the MTP forwards of the last step
        self.padded = 0  # ... of them run padded (a graph's shapes)

    def run(
        self, batch: DraftBatch, sizes: list[DraftSizes], hidden: torch.Tensor, padded: bool
    ) -> list[list[int]]:
        """Runs the MTP forwards after a step (this group's rows: `batch`; every group's sizes:
        `sizes`; the step's hidden states: `hidden`; `padded`: whether the step ran padded, so its
        kept positions fit a bucket too); returns each drafting request's chain of drafts, in
        `batch.drafting` order."""
        start, self.padded = time.perf_counter(), 0
        drafting = batch.drafting
        chain_lens = [r.chain_len(self.num_steps, self.context_len) for r in drafting]
        # 1. Draft extend over every kept position: the token after each is the MTP layer's input.
        extend = GroupBatch(
            reqs=[BatchReq(r.table_row, r.start, r.next_tokens, r.slots, r.draft) for r in batch.reqs]
        )
        layout = self.policy.layout([s.tokens for s in sizes], [s.drafting for s in sizes], padded)
        src = stage(
            {"src": [r.offset + i for r in batch.reqs for i in range(len(r.next_tokens))]}, self.tokens.device
        )
        # The step wrote these positions' slots into the request table: nothing to write again.
        first, out = self._forward(extend, layout, self.model.norm(hidden[src["src"]]), write_table=False)
        drafts = torch.zeros(len(drafting), self.num_steps, dtype=torch.long, device=self.tokens.device)
        drafts[:, 0] = first
        # 2. Chained steps, each request while its positions stay inside the context.
        scratch: list[tuple[int, int]] = []  # request-table entries pointing at scratch slots
        try:
            self._chain(drafting, chain_lens, sizes, drafts, out, scratch)
        finally:
            # Attention gathers table rows up to the batch's longest request, so a stale scratch slot
            # (past the main pool's end) must not stay where a shorter request's row is read, even
            # when drafting failed.
            if scratch:
                e = stage(
                    {"rows": [r for r, _ in scratch], "cols": [c for _, c in scratch]}, self.tokens.device
                )
                self.req_to_token[e["rows"], e["cols"]] = 0
        self.seconds = time.perf_counter() - start
        return [chain[: 1 + n] for chain, n in zip(drafts.tolist(), chain_lens, strict=True)]

    def _forward(
        self, batch: GroupBatch, layout: StepLayout, hidden: torch.Tensor, write_table: bool = True
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One MTP forward over `batch` (the main model's builder; padded rows pair token 0 with a
        zero hidden state; a captured graph's replay when its layout has one); returns the drafts
        of its sampled rows, kept by table row for the next chained forward, and their
        normed output."""
        inputs = group_inputs(
            batch, layout, self.req_to_token, self.tokens, self.model.moe_own_rank, write_table=write_table
        )
        pad = layout.local_rows - hidden.shape[0]
        if pad:
            hidden = torch.cat([hidden, hidden.new_zeros(pad, hidden.shape[1])])
        self.padded += layout.padded
        if self.graphs is not None and self.graphs.has(layout):
            out = self.graphs.replay(inputs, hidden)
        else:
            out = self.model.draft_hidden(hidden, inputs, self.pool)
        logits, out = self.model.draft_logits(out, inputs)
        drafts = logits.argmax(-1)
        self.tokens[inputs.logit_table_rows] = drafts
        return drafts, out

    def _chain(
        self,
        drafting: list[DraftReq],
        chain_lens: list[int],
        sizes: list[DraftSizes],
        drafts: torch.Tensor,
        out: torch.Tensor,
        scratch: list[tuple[int, int]],
    ) -> None:
        """Step 2 of `run`: the chained MTP steps, filling `drafts` and recording every scratch entry
        it writes into the request table."""
        for j in range(1, self.num_steps):
            chain_rows = [s.chain[j - 1] for s in sizes]
            if not any(chain_rows):
                break
            active = [i for i, n in enumerate(chain_lens) if n >= j]
            # Request r's step j: its draft j - 1 at position end - 1 + j, written to a scratch slot.
            steps = [(drafting[i].table_row, drafting[i].end - 1 + j) for i in active]
            base = self.scratch_base + j - 1
            chain = GroupBatch(
                reqs=[
                    BatchReq(row, pos, [PENDING_TOKEN], [base + (row - 1) * (self.num_steps - 1)], True)
                    for row, pos in steps
                ]
            )
            scratch += steps
            can_pad = all(s.longest + j <= self.policy.max_kv_len for s in sizes if s.chain[j - 1])
            layout = self.policy.layout(chain_rows, chain_rows, can_pad)
            idx = stage({"active": active}, drafts.device)["active"]
            drafts[idx, j], rows_out = self._forward(chain, layout, out[idx])
            out = out.index_copy(0, idx, rows_out)
