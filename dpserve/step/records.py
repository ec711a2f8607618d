"""The records ranks exchange each step (docs/design.md, section 3), in the order a step uses them:

- `GroupBatch`: what a group leader's scheduler decided (each request's new tokens and KV slots),
  shared with every rank of its group;
- `GroupSizes`: the few numbers each group all-gathers over WORLD;
- `StepLayout`: what every rank derives from all groups' sizes alike (padding mode, bucket, where
  each group's rows sit in the gathered buffer).

NEXTN's draft forwards after a step use the same pattern with `DraftBatch` and `DraftSizes`.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from enum import StrEnum

import torch

from dpserve.messages import Destination


class BatchKind(StrEnum):
    """What a group's batch does; ordered, so that a step's kind over all groups is the largest."""

    IDLE = "idle"
    DECODE = "decode"
    VERIFY = "verify"  # decode with speculative drafts: logits for every token
    EXTEND = "extend"  # some request prefills

    @property
    def order(self) -> int:
        return list(BatchKind).index(self)

    @classmethod
    def largest(cls, orders: list[int]) -> BatchKind:
        return list(cls)[max(orders)]


class PaddingMode(StrEnum):
    """How the DP groups' rows sit in the gathered buffer (SGLang's DP padding modes)."""

    SUM_LEN = "sum_len"  # one after another: the buffer holds the sum of the groups' rows
    MAX_LEN = "max_len"  # each group's rows padded to the largest group's: dp x max rows


# A decode token the previous step is still sampling (overlap scheduling): every rank of the group
# takes it from the sampled tokens on the device (`ModelRunner.keep_samples`) when it builds the inputs.
PENDING_TOKEN = -1


def round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


@dataclass
class BatchReq:
    """One request's part of a step. Every rank of the group applies it to its request-to-slot
    table: `prefix` at positions [0, start) when the request (re)starts on cached slots, then the
    new tokens' `slots` at [start, start + len(tokens))."""

    table_row: int  # the request's row of the request-to-slot table
    start: int  # tokens of the request already in the KV cache
    tokens: list[int]  # new tokens fed this step
    slots: list[int]  # KV slots the new tokens are written to
    sample: bool  # whether the next token is sampled after the last new token
    prefix: list[int] = field(default_factory=list)
    verify: bool = False  # tokens are the last token and its drafts: logits for every one of them
    # Hybrid sliding-window pool: the window layers' slots of positions [seq_len - len(window_slots),
    # seq_len): the new tokens' and, when it (re)starts on cached slots, the cached window before them.
    window_slots: list[int] = field(default_factory=list)

    @property
    def seq_len(self) -> int:
        return self.start + len(self.tokens)

    @property
    def logit_rows(self) -> int:
        return len(self.tokens) if self.verify else int(self.sample)


@dataclass
class KVSend:
    """Prefill-decode disaggregation: one request's prompt KV to write into a decode group's pool,
    at `dest`, as the decode leader sent it."""

    slots: list[int]  # the prompt's KV slots in this group's pool
    dest: Destination
    window_slots: list[int] = field(default_factory=list)  # hybrid pool: those of the prompt's last W - 1


@dataclass
class GroupBatch:
    kind: BatchKind = BatchKind.IDLE
    reqs: list[BatchReq] = field(default_factory=list)
    shutdown: bool = False
    sends: list[KVSend] = field(default_factory=list)  # written by every rank of the group before the forward

    @property
    def num_tokens(self) -> int:
        return sum(len(r.tokens) for r in self.reqs)

    @property
    def num_logit_rows(self) -> int:
        return sum(r.logit_rows for r in self.reqs)

    def sizes(self, can_pad: bool) -> GroupSizes:
        return GroupSizes(self.num_tokens, self.num_logit_rows, self.kind.order, self.shutdown, can_pad)


class IntRecord:
    """A record all-gathered as one row of ints; a trailing tuple field takes the rest of the row."""

    def to_ints(self) -> list[int]:
        out: list[int] = []
        for f in fields(self):
            value = getattr(self, f.name)
            out += [int(v) for v in value] if isinstance(value, tuple) else [int(value)]
        return out

    @classmethod
    def from_ints(cls, values: list[int]):
        kwargs, rest = {}, list(values)
        for f in fields(cls):
            if f.type.startswith("tuple"):
                kwargs[f.name], rest = tuple(rest), []
            else:
                kwargs[f.name] = bool(rest[0]) if f.type == "bool" else int(rest[0])
                rest = rest[1:]
        return cls(**kwargs)


@dataclass(frozen=True)
class GroupSizes(IntRecord):
    """One DP group's figures for a step."""

    tokens: int  # new tokens of the group (its rows before padding)
    logit_rows: int  # rows that need logits (a verify step: every token of a request with drafts)
    kind: int  # its BatchKind's order
    shutdown: bool
    can_pad: bool  # the group's batch fits a padded decode bucket (a CUDA graph on the GPU)


