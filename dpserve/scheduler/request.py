"""A request as its group's scheduler tracks it, and the check every request passes once where it
enters (the server, the offline Engine) before it may run."""

from __future__ import annotations

from concurrent.futures import Future
from dataclasses import dataclass, field
from enum import Enum

from dpserve.grammar import Matcher
from dpserve.kvcache.radix_cache import Node
from dpserve.messages import Bootstrap
from dpserve.sampling_params import SamplingParams


class ReqStatus(Enum):
    """Where a request is in its group's life; the scheduler's queue and lists follow it."""

    WAITING = "waiting"  # queued, first or after a retraction: it holds no KV
    AWAITING_KV = "awaiting_kv"  # decode side: admitted, its prompt's slots reserved for the prefill side
    RUNNING = "running"  # admitted: prefilling, then decoding
    SENDING = "sending"  # prefill side: done here, its KV held until written to the decode side
    FINISHED = "finished"


@dataclass
class Req:
    rid: str
    input_ids: list[int]
    params: SamplingParams
    return_logprob: bool
    max_len: int  # the most tokens this request can ever hold in the KV cache
    seed: int = 0  # of its sampling noise (its own seed, or one the scheduler drew for it)
    output_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)  # per token, if asked
    # While admitted (running):
    table_row: int = 0  # its row of the request-to-slot table (0: not admitted)
    prefill_len: int = 0  # tokens to prefill since admission: prompt + what it generated before
    slots: list[int] = field(default_factory=list)  # KV slots of its first len(slots) tokens
    node: Node | None = None  # radix tree node it locks: its first `cached_len` slots belong to the tree
    cached_len: int = 0
    prefix_pending: bool = False  # its cached prefix is not in its table row yet: its next chunk carries it
    dup_slots: list[int] = field(default_factory=list)  # own copies of tokens the tree also holds
    window_lo: int = 0  # hybrid sliding-window pool: it holds the window slots of positions from here
    drafts: list[int] = field(default_factory=list)  # speculative tokens verified in this step
    proposed: list[int] = field(default_factory=list)  # NEXTN: the MTP's drafts for its next step
    # Scheduled steps that sample its next tokens and whose samples are not processed yet: 0 when a
    # step is scheduled in the sequential loop; under overlap scheduling 1 then (the step before),
    # 2 from the end of scheduling one step to the processing of the one before.
    in_flight: int = 0
    # Accounting:
    cached_tokens: int | None = None  # prompt tokens found in the cache at first admission
    retractions: int = 0
    protected: bool = False  # admitted with its whole need reserved: never retracted again
    spec_verify_ct: int = 0  # decode steps with speculative decoding on (accept length: tokens / steps)
    # Structured output: its grammar being compiled, then its matcher (made when first admitted).
    compiled: Future | None = None
    matcher: Matcher | None = None
    grammar_after: int | None = None  # the grammar applies after this token (None: it does now)
    status: ReqStatus = ReqStatus.WAITING
    # Prefill-decode disaggregation: its other half; on a decode instance, whether its prompt's KV
    # is still to come from the prefill instance (admitted, it awaits it: ReqStatus.AWAITING_KV).
    bootstrap: Bootstrap | None = None
    kv_from_prefill: bool = False

    @property
    def kv_len(self) -> int:
        return len(self.slots)

    @property
    def seq_len(self) -> int:
        return len(self.input_ids) + len(self.output_ids)

    @property
    def fill_ids(self) -> list[int]:
        return self.input_ids + self.output_ids

    @property
    def prefill_done(self) -> bool:
        return self.table_row > 0 and self.kv_len >= self.prefill_len

    @property
    def ending(self) -> bool:
        """Whether the token in flight is its last (its length ends it): it takes no step more."""
        return self.in_flight > 0 and self.remaining_new_tokens <= 1

    @property
    def remaining_new_tokens(self) -> int:
        """Tokens it may still generate (each needs a KV slot, but the last)."""
        return max(0, self.max_len - self.seq_len)


def max_kv_len(prompt_len: int, params: SamplingParams, context_len: int) -> int:
    return min(prompt_len + params.max_new_tokens, context_len)


def check_request(
    input_ids: list[int], params: SamplingParams, vocab_size: int, context_len: int, kv_capacity: int
) -> None:
    """Raises ValueError, naming the numbers, for a request this engine can never run: the one check
    every request passes before it is queued (HTTP and offline alike)."""
    params.validate()
    if not input_ids:
        raise ValueError("the prompt is empty")
    bad = next((t for t in input_ids if not isinstance(t, int) or not 0 <= t < vocab_size), None)
    if bad is not None:
        raise ValueError(f"token id {bad!r} is outside the vocabulary [0, {vocab_size})")
    bad = next((t for t in params.stop_token_ids if not isinstance(t, int) or not 0 <= t < vocab_size), None)
    if bad is not None:
        raise ValueError(f"stop token id {bad!r} is outside the vocabulary [0, {vocab_size})")
    bad = next((t for t in params.logit_bias if not 0 <= t < vocab_size), None)
    if bad is not None:
        raise ValueError(f"logit_bias token id {bad!r} is outside the vocabulary [0, {vocab_size})")
    prompt_len = len(input_ids)
    if prompt_len >= context_len:
        raise ValueError(
            f"the prompt has {prompt_len} tokens, but the model's context length is {context_len}"
        )
    if prompt_len + params.max_new_tokens > context_len:
        raise ValueError(
            f"the prompt has {prompt_len} tokens and max_new_tokens is {params.max_new_tokens}: "
            f"{prompt_len + params.max_new_tokens} tokens, but the model's context length is {context_len}"
        )
    need = max_kv_len(prompt_len, params, context_len)
    if need > kv_capacity:
        raise ValueError(
            f"the request needs {need} KV tokens ({prompt_len} prompt + up to {need - prompt_len} new), "
            f"but its DP group's KV pool holds only {kv_capacity} tokens"
        )
