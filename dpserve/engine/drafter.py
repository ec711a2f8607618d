"""NEXTN drafting: the MTP forwards every rank runs after each step (design section 8).

After a step's tokens are accepted, every group runs the same forwards, an idle group with zero
rows (the MTP layer's MoE joins WORLD collectives like any layer's):

1. draft extend: one MTP row per position the step kept (prefilled, or verified and accepted),
   pairing its hidden state with the token after it. This writes the MTP layer's KV for exactly
   the positions the main model holds, and the last row of a decoding request yields its first
   draft;
2. `num_steps - 1` chained forwards: one row per drafting request, the previous step's normed
   output paired with its draft, at the next position. Their KV goes to scratch slots (the next
   step has not allocated those positions yet); the next draft extend rewrites them for real.

Row counts come from the all-gathered `DraftCounts`, so every rank lays out the same steps.
Drafts are greedy (top-1 chains): verification treats them as deterministic proposals, which
keeps sampled outputs distributed exactly as the target model's.
"""

from __future__ import annotations

import time
from itertools import accumulate
from typing import TYPE_CHECKING

import torch

from dpserve.kvcache.pool import KVPool
from dpserve.models.batch import ForwardBatch
from dpserve.scheduler.plan import DraftCounts, DraftPlan

if TYPE_CHECKING:
    from dpserve.engine.model_runner import ModelRunner


class NextNDrafter:
    def __init__(self, runner: ModelRunner, num_steps: int):
        self.runner, self.num_steps = runner, num_steps
        self.context_len = runner.model_cfg.context_len
        capacity = runner.max_total_num_tokens
        # Scratch slots past the pool's real ones: num_steps - 1 per request-table row.
        self.scratch_base = capacity + 1
        scratch = runner.cfg.max_running_requests * (num_steps - 1)
        shapes = runner.model.kv_entry_shapes()
        self.pool = KVPool(1, capacity + scratch, shapes, runner.dtype, runner.device)
        self.seconds = 0.0  # the MTP forwards of the last step

    def run(self, plan: DraftPlan, counts: list[DraftCounts]) -> list[list[int]]:
        """Runs the MTP forwards after a step (this group's rows: `plan`; every group's sizes:
        `counts`); returns each drafting request's chain of drafts, in `plan.drafting` order."""
        start = time.perf_counter()
        drafting = plan.drafting
        chain_lens = [r.chain_len(self.num_steps, self.context_len) for r in drafting]
        runner, dev = self.runner, self.runner.device
        # 1. Draft extend over every kept position.
        reqs = plan.reqs
        q_lens = [len(r.next_tokens) for r in reqs]
        ends = list(accumulate(q_lens))
        step = runner.make_step([c.tokens for c in counts], [c.drafting for c in counts], can_pad=False)
        rows = [r.row for r in reqs for _ in r.next_tokens]
        positions = [p for r in reqs for p in range(r.start, r.end)]
        batch = ForwardBatch.build(
            step,
            runner.req_to_token,
            [t for r in reqs for t in r.next_tokens],  # the MTP layer's input: the token after each row
            positions,
            runner.req_to_token[_tensor(rows, dev), _tensor(positions, dev)],
            [r.row for r in reqs],
            q_lens,
            [r.end for r in reqs],
            [end - 1 for r, end in zip(reqs, ends, strict=True) if r.draft],
        )
        src = _tensor([r.offset + i for r in reqs for i in range(len(r.next_tokens))], dev)
        hidden = runner.model.norm(runner.hidden[src])
        logits, out = runner.model.draft(hidden, batch, self.pool)
        drafts = torch.zeros(len(drafting), self.num_steps, dtype=torch.long, device=dev)
        drafts[:, 0] = logits.argmax(-1)
        # 2. Chained steps, each request while its positions stay inside the context.
        scratch_entries = []  # request-table entries pointing at scratch slots, cleared at the end
        for j in range(1, self.num_steps):
            if not any(c.chain[j - 1] for c in counts):
                break
            active = [i for i, n in enumerate(chain_lens) if n >= j]
            reqs_j = [drafting[i] for i in active]
            positions = [r.end - 1 + j for r in reqs_j]
            req_rows = [r.row for r in reqs_j]
            slots = _tensor(
                [self.scratch_base + (r.row - 1) * (self.num_steps - 1) + j - 1 for r in reqs_j], dev
            )
            entry = (_tensor(req_rows, dev), _tensor(positions, dev))
            runner.req_to_token[entry] = slots.int()
            scratch_entries.append(entry)
            step = runner.make_step([c.chain[j - 1] for c in counts], [c.chain[j - 1] for c in counts], False)
            n, idx = len(active), _tensor(active, dev)
            seq_lens = [p + 1 for p in positions]
            batch = ForwardBatch.build(
                step,
                runner.req_to_token,
                drafts[idx, j - 1],
                positions,
                slots,
                req_rows,
                [1] * n,
                seq_lens,
                list(range(n)),
            )
            logits, rows_out = runner.model.draft(out[idx], batch, self.pool)
            drafts[idx, j] = logits.argmax(-1)
            out = out.index_copy(0, idx, rows_out)
        # Attention gathers table rows up to the batch's longest request, so a stale scratch slot
        # (past the main pool's end) must not stay where a shorter request's row is read.
        for entry in scratch_entries:
            runner.req_to_token[entry] = 0
        self.seconds = time.perf_counter() - start
        return [chain[: 1 + n] for chain, n in zip(drafts.tolist(), chain_lens, strict=True)]


def _tensor(values: list[int], device: torch.device, dtype: torch.dtype = torch.long) -> torch.Tensor:
    return torch.tensor(values, dtype=dtype, device=device)
