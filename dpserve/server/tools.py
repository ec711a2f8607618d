"""Tool calls in chat completions (OpenAI's `tools`, `tool_choice`, `parallel_tool_calls`).

`tool_choice: "required"` and a named function are constrained by grammar: the reply is JSON that
`forced_schema` describes (the named function's arguments, or an array of {name, parameters} of
the declared functions), so the calls are always valid for the declared parameters. `"auto"`
parses what the model wrote in its family's format (`--tool-call-parser`, SGLang's names):

- qwen25: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, one block per call;
- llama3: `<|python_tag|>` (or nothing) then `{"name": ..., "parameters": {...}}`, calls joined by `;`;
- deepseekv3: `<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME` then a
  ```json block of the arguments and `<｜tool▁call▁end｜>`, per call, then `<｜tool▁calls▁end｜>`.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field

from dpserve.server.reasoning import held_back

DEEPSEEK_CALL = re.compile(
    r"<｜tool▁call▁begin｜>(?P<type>.*?)<｜tool▁sep｜>(?P<name>.*?)\n```json\n(?P<args>.*?)\n```<｜tool▁call▁end｜>",
    re.DOTALL,
)
QWEN_CALL = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)
STARTS = {"deepseekv3": "<｜tool▁calls▁begin｜>", "llama3": "<|python_tag|>", "qwen25": "<tool_call>"}


def call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


@dataclass
class ToolCall:
    name: str
    arguments: str  # JSON text, as OpenAI sends it
    id: str = field(default_factory=call_id)

    def as_dict(self, index: int | None = None) -> dict:
        out = {
            "id": self.id,
            "type": "function",
            "function": {"name": self.name, "arguments": self.arguments},
        }
        return out if index is None else {"index": index, **out}


def forced_schema(tools: list[dict], choice: str | dict, parallel: bool) -> dict:
    """The JSON schema a reply follows under `tool_choice` "required" or a named function (`tools`:
    OpenAI's function declarations as dicts)."""
    params = {t["function"]["name"]: t["function"].get("parameters") or {"type": "object"} for t in tools}
    if isinstance(choice, dict):
        return params[choice["function"]["name"]]
    call = [
        {
            "type": "object",
            "properties": {"name": {"const": name}, "parameters": schema},
            "required": ["name", "parameters"],
        }
        for name, schema in params.items()
    ]
    return {"type": "array", "items": {"anyOf": call}, "minItems": 1, **({} if parallel else {"maxItems": 1})}


def forced_calls(text: str) -> list[ToolCall]:
    """The calls of a reply written under `forced_schema` for tool_choice "required" (its grammar
    makes it valid JSON; a reply cut by max_tokens gives none)."""
    try:
        return [ToolCall(c["name"], json.dumps(c["parameters"])) for c in json.loads(text)]
    except json.JSONDecodeError:
        return []


def parse_calls(text: str, parser: str) -> tuple[str, list[ToolCall]]:
    """(content, calls) of a reply in `parser`'s format; a reply with no well-formed call is all
    content."""
    found = call_start(text, parser)
    if found is None:
        return text, []
    at, marker = found
    content, body = text[:at].rstrip(), text[at + marker :]
    try:
        if parser == "qwen25":
            found = [json.loads(m) for m in QWEN_CALL.findall(text[at:])]
            calls = [ToolCall(c["name"], json.dumps(c.get("arguments", {}))) for c in found]
        elif parser == "llama3":
            decoder, calls, rest = json.JSONDecoder(), [], body.strip()
            while rest:
                call, end = decoder.raw_decode(rest)
                calls.append(
                    ToolCall(call["name"], json.dumps(call.get("parameters", call.get("arguments", {}))))
                )
                rest = rest[end:].strip().removeprefix(";").strip()
        else:
            calls = [
                ToolCall(m["name"].strip(), json.dumps(json.loads(m["args"])))
                for m in DEEPSEEK_CALL.finditer(body)
            ]
    except (json.JSONDecodeError, KeyError, TypeError):
        return text, []
    return (content, calls) if calls else (text, [])


class ToolCallStream:
    """One reply's tool calls as OpenAI streams them (`tool_calls` deltas). Under a named function
    the reply is the call's arguments: they go out as they come, as argument fragments after a
    first delta with the call's id and name. Under "required" the calls come whole at the end.
    Under "auto" the content passes through until the format's first call starts (text that may
    be its start is held back), the rest is held and parsed at the end; text held for calls that
    do not parse is content after all."""

    def __init__(self, parser: str | None, choice: str | dict):
        self.parser, self.choice = parser, choice  # parser: None only when forced
        self.forced = choice == "required" or isinstance(choice, dict)
        self.text, self._sent = "", 0  # the whole reply, and how much of it went out as content
        self._calling = self.forced
        self.called = False  # a call went out
        self._id = call_id()  # the named function's call, streamed in pieces

    def feed(self, text: str, final: bool) -> tuple[str, list[dict]]:
        """(content, tool_calls deltas) to send now."""
        self.text += text
        if isinstance(self.choice, dict):
            if self.called:
                return "", [{"index": 0, "function": {"arguments": text}}] if text else []
            self.called = True
            call = ToolCall(self.choice["function"]["name"], text, self._id)
            return "", [call.as_dict(0)]
        out = ""
        if not self._calling:
            found = call_start(self.text, self.parser, self._sent)
            if found is None:
                hold = 0 if final else held_back(self.text[self._sent :], STARTS[self.parser])
                end = len(self.text) - hold
            else:
                self._calling, end = True, found[0]
            out, self._sent = self.text[self._sent : end], end
        if not (final and self._calling):
            return out, []
        calls = forced_calls(self.text) if self.forced else parse_calls(self.text, self.parser)[1]
        if not calls:
            out += self.text[self._sent :]
        self.called = bool(calls)
        return out, [c.as_dict(k) for k, c in enumerate(calls)]


def call_start(text: str, parser: str, after: int = 0) -> tuple[int, int] | None:
    """Where the first call starts in `text` (from `after`) in `parser`'s format, and its marker's
    length; llama3 may also write a bare JSON call as the whole reply (no marker)."""
    marker = STARTS[parser]
    at = text.find(marker, after)
    if at >= 0:
        return at, len(marker)
    if parser == "llama3" and not text[:after].strip() and text.lstrip().startswith("{"):
        return text.find("{"), 0
    return None
