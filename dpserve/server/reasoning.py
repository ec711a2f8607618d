"""--reasoning-parser: a chat reply's reasoning (between `<think>` and `</think>`) apart from its
content, as SGLang's parsers of the same names split it: `reasoning_content` beside `content` in
messages and stream deltas.

deepseek-r1: the chat template opens `<think>` itself, so the reply is reasoning from its first
token until `</think>` (a `<think>` the model writes anyway is dropped). qwen3: the reply reasons
only when it starts with `<think>` (thinking off, `enable_thinking: false`, it does not).
"""

from __future__ import annotations

START, END = "<think>", "</think>"


class ReasoningSplitter:
    """Splits one reply's text, as it streams, into reasoning and content. `feed` returns the new
    text of each; text that may be the start of a tag is held back until it is known."""

    def __init__(self, parser: str, stream_reasoning: bool = True):
        self.parser, self.forced = parser, parser == "deepseek-r1"
        self.stream_reasoning = stream_reasoning  # False: the reasoning comes whole, once it ends
        self._held = ""  # reasoning not given out yet (stream_reasoning False)
        self._buffer = ""
        self._state = "start"  # start (tag not seen yet), reasoning, content
        self._lead = False  # the content right after </think>: its leading whitespace is dropped

    @property
    def reasoning(self) -> bool:
        """Whether the reply is still in its reasoning (or may be: a tag is not decided yet)."""
        return self._state != "content"

    def feed(self, text: str, final: bool = False) -> tuple[str, str]:
        """(reasoning, content) added by `text`; `final`: nothing more comes, flush what is held."""
        reasoning, content = self._split(text, final)
        if self.stream_reasoning:
            return reasoning, content
        self._held += reasoning
        if self.reasoning and not final:
            return "", content
        reasoning, self._held = self._held, ""
        return reasoning, content

    def _split(self, text: str, final: bool) -> tuple[str, str]:
        self._buffer += text
        reasoning, content = "", ""
        if self._state == "start":
            stripped = self._buffer.lstrip()
            if stripped.startswith(START):
                self._buffer, self._state = stripped[len(START) :], "reasoning"
            elif START.startswith(stripped) and stripped and not final:
                return "", ""  # may be the tag: wait
            elif not stripped and not final:
                return "", ""
            else:
                self._state = "reasoning" if self.forced else "content"
        if self._state == "reasoning":
            end = self._buffer.find(END)
            if end < 0:
                keep = 0 if final else held_back(self._buffer, END)
                cut = len(self._buffer) - keep
                reasoning, self._buffer = self._buffer[:cut], self._buffer[cut:]
                return reasoning, ""
            reasoning, self._buffer = self._buffer[:end], self._buffer[end + len(END) :]
            self._state, self._lead = "content", True
        content, self._buffer = self._buffer, ""
        if self._lead:
            content = content.lstrip()
            self._lead = not content
        return reasoning, content


def held_back(text: str, tag: str) -> int:
    """Length of the longest end of `text` that begins `tag`: what a stream holds back until it
    knows whether the tag follows."""
    return next((n for n in range(min(len(text), len(tag) - 1), 0, -1) if tag.startswith(text[-n:])), 0)


def split_reasoning(text: str, parser: str) -> tuple[str, str]:
    """A whole reply's (reasoning, content)."""
    return ReasoningSplitter(parser).feed(text, final=True)
