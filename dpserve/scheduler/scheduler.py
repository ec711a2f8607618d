"""Continuous batching for one DP group, run by the group's attn_tp_rank 0."""

from __future__ import annotations

from collections import deque

import torch

from dpserve.kvcache.pool import SlotAllocator
from dpserve.scheduler.plan import RequestSlots, StepPlan
from dpserve.scheduler.request import GenerateRequest, Req, check_request_fits


class Scheduler:
    """Continuous batching: a step prefills waiting prompts (chunked, `chunk_size` tokens per step
    including the decode tokens that ride along) and decodes every running request. A request is
    admitted only when its whole KV need (prompt + max_new_tokens) can be reserved, so running
    requests never run out of slots; the rest wait in the queue."""

    def __init__(
        self,
        dp_rank: int,
        kv_capacity: int,
        max_running: int,
        chunk_size: int,
        context_len: int,
        eos_ids: tuple[int, ...],
        seed: int,
        slots: RequestSlots,
    ):
        self.dp_rank = dp_rank
        self.kv_capacity = kv_capacity
        self.max_running, self.chunk_size, self.context_len = max_running, chunk_size, context_len
        self.eos_ids = set(eos_ids)
        self.allocator = SlotAllocator(kv_capacity)
        self.slots = slots
        self.generator = torch.Generator().manual_seed(seed + dp_rank)
        self.waiting: deque[Req] = deque()
        self.running: list[Req] = []
        self.reserved = 0
        self.to_free: list[str] = []
        self.generated_tokens = 0  # since start, for /metrics
        self.prefilled_tokens = 0

    def add(self, msg: GenerateRequest) -> dict | None:
        """Queues a request; returns an error output if it can never run."""
        try:
            check_request_fits(len(msg.input_ids), msg.params, self.context_len, self.kv_capacity)
        except ValueError as e:
            reason = {"type": "abort", "message": str(e)}
            return self._output(msg.rid, msg.input_ids, [], [], msg.return_logprob, reason)
        gen = None if msg.params.seed is None else torch.Generator().manual_seed(msg.params.seed)
        need = min(len(msg.input_ids) + msg.params.max_new_tokens, self.context_len)
        self.waiting.append(Req(msg.rid, msg.input_ids, msg.params, msg.return_logprob, need, gen))
        return None

    def abort(self, rid: str) -> dict | None:
        for req in list(self.waiting):
            if req.rid == rid:
                self.waiting.remove(req)
                return self._finish(req, {"type": "abort", "message": "aborted"})
        for req in self.running:
            if req.rid == rid:
                return self._finish(req, {"type": "abort", "message": "aborted"})
        return None

    def schedule(self) -> StepPlan:
        plan = self._schedule_extend() or self._schedule_decode()
        plan.freed, self.to_free = self.to_free, []
        return plan

    def _schedule_extend(self) -> StepPlan | None:
        # Requests already decoding ride along in the prefill step (mixed batch), so new arrivals
        # never stall them; their tokens count against the step's budget.
        decoding = [r for r in self.running if r.prefill_done]
        plan, budget = StepPlan(mode="extend"), self.chunk_size - len(decoding)
        # A request whose prompt was split into chunks continues first.
        for req in self.running:
            if not req.prefill_done and budget > 0:
                budget -= self._add_chunk(plan, req, budget)
        while self.waiting and budget > 0 and len(self.running) < self.max_running:
            req = self.waiting[0]
            if self.reserved + req.reserved_tokens > self.kv_capacity:
                break
            self.waiting.popleft()
            self.reserved += req.reserved_tokens
            self.running.append(req)
            budget -= self._add_chunk(plan, req, budget)
        if not plan.rids:
            return None
        for req in decoding:
            self._add_decode(plan, req)
        return plan

    def _add_chunk(self, plan: StepPlan, req: Req, budget: int) -> int:
        n = min(budget, len(req.input_ids) - req.kv_len)
        plan.rids.append(req.rid)
        plan.new_tokens.append(req.input_ids[req.kv_len : req.kv_len + n])
        plan.new_slots.append(self.allocator.alloc(n))
        req.kv_len += n
        plan.sample.append(req.prefill_done)
        self.prefilled_tokens += n
        return n

    def _schedule_decode(self) -> StepPlan:
        plan = StepPlan(mode="decode" if self.running else "idle")
        for req in self.running:
            self._add_decode(plan, req)
        return plan

    def _add_decode(self, plan: StepPlan, req: Req) -> None:
        plan.rids.append(req.rid)
        plan.new_tokens.append([req.output_ids[-1]])
        plan.new_slots.append(self.allocator.alloc(1))
        plan.sample.append(True)
        req.kv_len += 1

    def sampling_inputs(self, plan: StepPlan) -> tuple[list, list[torch.Generator]]:
        """Sampling parameters and generators of the plan's requests that sample this step."""
        reqs = self._sampled(plan)
        return [r.params for r in reqs], [r.generator or self.generator for r in reqs]

    def _sampled(self, plan: StepPlan) -> list[Req]:
        by_rid = {r.rid: r for r in self.running}
        return [by_rid[rid] for rid, s in zip(plan.rids, plan.sample, strict=True) if s]

    def process_samples(
        self, plan: StepPlan, tokens: list[int], logprobs: list[float]
    ) -> tuple[list[tuple[str, int, float]], list[dict]]:
        """Appends the sampled tokens; returns them as (rid, token, logprob) and the outputs of the
        requests that finished."""
        new, finished = [], []
        for req, tok, lp in zip(self._sampled(plan), tokens, logprobs, strict=True):
            req.output_ids.append(tok)
            req.logprobs.append(lp)
            new.append((req.rid, tok, lp))
            reason = self._finish_reason(req, tok)
            if reason is not None:
                finished.append(self._finish(req, reason))
        self.generated_tokens += len(new)
        return new, finished

    def stats(self) -> dict:
        """Load figures of this DP group, for routing and /metrics."""
        return {
            "running": len(self.running),
            "queued": len(self.waiting),
            "kv_used": self.kv_capacity - self.allocator.num_free,
            "kv_free": self.allocator.num_free,
            "kv_reserved": self.reserved,
            "generated_tokens": self.generated_tokens,
            "prefilled_tokens": self.prefilled_tokens,
        }

    def _finish_reason(self, req: Req, tok: int) -> dict | None:
        p = req.params
        if (tok in self.eos_ids and not p.ignore_eos) or tok in p.stop_token_ids:
            return {"type": "stop", "matched": tok}
        if len(req.output_ids) >= p.max_new_tokens or req.seq_len >= self.context_len:
            return {"type": "length", "length": len(req.output_ids)}
        return None

    def _finish(self, req: Req, reason: dict) -> dict:
        if req in self.running:
            self.running.remove(req)
            self.reserved -= req.reserved_tokens
            self.allocator.free(self.slots.slots.pop(req.rid, []))
            self.to_free.append(req.rid)
        logprobs = req.logprobs if req.return_logprob else []
        return self._output(req.rid, req.input_ids, req.output_ids, logprobs, req.return_logprob, reason)

    def _output(
        self, rid: str, input_ids: list[int], output_ids: list[int], logprobs, return_logprob: bool, reason
    ) -> dict:
        return {
            "rid": rid,
            "output_ids": list(output_ids),
            "return_logprob": return_logprob,
            "output_token_logprobs": list(logprobs),
            "finish_reason": reason,
            "prompt_tokens": len(input_ids),
            "completion_tokens": len(output_ids),
            "dp_rank": self.dp_rank,
        }
