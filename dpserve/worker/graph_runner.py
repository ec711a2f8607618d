"""CUDA graphs of padded decode steps, one per (padding mode, bucket) (docs/design.md, section 4):
the target model's, and NEXTN's MTP forwards' (which also take the rows' hidden states).

Every rank captures the same graphs in the same order at start-up (they contain WORLD and
ATTN_TP collectives). A replay copies the step's inputs into static buffers: token ids,
positions, KV slots (and the hybrid pool's window slots), each row's request-to-slot table row and KV length, and (sum_len)
`row_index`, where each local row sits in the gathered buffer. The graph's shapes depend on
the bucket alone, so one graph serves any split of the tokens over the DP groups, and an
idle group replays it with zero real rows. On the CPU the same padded batches run eagerly.
A replay counts the bytes its capture's collectives counted (their shapes are the graph's).
The target's and the MTP layer's graphs share one memory pool: a step replays them one after the
other, each output read before the next replay.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from tqdm import tqdm

from dpserve.attention.backend import AttentionMetadata
from dpserve.distributed import SENT
from dpserve.models.base import CausalLM
from dpserve.models.batch import ForwardBatch
from dpserve.step.records import PaddingMode, StepLayout

# A captured forward: (the static batch, the static hidden-state rows or None) -> its output rows.
Captured = Callable[[ForwardBatch, torch.Tensor | None], torch.Tensor]


class CudaGraphRunner:
    def __init__(
        self,
        model: CausalLM,
        req_to_token: torch.Tensor,
        layouts: list[StepLayout],
        kv_len: int,
        forward: Captured,
        mempool: tuple,
        what: str,
        hidden_inputs: bool = False,
        req_to_window: torch.Tensor | None = None,
    ):
        """Captures one graph per layout (largest first: the smaller graphs reuse its memory) of
        `forward` (the model's `forward_hidden`, compiled under --enable-torch-compile; or its
        `draft_hidden`, whose `hidden_inputs` are static too) in `mempool`; `what` names them in the
        progress bar; `req_to_window`: the hybrid sliding-window pool's table (its layers write
        their own slots)."""
        self.req_to_token, self.kv_len, self.req_to_window = req_to_token, kv_len, req_to_window
        dev = req_to_token.device
        rows = layouts[0].local_rows
        self.input_ids = torch.zeros(rows, dtype=torch.long, device=dev)
        self.positions = torch.zeros_like(self.input_ids)
        self.out_slots = torch.zeros_like(self.input_ids)
        self.out_window_slots = torch.zeros_like(self.input_ids)
        self.row_index = torch.zeros_like(self.input_ids)
        self.hidden = None
        if hidden_inputs:
            self.hidden = torch.zeros(rows, model.cfg.hidden_size, dtype=model.lm_head.dtype, device=dev)
        self.own_rank = model.moe_own_rank
        self.moe_rows = torch.zeros(
            max(len(layout.real_rows("cpu", self.own_rank)) for layout in layouts),
            dtype=torch.long,
            device=dev,
        )
        # Capture runs padding rows: table row 0 and one key, slot 0 (finite, no real KV).
        self.table_rows = torch.zeros(rows, dtype=torch.int32, device=dev)
        self.seq_lens = torch.ones(rows, dtype=torch.int32, device=dev)
        self.q_start = torch.arange(rows + 1, dtype=torch.int32, device=dev)  # one new token per row
        # (mode, bucket) -> (graph, its output, bytes its collectives send)
        self.graphs: dict[tuple[str, int], tuple[torch.cuda.CUDAGraph, torch.Tensor, int]] = {}
        show = model.groups.topo.rank == 0
        for layout in tqdm(layouts, desc=f"Capturing {what}", unit="graph", disable=not show):
            batch = self._static_batch(layout)
            hidden = None if self.hidden is None else self.hidden[: layout.local_rows]
            index = layout.row_index(dev)  # an idle step's layout
            self.row_index[: index.shape[0]].copy_(index)
            real = layout.real_rows(dev, self.own_rank)
            self.moe_rows[: real.shape[0]].copy_(real)
            for _ in range(2):  # eager warm-up: allocator, kernels and communicators in place
                forward(batch, hidden)
            torch.cuda.synchronize(dev)
            graph = torch.cuda.CUDAGraph()
            sent = SENT.total
            with torch.cuda.graph(graph, pool=mempool):
                out = forward(batch, hidden)
            self.graphs[(layout.padding_mode, layout.bucket)] = (graph, out, SENT.total - sent)
        torch.cuda.synchronize(dev)

    def _static_batch(self, layout: StepLayout) -> ForwardBatch:
        n = layout.local_rows
        attn = AttentionMetadata(
            self.req_to_token,
            self.table_rows[:n],
            self.seq_lens[:n],
            self.q_start[: n + 1],
            n,
            1,
            self.kv_len,
        )
        window_attn = attn.on_table(self.req_to_window) if self.req_to_window is not None else None
        return ForwardBatch(
            input_ids=self.input_ids[:n],
            positions=self.positions[:n],
            out_slots=self.out_slots[:n],
            attn=attn,
            logit_idx=self.input_ids[:0],
            layout=layout,
            row_index=self.row_index[:n]
            if layout.padding_mode == PaddingMode.SUM_LEN
            else self.row_index[:0],
            moe_rows=self.moe_rows[: len(layout.real_rows("cpu", self.own_rank))],
            window_attn=window_attn,
            out_window_slots=self.out_window_slots[:n] if window_attn is not None else None,
        )

    def has(self, layout: StepLayout) -> bool:
        return (layout.padding_mode, layout.bucket) in self.graphs

    def replay(self, batch: ForwardBatch, hidden: torch.Tensor | None = None) -> torch.Tensor:
        """Runs a padded batch (and, for the MTP layer's graphs, its rows' `hidden` states) through
        its graph; returns the output rows (a static buffer, valid until the next replay)."""
        layout = batch.layout
        graph, out, sent = self.graphs[(layout.padding_mode, layout.bucket)]
        for static, value in (
            (self.input_ids, batch.input_ids),
            (self.positions, batch.positions),
            (self.out_slots, batch.out_slots),
            (self.row_index, batch.row_index),
            (self.moe_rows, batch.moe_rows),
            (self.table_rows, batch.attn.table_rows),
            (self.seq_lens, batch.attn.seq_lens),
            *([(self.out_window_slots, batch.out_window_slots)] if self.req_to_window is not None else []),
            *([(self.hidden, hidden)] if self.hidden is not None else []),
        ):
            static[: value.shape[0]].copy_(value)
        graph.replay()
        SENT.total += sent
        return out
