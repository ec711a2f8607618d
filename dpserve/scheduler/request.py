"""A request as its group's scheduler tracks it, and the messages that carry requests."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from dpserve.sampling_params import SamplingParams


@dataclass
class GenerateRequest:
    """What the front end sends to a DP group's scheduler."""

    rid: str
    input_ids: list[int]
    params: SamplingParams
    return_logprob: bool = False


@dataclass
class Req:
    rid: str
    input_ids: list[int]
    params: SamplingParams
    return_logprob: bool
    reserved_tokens: int  # KV slots set aside for this request's whole life
    generator: torch.Generator | None = None
    kv_len: int = 0  # tokens whose KV is in the pool
    output_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)

    @property
    def prefill_done(self) -> bool:
        return self.kv_len >= len(self.input_ids)

    @property
    def seq_len(self) -> int:
        return len(self.input_ids) + len(self.output_ids)


def check_request_fits(prompt_len: int, params: SamplingParams, context_len: int, kv_capacity: int) -> None:
    """Raises ValueError, naming the numbers, for a request this engine can never run."""
    if prompt_len == 0:
        raise ValueError("the prompt is empty")
    if prompt_len >= context_len:
        raise ValueError(
            f"the prompt has {prompt_len} tokens, but the model's context length is {context_len}"
        )
    need = min(prompt_len + params.max_new_tokens, context_len)
    if need > kv_capacity:
        raise ValueError(
            f"the request needs {need} KV tokens ({prompt_len} prompt + up to {need - prompt_len} new), "
            f"but its DP group's KV pool holds only {kv_capacity} tokens"
        )
