"""What every rank must agree on per step, in one place.

`StepPlan`: what a group leader's scheduler decides and broadcasts inside its group (ATTN_TP).
`GroupStep`: the few numbers every group then all-gathers over WORLD, from which every rank
derives the step's layout (padding mode, graph bucket) identically.
`DraftPlan` / `DraftCounts`: the same pair for the MTP forwards NEXTN runs after each step.
"""

from __future__ import annotations

from dataclasses import astuple, dataclass, field, fields

MODES = ("idle", "decode", "verify", "extend")  # ordered so that a step's global kind is the largest


@dataclass
class ReqStep:
    """One request's part of a step. Every rank of the group applies it to its request-to-slot
    table: `prefix` at positions [0, start) when the request (re)starts on cached slots, then the
    new tokens' `slots` at [start, start + len(tokens))."""

    row: int  # the request's row of the request-to-slot table
    start: int  # tokens of the request already in the KV cache
    tokens: list[int]  # new tokens fed this step
    slots: list[int]  # KV slots the new tokens are written to
    sample: bool  # whether the next token is sampled after the last new token
    prefix: list[int] = field(default_factory=list)
    verify: bool = False  # tokens are the last token and its drafts: logits for every one of them

    @property
    def seq_len(self) -> int:
        return self.start + len(self.tokens)

    @property
    def logit_rows(self) -> int:
        return len(self.tokens) if self.verify else int(self.sample)


@dataclass
class StepPlan:
    mode: str = "idle"  # "extend" (some request prefills), "verify" (decode with drafts), "decode", "idle"
    reqs: list[ReqStep] = field(default_factory=list)
    shutdown: bool = False

    @property
    def num_tokens(self) -> int:
        return sum(len(r.tokens) for r in self.reqs)

    @property
    def num_logit_rows(self) -> int:
        return sum(r.logit_rows for r in self.reqs)


@dataclass(frozen=True)
class GroupStep:
    """One DP group's figures for a step, all-gathered as ints over WORLD."""

    tokens: int  # new tokens of the group (its rows before padding)
    samples: int  # rows that need logits (a verify step: every token of a request with drafts)
    mode: int  # index into MODES
    shutdown: bool
    can_pad: bool  # the group's batch fits a padded decode graph

    def to_ints(self) -> list[int]:
        return [int(v) for v in astuple(self)]

    @classmethod
    def from_ints(cls, values: list[int]) -> GroupStep:
        return cls(
            *(bool(v) if f.type == "bool" else int(v) for f, v in zip(fields(cls), values, strict=True))
        )


@dataclass
class DraftReq:
    """One request's rows of the MTP forwards that follow a step (NEXTN). Row p pairs the step's
    hidden state at position p with the token at p + 1, for every position the step kept (prefilled,
    or verified and accepted), so the MTP layer's KV matches the main model's."""

    row: int  # the request's row of the request-to-slot table
    start: int  # position of its first new token in the step
    offset: int  # index of that token among the step's rows
    next_tokens: list[int]  # the token after each kept position
    draft: bool  # still decoding: its last row starts a chain of drafts

    @property
    def end(self) -> int:
        """One past its last kept position: the position of the token the step produced."""
        return self.start + len(self.next_tokens)

    def chain_len(self, num_steps: int, context_len: int) -> int:
        """Chained MTP steps after the first (step j sits at position end - 1 + j)."""
        return max(0, min(num_steps - 1, context_len - self.end)) if self.draft else 0


@dataclass
class DraftPlan:
    reqs: list[DraftReq] = field(default_factory=list)

    @property
    def drafting(self) -> list[DraftReq]:
        return [r for r in self.reqs if r.draft]

    def counts(self, num_steps: int, context_len: int) -> DraftCounts:
        chains = [r.chain_len(num_steps, context_len) for r in self.reqs]
        return DraftCounts(
            tokens=sum(len(r.next_tokens) for r in self.reqs),
            drafting=len(self.drafting),
            chain=tuple(sum(c >= j for c in chains) for j in range(1, num_steps)),
        )


@dataclass(frozen=True)
class DraftCounts:
    """One DP group's rows in each MTP forward after a step, all-gathered as ints over WORLD: every
    group runs the same forwards (1 + num_steps - 1), an idle one with zero rows."""

    tokens: int  # rows of the first forward (every kept position)
    drafting: int  # requests drafting: the first forward's logit rows
    chain: tuple[int, ...]  # rows of each chained forward

    def to_ints(self) -> list[int]:
        return [self.tokens, self.drafting, *self.chain]

    @classmethod
    def from_ints(cls, values: list[int]) -> DraftCounts:
        return cls(values[0], values[1], tuple(values[2:]))
