"""CUDA graphs of padded decode steps, one per (padding mode, bucket) (design section 4).

Every rank captures the same graphs in the same order at start-up (they contain WORLD and
ATTN_TP collectives). A replay copies the step's inputs into static buffers: token ids,
positions, KV slots, each row's request-to-slot table row and KV length, and `row_index`,
where each local row sits in the gathered buffer. The graph's shapes depend on
the bucket alone, so one graph serves any split of the tokens over the DP groups, and an
idle group replays it with zero real rows. On the CPU the same padded batches run eagerly.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from tqdm import tqdm

from dpserve.attention.backend import AttentionMetadata
from dpserve.layers.dp_attention import DPStep
from dpserve.models.batch import ForwardBatch

if TYPE_CHECKING:
    from dpserve.engine.model_runner import ModelRunner


class CudaGraphRunner:
    def __init__(self, runner: ModelRunner):
        self.model, self.pool, self.req_to_token = runner.model, runner.pool, runner.req_to_token
        topo, planner, dev = runner.topo, runner.planner, runner.device
        steps = [
            DPStep(mode, (0,) * topo.dp_size, (0,) * topo.dp_size, topo.dp_rank, topo.attn_tp_size, bucket)
            for mode in planner.graph_modes
            for bucket in planner.buckets[mode]
        ]
        steps.sort(key=lambda s: -s.local_rows)  # largest first: the smaller graphs reuse its memory
        rows = steps[0].local_rows
        self.kv_len = runner.graph_kv_len
        self.input_ids = torch.zeros(rows, dtype=torch.long, device=dev)
        self.positions = torch.zeros_like(self.input_ids)
        self.out_slots = torch.zeros_like(self.input_ids)
        self.row_index = torch.zeros_like(self.input_ids)
        # Capture runs padding rows: table row 0 and one key, slot 0 (finite, no real KV).
        self.req_idx = torch.zeros(rows, dtype=torch.int32, device=dev)
        self.seq_lens = torch.ones(rows, dtype=torch.int32, device=dev)
        self.q_start = torch.arange(rows + 1, dtype=torch.int32, device=dev)  # one new token per row
        self.graphs: dict[tuple[str, int], tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        mempool = torch.cuda.graph_pool_handle()
        for step in tqdm(steps, desc="Capturing CUDA graphs", unit="graph", disable=topo.rank != 0):
            batch = self._static_batch(step)
            n = step.local_rows
            self.row_index[:n].copy_(torch.tensor(step.row_index()))  # an idle step's layout
            for _ in range(2):  # eager warm-up: allocator, kernels and communicators in place
                self.model.forward_hidden(batch, self.pool)
            torch.cuda.synchronize(dev)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=mempool):
                out = self.model.forward_hidden(batch, self.pool)
            self.graphs[(step.mode, step.bucket)] = (graph, out)
        torch.cuda.synchronize(dev)

    def _static_batch(self, step: DPStep) -> ForwardBatch:
        n = step.local_rows
        attn = AttentionMetadata(
            self.req_to_token, self.req_idx[:n], self.seq_lens[:n], self.q_start[: n + 1], n, 1, self.kv_len
        )
        return ForwardBatch(
            input_ids=self.input_ids[:n],
            positions=self.positions[:n],
            out_slots=self.out_slots[:n],
            attn=attn,
            logit_idx=self.input_ids[:0],
            step=step,
            row_index=self.row_index[:n],
        )

    def has(self, step: DPStep) -> bool:
        return (step.mode, step.bucket) in self.graphs

    def replay(self, batch: ForwardBatch) -> torch.Tensor:
        """Runs a padded decode batch through its graph; returns the hidden rows (a static buffer,
        valid until the next replay)."""
        step = batch.step
        graph, out = self.graphs[(step.mode, step.bucket)]
        n = step.local_rows
        for static, value in (
            (self.input_ids, batch.input_ids),
            (self.positions, batch.positions),
            (self.out_slots, batch.out_slots),
            (self.row_index, batch.row_index),
            (self.req_idx, batch.attn.req_idx),
            (self.seq_lens, batch.attn.seq_lens),
        ):
            static[:n].copy_(value)
        graph.replay()
        return out
