"""Request bodies of the HTTP API: one model per endpoint, holding the endpoint's table of accepted
fields (docs/api.md, "Request fields"): OpenAI's fields and SGLang's extensions, as SGLang's router
(sglang-router) fills them in on every request. A field is

- implemented;
- accepted without effect: whatever its value, dpserve does what SGLang does without the feature
  behind it (no reasoning parser, nothing logged per request);
- or accepted only at its neutral value (`NEUTRAL`): another value is a 400 naming the field.

Fields in none of these are rejected (a typo gets a 400, as OpenAI does).
"""

from __future__ import annotations

import json
from typing import Annotated, Any, ClassVar, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field, StringConstraints, model_validator
from pydantic_core import PydanticCustomError

from dpserve.grammar import JSON_OBJECT, KINDS
from dpserve.messages import Bootstrap
from dpserve.sampling_params import (
    INT64_MAX,
    INT64_MIN,
    MAX_LOGIT_BIAS,
    MAX_STOP,
    MAX_STOP_CHARS,
    MAX_STOP_TOKEN_IDS,
    MAX_TOP_LOGPROBS,
    SamplingParams,
    check_stop_strings,
)
from dpserve.server.tools import forced_schema

T = TypeVar("T")

# The bounds of sampling_params.py, spelled so that the OpenAPI schema states them.
Int64 = Annotated[int, Field(ge=INT64_MIN, le=INT64_MAX)]
# The server's OpenAPI document bounds these by the served model's vocabulary (server/http.py).
TokenId = Annotated[int, Field(ge=0, le=INT64_MAX, json_schema_extra={"x-token-id": True})]
Count = Annotated[int, Field(gt=0, le=INT64_MAX)]  # max_tokens and the like
Prompt = Annotated[str, StringConstraints(min_length=1)]
TokenIds = Annotated[list[TokenId], Field(min_length=1)]
Batch = Annotated[list[T], Field(min_length=1)]  # of prompts: never empty
StopString = Annotated[str, StringConstraints(min_length=1, max_length=MAX_STOP_CHARS)]
Stop = StopString | Annotated[list[StopString], Field(max_length=MAX_STOP)] | None
TokenIdKey = Annotated[str, StringConstraints(pattern=r"^[0-9]{1,19}$")]
LogitBias = Annotated[
    dict[TokenIdKey, Annotated[float, Field(ge=-100, le=100)]], Field(max_length=MAX_LOGIT_BIAS)
]