@dataclass
class DraftReq:
    """One request's rows of the MTP forwards that follow a step (NEXTN). Row p pairs the step's
    hidden state at position p with the token at p + 1, for every position the step kept (prefilled,
    or verified and accepted), so the MTP layer's KV matches the main model's."""

    table_row: int  # the request's row of the request-to-slot table
    start: int  # position of its first new token in the step
    offset: int  # index of that token among the step's rows
    next_tokens: list[int]  # the token after each kept position
    slots: list[int]  # the kept positions' KV slots (the MTP pool mirrors the main pool's)
    draft: bool  # still decoding: its last row starts a chain of drafts

    @property
    def end(self) -> int:
        """One past its last kept position: the position of the token the step produced."""
        return self.start + len(self.next_tokens)

    def chain_len(self, num_steps: int, context_len: int) -> int:
        """Chained MTP steps after the first (step j sits at position end - 1 + j)."""
        return max(0, min(num_steps - 1, context_len - self.end)) if self.draft else 0


@dataclass
class DraftBatch:
    reqs: list[DraftReq] = field(default_factory=list)

    @property
    def drafting(self) -> list[DraftReq]:
        return [r for r in self.reqs if r.draft]

    def sizes(self, num_steps: int, context_len: int) -> DraftSizes:
        chains = [r.chain_len(num_steps, context_len) for r in self.reqs]
        return DraftSizes(
            tokens=sum(len(r.next_tokens) for r in self.reqs),
            drafting=len(self.drafting),
            longest=max((r.end for r in self.drafting), default=0),
            chain=tuple(sum(c >= j for c in chains) for j in range(1, num_steps)),
        )


@dataclass(frozen=True)
class DraftSizes(IntRecord):
    """One DP group's rows in each MTP forward after a step: every group runs the same forwards
    (1 + num_steps - 1), an idle one with zero rows."""

    tokens: int  # rows of the first forward (every kept position)
    drafting: int  # requests drafting: the first forward's logit rows
    longest: int  # the end of its longest drafting request (chained step j attends to `longest + j` keys)
    chain: tuple[int, ...]  # rows of each chained forward


@dataclass(frozen=True)
class StepLayout:
    """Layout of one forward over the DP groups; identical on every rank."""

    padding_mode: PaddingMode
    tokens: tuple[int, ...]  # n_g for each DP group
    logit_rows: tuple[int, ...]  # rows to sample for each DP group
    dp_rank: int
    attn_tp_size: int
    bucket: int | None = None  # padded size (sum_len: global rows, max_len: M); None: unpadded

    @property
    def padded(self) -> bool:
        """Padded to a decode bucket: a CUDA graph replay on the GPU, the same shapes eagerly on the CPU."""
        return self.bucket is not None

    @property
    def total_tokens(self) -> int:
        return sum(self.tokens)

    @property
    def local_tokens(self) -> int:
        return self.tokens[self.dp_rank]

    @property
    def offset(self) -> int:
        return sum(self.tokens[: self.dp_rank])

    @property
    def padded_len(self) -> int:
        """M: the largest group's tokens rounded up to a multiple of the attention TP size."""
        return round_up(self.bucket or max(self.tokens), self.attn_tp_size)

    @property
    def mlp_rows(self) -> int:
        """Rows the MoE/MLP processes on every rank in this step (the gathered buffer)."""
        if self.padding_mode == PaddingMode.SUM_LEN:
            return self.bucket or self.total_tokens
        return len(self.tokens) * self.padded_len

    @property
    def local_rows(self) -> int:
        """Rows of this rank's batch: its group's tokens, padded up in a padded step."""
        if not self.padded:
            return self.local_tokens
        return self.bucket if self.padding_mode == PaddingMode.SUM_LEN else self.padded_len

    def row_index(self, device: torch.device) -> torch.Tensor:
        """sum_len: the row of the gathered buffer of each local row (padded rows: the spare row past
        its end). max_len keeps every group's rows in place and needs none."""
        if self.padding_mode != PaddingMode.SUM_LEN:
            return torch.empty(0, dtype=torch.long, device=device)
        i = torch.arange(self.local_rows, device=device)
        return torch.where(i < self.local_tokens, i + self.offset, self.mlp_rows)

    def real_rows(
        self, device: torch.device, own_rank: int | None = None, tokens: torch.Tensor | None = None
    ) -> torch.Tensor:
        """1 for each real row the MoE sees, 0 for padding (int64): every group's gathered rows, or
        with `own_rank` (an attention TP rank) that rank's own slice of its group's rows. `tokens`:
        `self.tokens` already on the device (a step stages it with its other inputs)."""
        if own_rank is not None:
            chunk = round_up(self.local_rows, self.attn_tp_size) // self.attn_tp_size
            rows = torch.arange(chunk, device=device) + own_rank * chunk
            return (rows < self.local_tokens).long()
        if (
            self.padding_mode == PaddingMode.SUM_LEN
        ):  # group g's rows start at the tokens before it: rows [0, S) real
            return (torch.arange(self.mlp_rows, device=device) < self.total_tokens).long()
        tokens = torch.tensor(self.tokens, device=device) if tokens is None else tokens
        return (torch.arange(self.padded_len, device=device)[None, :] < tokens[:, None]).long().flatten()
