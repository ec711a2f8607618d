"""Tool calls: the three call formats parsed whole and streamed (cut anywhere), and through a real
server with the openai client: forced calls (tool_choice "required", a named function) valid for
the declared parameters on a random-weight model, streamed deltas the client reassembles,
tool_choice "auto", multi-turn messages, and the errors."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest
from openai import BadRequestError, OpenAI
from pydantic import ValidationError

from dpserve.server.protocol import ChatCompletionRequest
from dpserve.server.tools import ToolCallStream, parse_calls
from dpserve.testing.server import ServerProcess

WEATHER = {
    "type": "object",
    "properties": {
        "city": {"enum": ["Paris", "Lyon", "Nice"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
    },
    "required": ["city", "days"],
}
TIME = {
    "type": "object",
    "properties": {"zone": {"type": "string", "pattern": "^UTC[+-][0-9]$"}},
    "required": ["zone"],
}
TOOLS = [
    {
        "type": "function",
        "function": {"name": "get_weather", "description": "forecast", "parameters": WEATHER},
    },
    {"type": "function", "function": {"name": "get_time", "parameters": TIME}},
]
PARAMS = {"get_weather": WEATHER, "get_time": TIME}
CHAT = [{"role": "user", "content": "What is the weather in Paris?"}]

FORMATS = {
    "qwen25": (
        'Let me look.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}\n'
        '</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": {"zone": "UTC+1"}}\n</tool_call>',
        "Let me look.",
    ),
    "llama3": (
        '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris", "days": 2}}; '
        '{"name": "get_time", "parameters": {"zone": "UTC+1"}}',
        "",
    ),
    "deepseekv3": (
        "Let me look.<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n```json\n"
        '{"city": "Paris", "days": 2}\n```<｜tool▁call▁end｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>'
        'get_time\n```json\n{"zone": "UTC+1"}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>',
        "Let me look.",
    ),
}
EXPECTED = [("get_weather", {"city": "Paris", "days": 2}), ("get_time", {"zone": "UTC+1"})]


@pytest.mark.parametrize("parser", FORMATS)
def test_each_format_is_parsed_whole_and_streamed(parser):
    text, content = FORMATS[parser]
    got_content, calls = parse_calls(text, parser)
    assert got_content == content
    assert [(c.name, json.loads(c.arguments)) for c in calls] == EXPECTED
    for cut in range(len(text) + 1):
        stream = ToolCallStream(parser, "auto")
        first, _ = stream.feed(text[:cut], final=False)
        rest, streamed = stream.feed(text[cut:], final=True)
        assert (first + rest).rstrip() == content, cut
        assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in streamed] == EXPECTED


@pytest.mark.parametrize("parser", FORMATS)
def test_text_without_a_well_formed_call_is_content(parser):
    for text in ["plain answer", FORMATS[parser][0][: len(FORMATS[parser][0]) // 2]]:
        assert parse_calls(text, parser) == (text, [])
        stream = ToolCallStream(parser, "auto")
        first, _ = stream.feed(text[:7], final=False)
        rest, calls = stream.feed(text[7:], final=True)
        assert first + rest == text and calls == []


@pytest.mark.parametrize(
    "fields,message",
    [
        ({"tool_choice": "required"}, 'tool_choice "required" needs tools'),
        (
            {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
            "tool_choice names 'nope', which is not among the tools ['get_weather', 'get_time']",
        ),
        ({"tools": TOOLS, "tool_choice": "required", "regex": "a"}, "no json_schema, regex or ebnf"),
    ],
)
def test_tool_fields_are_checked(fields, message):
    with pytest.raises(ValidationError, match=re.escape(message)):
        ChatCompletionRequest.model_validate({"model": "m", "messages": CHAT, **fields})


@pytest.fixture(scope="module")
def client(model_dirs):
    model = model_dirs["llama"]
    args = ["--model-path", model, "--tool-call-parser", "qwen25", "--dtype", "float32"]
    with ServerProcess(*args, "--grammar-max-whitespace", "0") as srv:
        yield OpenAI(base_url=f"{srv.url}/v1", api_key="none"), model


def _calls(message) -> list[tuple[str, dict]]:
    calls = [(c.function.name, json.loads(c.function.arguments)) for c in message.tool_calls]
    for name, args in calls:
        jsonschema.validate(args, PARAMS[name])
    return calls


def test_forced_calls_follow_the_declared_parameters(client):
    client, model = client
    for temperature in (0.0, 1.0):
        common = dict(
            model=model, messages=CHAT, tools=TOOLS, max_tokens=300, temperature=temperature, seed=1
        )
        for parallel in (True, False):
            reply = client.chat.completions.create(
                tool_choice="required", parallel_tool_calls=parallel, **common
            )
            (choice,) = reply.choices
            assert choice.finish_reason == "tool_calls" and choice.message.content is None
            calls = _calls(choice.message)
            assert calls and (parallel or len(calls) == 1)
            assert len({c.id for c in choice.message.tool_calls}) == len(calls)
        named = {"type": "function", "function": {"name": "get_time"}}
        reply = client.chat.completions.create(tool_choice=named, **common)
        assert [name for name, _ in _calls(reply.choices[0].message)] == ["get_time"]


def test_streamed_calls_reassemble_to_the_whole_reply(client):
    """ "required": the calls whole at the end; a named function: its arguments as they come."""
    client, model = client
    common = dict(
        model=model, messages=CHAT, tools=TOOLS, tool_choice="required", max_tokens=300, temperature=0
    )
    whole = _calls(client.chat.completions.create(**common).choices[0].message)
    calls, finish = {}, None
    for chunk in client.chat.completions.create(stream=True, **common):
        for delta in chunk.choices[0].delta.tool_calls or []:
            entry = calls.setdefault(delta.index, {"name": "", "arguments": ""})
            entry["name"] += delta.function.name or ""
            entry["arguments"] += delta.function.arguments or ""
        finish = chunk.choices[0].finish_reason or finish
    assert finish == "tool_calls"
    assert [(c["name"], json.loads(c["arguments"])) for _, c in sorted(calls.items())] == whole
    named = {**common, "tool_choice": {"type": "function", "function": {"name": "get_weather"}}}
    whole = _calls(client.chat.completions.create(**named).choices[0].message)
    fragments = [
        d.function.arguments
        for chunk in client.chat.completions.create(stream=True, **named)
        for d in chunk.choices[0].delta.tool_calls or []
    ]
    assert len(fragments) > 1 and [("get_weather", json.loads("".join(fragments)))] == whole  # as they came


def test_auto_returns_content_when_the_model_calls_nothing_and_multi_turn_is_accepted(client):
    client, model = client
    reply = client.chat.completions.create(
        model=model, messages=CHAT, tools=TOOLS, max_tokens=12, temperature=0
    )
    (choice,) = reply.choices
    assert choice.message.tool_calls is None and choice.message.content and choice.finish_reason == "length"
    turns = [
        *CHAT,
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris", "days": 1}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
    ]
    reply = client.chat.completions.create(
        model=model, messages=turns, tools=TOOLS, max_tokens=4, temperature=0
    )
    assert reply.choices[0].finish_reason == "length"
    with pytest.raises(BadRequestError, match="needs tools"):
        client.chat.completions.create(model=model, messages=CHAT, tool_choice="required", max_tokens=4)