class _Strict(BaseModel):
    # Unknown fields refused; NaN and infinities refused in every float (Python's JSON reads them);
    # no coercion (0 is not false, "16" not 16): a value of the wrong JSON type is a 400.
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False, strict=True)
    # Fields accepted only at one of their neutral values (features dpserve does not have).
    NEUTRAL: ClassVar[dict[str, tuple]] = {}

    @model_validator(mode="before")
    @classmethod
    def _only_neutral(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        data = dict(data)
        for name, accepted in cls.NEUTRAL.items():
            if name in data and (value := data.pop(name)) not in accepted:
                raise PydanticCustomError(
                    "not_supported",
                    "{name}={value} is not supported (only {accepted})",
                    {
                        "name": name,
                        "value": json.dumps(value),
                        "accepted": " or ".join(map(json.dumps, accepted)),
                    },
                )
        return data

    @classmethod
    def accepted_fields(cls) -> set[str]:
        """Every field name the endpoint accepts (its table in docs/api.md)."""
        return set(cls.model_fields) | set(cls.NEUTRAL)


Port = Annotated[int, Field(ge=1, le=65535)]
Room = Annotated[int, Field(ge=0, le=INT64_MAX)]


class _Disaggregated(_Strict):
    """The fields the PD router (sglang-router --pd-disaggregation) adds: where the prefill
    instance's bootstrap endpoint is and the room both halves share; lists for a batch's items."""

    bootstrap_host: str | list[str] | None = None
    bootstrap_port: Port | list[Port | None] | None = None
    bootstrap_room: Room | list[Room] | None = None

    def bootstraps(self, count: int, default_port: int) -> list[Bootstrap | None]:
        """Each of `count` items' Bootstrap (None without a room); a port left out is `default_port`."""
        if self.bootstrap_room is None:
            return [None] * count
        if not isinstance(self.bootstrap_room, list) and count > 1:
            raise ValueError(f"one bootstrap_room for {count} sequences: each needs its own (a list)")

        def items(name: str, value):
            if not isinstance(value, list):
                return [value] * count
            if len(value) != count:
                raise ValueError(f"{name} has {len(value)} entries for {count} prompts")
            return value

        hosts = items("bootstrap_host", self.bootstrap_host)
        ports = items("bootstrap_port", self.bootstrap_port)
        rooms = items("bootstrap_room", self.bootstrap_room)
        if None in hosts:
            raise ValueError("bootstrap_room needs bootstrap_host (the prefill instance's host)")
        return [
            Bootstrap(h, default_port if p is None else p, r)
            for h, p, r in zip(hosts, ports, rooms, strict=True)
        ]


class ErrorDetail(BaseModel):
    message: str
    type: str
    code: int


class ErrorResponse(BaseModel):
    """Every error's body, on every path (OpenAI's shape)."""

    error: ErrorDetail


class StreamOptions(_Strict):
    include_usage: bool = False
    continuous_usage_stats: bool = False  # no effect: usage comes once, at the end


class _OpenAIRequest(_Disaggregated):
    NEUTRAL: ClassVar[dict[str, tuple]] = {
        "return_hidden_states": (False,),
        "lora_path": (None,),
        "session_params": (None,),
    }

    model: str
    temperature: float | None = Field(1.0, ge=0.0, le=2.0)
    top_p: float | None = Field(1.0, gt=0.0, le=1.0)
    n: int | None = Field(1, ge=1, le=64)
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    stop: Stop = None
    seed: Int64 | None = None
    sampling_seed: Int64 | None = None  # SGLang's name for seed
    frequency_penalty: float | None = Field(0.0, ge=-2.0, le=2.0)
    presence_penalty: float | None = Field(0.0, ge=-2.0, le=2.0)
    repetition_penalty: float = Field(1.0, gt=0.0, le=2.0)
    logit_bias: LogitBias | None = None
    min_tokens: int = Field(0, ge=0, le=INT64_MAX)
    top_k: int = Field(-1, ge=-1, le=INT64_MAX)  # not 0; above the vocabulary: the whole of it
    min_p: float = Field(0.0, ge=0.0, le=1.0)
    ignore_eos: bool = False
    stop_token_ids: list[TokenId] | None = Field(None, max_length=MAX_STOP_TOKEN_IDS)
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    no_stop_trim: bool = False
    data_parallel_rank: int | None = Field(None, ge=0, le=INT64_MAX)
    user: str | None = None  # no effect
    # Structured output (SGLang's; dpserve/grammar.py), one at most, response_format included.
    json_schema: str | None = None
    regex: str | None = None
    ebnf: str | None = None

    # Fields OpenAI documents as nullable with a default: null means that default.
    NULL_IS_DEFAULT: ClassVar[tuple[str, ...]] = (
        "temperature",
        "top_p",
        "n",
        "stream",
        "frequency_penalty",
        "presence_penalty",
    )

    @model_validator(mode="after")
    def _check(self):
        for name in self.NULL_IS_DEFAULT:
            if getattr(self, name) is None:
                setattr(self, name, type(self).model_fields[name].default)
        if self.top_k == 0:
            raise ValueError("top_k must be -1 or >= 1, got 0")
        if None not in (self.seed, self.sampling_seed) and self.seed != self.sampling_seed:
            raise ValueError(f"seed={self.seed} and sampling_seed={self.sampling_seed} differ")
        return self

    @property
    def stop_strings(self) -> list[str]:
        return check_stop_strings(self.stop or [])

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    @property
    def top_logprobs_num(self) -> int:
        return 0

    @property
    def grammar(self) -> dict[str, str | None]:
        """The structured-output fields of SamplingParams."""
        return {kind: getattr(self, kind) for kind in KINDS}

    def sampling_params(self, max_new_tokens: int, choice: int) -> SamplingParams:
        # With n > 1 and a seed, each choice gets its own seed so that choices differ.
        seed = self.seed if self.seed is not None else self.sampling_seed
        return SamplingParams(
            max_new_tokens=max_new_tokens,
            min_new_tokens=self.min_tokens,
            temperature=self.temperature,
            top_k=self.top_k,
            top_p=self.top_p,
            min_p=self.min_p,
            seed=None if seed is None else seed + choice,
            frequency_penalty=self.frequency_penalty,
            presence_penalty=self.presence_penalty,
            repetition_penalty=self.repetition_penalty,
            logit_bias={int(k): v for k, v in (self.logit_bias or {}).items()},
            stop_token_ids=list(self.stop_token_ids or []),
            ignore_eos=self.ignore_eos,
            top_logprobs_num=self.top_logprobs_num,
            skip_special_tokens=self.skip_special_tokens,
            spaces_between_special_tokens=self.spaces_between_special_tokens,
            no_stop_trim=self.no_stop_trim,
            **self.grammar,
        )


class CompletionRequest(_OpenAIRequest):
    NEUTRAL: ClassVar[dict[str, tuple]] = {
        **_OpenAIRequest.NEUTRAL,
        "best_of": (None, 1),
        "suffix": (None, ""),
    }
    NULL_IS_DEFAULT: ClassVar[tuple[str, ...]] = (*_OpenAIRequest.NULL_IS_DEFAULT, "max_tokens", "echo")

    prompt: Prompt | TokenIds | Batch[Prompt] | Batch[TokenIds]
    max_tokens: Count | None = 16
    logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    echo: bool | None = False
    rid: str | list[str] | None = None  # no effect: dpserve names requests itself

    @model_validator(mode="after")
    def _echo(self):
        if self.echo and self.logprobs is not None:
            raise ValueError("echo with logprobs is not supported (no log-probabilities of the prompt)")
        return self

    @property
    def top_logprobs_num(self) -> int:
        return self.logprobs or 0

    @property
    def max_new_tokens(self) -> int:
        return self.max_tokens


class TextPart(_Strict):
    type: Literal["text"]
    text: str


FunctionName = Annotated[str, StringConstraints(pattern=r"^[A-Za-z0-9_.-]{1,64}$")]


class FunctionCall(_Strict):
    name: FunctionName
    arguments: str  # JSON text


class MessageToolCall(_Strict):
    """A call an earlier assistant message made (multi-turn tool use)."""

    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(_Strict):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None  # None: an assistant message that only calls tools
    name: str | None = None
    tool_calls: list[MessageToolCall] | None = None  # the assistant's
    tool_call_id: str | None = None  # a tool message: the call it answers

    @model_validator(mode="after")
    def _content(self):
        if self.content is None and not (self.role == "assistant" and self.tool_calls):
            raise ValueError(f"a {self.role} message needs content")
        return self

    def as_template_input(self) -> dict:
        """The message as chat templates read it: text content; calls with their arguments as
        objects (what Hugging Face templates expect) when they are JSON."""
        content = self.content
        text = content if isinstance(content, str) or content is None else "".join(p.text for p in content)
        out = {"role": self.role, "content": text}
        if self.tool_calls:
            out["tool_calls"] = [
                {
                    "id": c.id,
                    "type": "function",
                    "function": {"name": c.function.name, "arguments": _json_or_text(c.function.arguments)},
                }
                for c in self.tool_calls
            ]
        if self.tool_call_id is not None:
            out["tool_call_id"] = self.tool_call_id
        return out


def _json_or_text(text: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


class FunctionDef(_Strict):
    name: FunctionName
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema; none: any JSON object
    strict: bool | None = None  # the arguments always follow `parameters` under a forced tool_choice


class Tool(_Strict):
    type: Literal["function"]
    function: FunctionDef


class ToolChoiceFunction(_Strict):
    name: FunctionName


class NamedToolChoice(_Strict):
    type: Literal["function"]
    function: ToolChoiceFunction


class JsonSchemaFormat(_Strict):
    """OpenAI's `response_format.json_schema`. The output always follows `schema` (any JSON object
    when absent), `strict` or not: the grammar is enforced at every token."""

    name: Annotated[str, StringConstraints(pattern=r"^[A-Za-z0-9_-]{1,64}$")]
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Strict):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_given(self):
        if (self.type == "json_schema") != (self.json_schema is not None):
            raise ValueError("response_format.json_schema is required with type json_schema, and only then")
        return self

    @property
    def schema_text(self) -> str | None:
        """The JSON schema the output follows; None for plain text."""
        if self.type == "text":
            return None
        schema = self.json_schema.schema_ if self.json_schema is not None else None
        return JSON_OBJECT if schema is None else json.dumps(schema)


class ChatCompletionRequest(_OpenAIRequest):
    NEUTRAL: ClassVar[dict[str, tuple]] = {
        **_OpenAIRequest.NEUTRAL,
        "functions": (None, []),
        "function_call": (None, "none", "auto"),
        "reasoning_effort": (None,),
        "modalities": (None, ["text"]),
        "audio": (None,),
        "prediction": (None,),
        "web_search_options": (None,),
        "service_tier": (None, "auto", "default"),
        "store": (None, False),
        "verbosity": (None,),
    }

    NULL_IS_DEFAULT: ClassVar[tuple[str, ...]] = (*_OpenAIRequest.NULL_IS_DEFAULT, "logprobs")

    messages: list[ChatMessage] = Field(min_length=1)
    response_format: ResponseFormat | None = None
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None  # null: auto with tools
    parallel_tool_calls: bool | None = None  # null: true
    max_tokens: Count | None = None  # null: up to the context length (OpenAI's default)
    max_completion_tokens: Count | None = None
    logprobs: bool | None = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    # With --reasoning-parser: reasoning_content apart from content; streamed as it comes, or whole.
    separate_reasoning: bool = True
    stream_reasoning: bool = True
    # No effect: nothing stored.
    metadata: dict[str, str] | None = None
    prompt_cache_key: str | None = None  # the prefix cache needs no key
    safety_identifier: str | None = None

    @model_validator(mode="after")
    def _chat(self):
        if self.top_logprobs and not self.logprobs:
            raise ValueError("top_logprobs requires logprobs=true")
        if self.continue_final_message and self.messages[-1].role != "assistant":
            raise ValueError("continue_final_message requires the last message to be the assistant's")
        if self.json_schema is not None and self.response_format not in (None, ResponseFormat(type="text")):
            raise ValueError("give response_format or json_schema, not both")
        names = [t.function.name for t in self.tools or []]
        choice = self.tool_choice
        if isinstance(choice, NamedToolChoice) and choice.function.name not in names:
            raise ValueError(
                f"tool_choice names {choice.function.name!r}, which is not among the tools {names}"
            )
        if choice == "required" and not names:
            raise ValueError('tool_choice "required" needs tools')
        if self.forced_tools and any(v is not None for v in super().grammar.values()):
            raise ValueError(
                "a forced tool_choice writes JSON by its own grammar: no json_schema, regex or ebnf"
            )
        if self.forced_tools and self.response_format not in (None, ResponseFormat(type="text")):
            raise ValueError("a forced tool_choice writes JSON by its own grammar: no response_format")
        return self

    @property
    def tool_mode(self) -> str | dict:
        """OpenAI's tool_choice, null resolved: "none", "auto", "required" or {"type", "function"}."""
        if not self.tools:
            return "none"
        choice = self.tool_choice if self.tool_choice is not None else "auto"
        return choice if isinstance(choice, str) else choice.model_dump()

    @property
    def forced_tools(self) -> bool:
        return self.tool_mode == "required" or isinstance(self.tool_mode, dict)

    @property
    def max_new_tokens(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens

    @property
    def grammar(self) -> dict[str, str | None]:
        """response_format, or a forced tool_choice's calls, as a json_schema (`check_grammar`
        refuses response_format beside regex or ebnf)."""
        if self.forced_tools:
            tools = [t.model_dump() for t in self.tools]
            schema = forced_schema(tools, self.tool_mode, self.parallel_tool_calls is not False)
            return super().grammar | {"json_schema": json.dumps(schema)}
        schema = self.response_format.schema_text if self.response_format is not None else None
        return super().grammar | ({} if schema is None else {"json_schema": schema})

    @property
    def top_logprobs_num(self) -> int:
        return self.top_logprobs or 0


class GenerateRequestBody(_Disaggregated):
    """Native /generate (SGLang's shape): text or input_ids, one or a batch."""

    model_config = ConfigDict(
        **_Strict.model_config,
        # Exactly one of text and input_ids, as `_one_input` checks (null counts as absent).
        json_schema_extra={
            "oneOf": [
                {
                    "required": [given],
                    "properties": {given: {"not": {"type": "null"}}, other: {"type": "null"}},
                }
                for given, other in (("text", "input_ids"), ("input_ids", "text"))
            ]
        },
    )

    NEUTRAL: ClassVar[dict[str, tuple]] = {
        "logprob_start_len": (None, -1),
        "token_ids_logprob": (None,),
        "return_hidden_states": (False,),
        "return_bytes": (False,),
        "return_entropy": (False,),
        "background": (False,),
        "modalities": (None,),
        "image_data": (None,),
        "audio_data": (None,),
        "video_data": (None,),
        "input_embeds": (None,),
        "session_params": (None,),
        "lora_path": (None,),
        "lora_id": (None,),
        "custom_logit_processor": (None,),
        "bootstrap_pair_key": (None,),
        "priority": (None,),
        "extra_key": (None,),
        "conversation_id": (None,),
        "custom_labels": (None,),
    }

    text: Prompt | Batch[Prompt] | None = None
    input_ids: TokenIds | Batch[TokenIds] | None = None
    sampling_params: dict | Batch[dict] | None = None
    stream: bool = False
    return_logprob: bool = False
    top_logprobs_num: int = Field(0, ge=0, le=MAX_TOP_LOGPROBS)
    return_text_in_logprobs: bool = False
    data_parallel_rank: int | None = Field(None, ge=0, le=INT64_MAX)
    model: str | None = None
    # No effect: dpserve logs no request contents, keeps no per-request metrics log, names requests itself.
    log_metrics: bool = True
    no_logs: bool = False
    rid: str | list[str] | None = None

    @model_validator(mode="after")
    def _one_input(self):
        if (self.text is None) == (self.input_ids is None):
            raise ValueError("pass exactly one of text or input_ids")
        return self
