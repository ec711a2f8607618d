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
from itertools import accumulate

import torch

from dpserve.kvcache.pool import KVPool
from dpserve.models.base import CausalLM
from dpserve.models.batch import ForwardBatch, stage
from dpserve.scheduler.request import Req
from dpserve.scheduler.scheduled import ScheduledStep
from dpserve.step.padding import PaddingPolicy
from dpserve.step.records import DraftBatch, DraftReq, DraftSizes


def draft_batch(step: ScheduledStep) -> tuple[DraftBatch, list[Req]]:
    """The MTP rows after `step`, its samples taken: every position it kept, paired with the token
    after it; and the requests that draft (running and decoding next), in order."""
    batch, drafting, offset = DraftBatch(), [], 0
    for req, part in zip(step.reqs, step.batch.reqs, strict=True):
        kept = min(len(part.tokens), req.seq_len - 1 - part.start)
        next_tokens = req.fill_ids[part.start + 1 : part.start + 1 + kept]
        draft = req.table_row > 0 and req.prefill_done
        batch.reqs.append(DraftReq(part.table_row, part.start, offset, next_tokens, draft))
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
    ):
        """`capacity`: the main pool's tokens (the MTP pool mirrors its slots); `cache_dtype`: what
        the pools store."""
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
        self.seconds = 0.0  # the MTP forwards of the last step

    def run(self, batch: DraftBatch, sizes: list[DraftSizes], hidden: torch.Tensor) -> list[list[int]]:
        """Runs the MTP forwards after a step (this group's rows: `batch`; every group's sizes:
        `sizes`; the step's hidden states: `hidden`); returns each drafting request's chain of
        drafts, in `batch.drafting` order."""
        start = time.perf_counter()
        drafting = batch.drafting
        chain_lens = [r.chain_len(self.num_steps, self.context_len) for r in drafting]
        model, table, dev = self.model, self.req_to_token, self.req_to_token.device
        # 1. Draft extend over every kept position.
        reqs = batch.reqs
        q_lens = [len(r.next_tokens) for r in reqs]
        ends = list(accumulate(q_lens))
        layout = self.policy.layout([s.tokens for s in sizes], [s.drafting for s in sizes], can_pad=False)
        positions = [p for r in reqs for p in range(r.start, r.end)]
        staged = stage(
            {
                "rows": [r.table_row for r in reqs for _ in r.next_tokens],
                "positions": positions,
                "src": [r.offset + i for r in reqs for i in range(len(r.next_tokens))],
            },
            dev,
        )
        inputs = ForwardBatch.build(
            layout,
            table,
            [t for r in reqs for t in r.next_tokens],  # the MTP layer's input: the token after each row
            positions,
            table[staged["rows"], staged["positions"]],
            [r.table_row for r in reqs],
            q_lens,
            [r.end for r in reqs],
            [end - 1 for r, end in zip(reqs, ends, strict=True) if r.draft],
            model.moe_own_rank,
        )
        logits, out = model.draft(model.norm(hidden[staged["src"]]), inputs, self.pool)
        drafts = torch.zeros(len(drafting), self.num_steps, dtype=torch.long, device=dev)
        drafts[:, 0] = logits.argmax(-1)
        # 2. Chained steps, each request while its positions stay inside the context.
        scratch_entries = []  # request-table entries pointing at scratch slots, cleared at the end
        try:
            self._chain(drafting, chain_lens, sizes, drafts, out, scratch_entries)
        finally:
            # Attention gathers table rows up to the batch's longest request, so a stale scratch slot
            # (past the main pool's end) must not stay where a shorter request's row is read, even
            # when drafting failed.
            for entry in scratch_entries:
                table[entry] = 0
        self.seconds = time.perf_counter() - start
        return [chain[: 1 + n] for chain, n in zip(drafts.tolist(), chain_lens, strict=True)]

    def _chain(
        self,
        drafting: list,
        chain_lens: list[int],
        sizes: list[DraftSizes],
        drafts: torch.Tensor,
        out: torch.Tensor,
        scratch_entries: list[tuple[torch.Tensor, torch.Tensor]],
    ) -> None:
        """Step 2 of `run`: the chained MTP steps, filling `drafts` and recording every scratch entry
        it writes into the request table."""
        model, table, dev = self.model, self.req_to_token, self.req_to_token.device
        for j in range(1, self.num_steps):
            if not any(s.chain[j - 1] for s in sizes):
                break
            active = [i for i, n in enumerate(chain_lens) if n >= j]
            reqs_j = [drafting[i] for i in active]
            positions = [r.end - 1 + j for r in reqs_j]
            table_rows = [r.table_row for r in reqs_j]
            staged = stage(
                {
                    "slots": [
                        self.scratch_base + (r.table_row - 1) * (self.num_steps - 1) + j - 1 for r in reqs_j
                    ],
                    "rows": table_rows,
                    "positions": positions,
                    "active": active,
                },
                dev,
            )
            slots, entry, idx = staged["slots"], (staged["rows"], staged["positions"]), staged["active"]
            table[entry] = slots.int()
            scratch_entries.append(entry)
            chain_rows = [s.chain[j - 1] for s in sizes]
            layout = self.policy.layout(chain_rows, chain_rows, can_pad=False)
            n = len(active)
            seq_lens = [p + 1 for p in positions]
            inputs = ForwardBatch.build(
                layout,
                table,
                drafts[idx, j - 1],
                positions,
                slots,
                table_rows,
                [1] * n,
                seq_lens,
                list(range(n)),
                model.moe_own_rank,
            )
            logits, rows_out = model.draft(out[idx], inputs, self.pool)
            drafts[idx, j] = logits.argmax(-1)
            out = out.index_copy(0, idx, rows_out)
