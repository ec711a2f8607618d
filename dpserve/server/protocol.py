"""Request bodies of the HTTP API. Unknown fields are rejected, as OpenAI does.

Besides OpenAI's fields, completions and chat accept SGLang's sampling extensions:
top_k, min_p, ignore_eos, stop_token_ids, and data_parallel_rank to pin a request to a DP group.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from dpserve.sampling_params import SamplingParams


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class StreamOptions(_Strict):
    include_usage: bool = False


class _OpenAIRequest(_Strict):
    model: str
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    n: int = Field(1, ge=1, le=64)
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    user: str | None = None
    top_k: int = -1
    min_p: float = Field(0.0, ge=0.0, le=1.0)
    ignore_eos: bool = False
    stop_token_ids: list[int] = Field(default_factory=list)
    data_parallel_rank: int | None = None

    @model_validator(mode="after")
    def _no_penalties(self):
        for name in ("frequency_penalty", "presence_penalty"):
            if getattr(self, name) != 0:
                raise ValueError(f"{name} is not supported (only 0)")
        if self.top_k != -1 and self.top_k < 1:
            raise ValueError(f"top_k must be -1 or >= 1, got {self.top_k}")
        return self

    @property
    def stop_strings(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    def sampling_params(self, max_new_tokens: int, choice: int) -> SamplingParams:
        # With n > 1 and a seed, each choice gets its own seed so that choices differ.
        seed = None if self.seed is None else self.seed + choice
        return SamplingParams(
            max_new_tokens=max_new_tokens,
            temperature=self.temperature,
            top_k=self.top_k,
            top_p=self.top_p,
            min_p=self.min_p,
            seed=seed,
            stop_token_ids=list(self.stop_token_ids),
            ignore_eos=self.ignore_eos,
        )


class CompletionRequest(_OpenAIRequest):
    prompt: str | list[int] | list[str] | list[list[int]]
    max_tokens: int | None = Field(16, gt=0)
    logprobs: int | None = Field(None, ge=0)

    @model_validator(mode="after")
    def _logprobs(self):
        if self.logprobs:
            raise ValueError("logprobs > 0 (top alternatives) is not supported; use logprobs=0")
        return self


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class ChatMessage(_Strict):
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[TextPart]
    name: str | None = None

    def as_template_input(self) -> dict:
        text = self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)
        return {"role": self.role, "content": text}


class ChatCompletionRequest(_OpenAIRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, gt=0)
    max_completion_tokens: int | None = Field(None, gt=0)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0)

    @model_validator(mode="after")
    def _top_logprobs(self):
        if self.top_logprobs:
            raise ValueError("top_logprobs > 0 is not supported; logprobs=true returns the chosen tokens'")
        return self

    @property
    def max_new_tokens(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens


class GenerateRequestBody(_Strict):
    """Native /generate (SGLang's shape): text or input_ids, one or a batch."""

    text: str | list[str] | None = None
    input_ids: list[int] | list[list[int]] | None = None
    sampling_params: dict | list[dict] | None = None
    stream: bool = False
    return_logprob: bool = False
    data_parallel_rank: int | None = None

    @model_validator(mode="after")
    def _one_input(self):
        if (self.text is None) == (self.input_ids is None):
            raise ValueError("pass exactly one of text or input_ids")
        return self
