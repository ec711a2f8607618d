"""What the sampler needs beyond the logits for one step's sampling requests, built by the rank
from the scheduler's requests (the scheduler schedules; it builds no sampler input)."""

from __future__ import annotations

from dataclasses import dataclass
from itertools import accumulate

from dpserve.grammar import token_bitmask
from dpserve.messages import TokenOut
from dpserve.sampling_params import SamplingParams
from dpserve.scheduler.request import Req, ReqStatus
from dpserve.worker.sampler import GrammarMask, Penalties
from dpserve.worker.token_counts import TokenCounts


@dataclass(frozen=True)
class SamplingInputs:
    """Per sampling request, in logits-row order: its parameters, its random key (seed, tokens
    generated), its drafts; the penalties (None when none uses a penalty or a min_new_tokens floor)
    and the grammar mask (None when none has a grammar)."""

    params: list[SamplingParams]
    keys: list[tuple[int, int]]
    drafts: list[list[int]]
    penalties: Penalties | None
    grammar: GrammarMask | None


def sampling_inputs(
    reqs: list[Req], counts: TokenCounts, vocab_size: int, eos_ids: set[int]
) -> SamplingInputs:
    """The inputs of `reqs` (a step's sampling requests, in order)."""
    min_left = [max(0, r.params.min_new_tokens - len(r.output_ids)) for r in reqs]
    penalties = None
    if any(min_left) or any(r.params.penalized for r in reqs):
        penalties = Penalties(
            counts,
            [counts.rows.get(r.rid, -1) for r in reqs],
            min_left,
            [stop_ids(r, eos_ids) if left else [] for r, left in zip(reqs, min_left, strict=True)],
        )
    return SamplingInputs(
        [r.params for r in reqs],
        [(r.seed, len(r.output_ids)) for r in reqs],
        [r.drafts for r in reqs],
        penalties,
        grammar_mask(reqs, vocab_size),
    )


def follow_counts(counts: TokenCounts, running: list[Req], sampled: list[Req]) -> None:
    """Before a step samples: the rows of requests no longer running (ended, retracted, held for the
    decode side) go back, and each sampling request with a penalty has its row, filled from its
    prompt and what it generated so far (it samples for the first time, or again after a
    retraction): so the counts equal its tokens, whatever happened to it in between."""
    live = {r.rid for r in running}
    for rid in [rid for rid in counts.rows if rid not in live]:
        counts.release(rid)
    for req in sampled:  # (one that ended since its step was scheduled samples what nobody reads)
        if req.params.penalized and req.rid not in counts.rows and req.status is not ReqStatus.FINISHED:
            counts.acquire(req.rid, req.input_ids, req.output_ids)


def count_tokens(counts: TokenCounts, tokens: list[TokenOut]) -> None:
    """After a step: its new tokens, counted for the requests that hold rows."""
    kept = [t for t in tokens if t.rid in counts.rows]
    counts.add([t.rid for t in kept], [t.token for t in kept])


def grammar_mask(reqs: list[Req], vocab_size: int) -> GrammarMask | None:
    """The token bitmask of the sampled rows of `reqs` (each request's last token and drafts),
    filled by the matchers of those with a grammar; a request still reasoning is constrained
    only from the row after its drafts' end of the reasoning, if they have one."""
    if not any(r.matcher is not None for r in reqs):
        return None
    starts = [0, *accumulate(1 + len(r.drafts) for r in reqs)]
    bitmask, rows = token_bitmask(starts[-1], vocab_size), []
    for req, start, end in zip(reqs, starts, starts[1:], strict=False):
        if req.matcher is None or req.status is ReqStatus.FINISHED:
            continue
        drafts = req.drafts
        if req.grammar_after is not None:
            if req.grammar_after not in drafts:
                continue
            skip = drafts.index(req.grammar_after) + 1
            start, drafts = start + skip, drafts[skip:]
        req.matcher.fill(bitmask, start, drafts)
        rows += range(start, end)
    return GrammarMask(bitmask, rows) if rows else None


def stop_ids(req: Req, eos_ids: set[int]) -> list[int]:
    """The tokens that would end the request (min_new_tokens keeps them from being sampled)."""
    eos = set() if req.params.ignore_eos else eos_ids
    return sorted(eos | set(req.params.stop_token_ids))
