"""--reasoning-parser: reasoning_content apart from content, whole and streamed (token by token or
whole), and a grammar that applies from the end of the reasoning, through a real server on a tiny
Llama whose tokenizer has <think> and </think> as tokens."""

from __future__ import annotations

import json
import shutil

import jsonschema
import pytest
from openai import OpenAI

from dpserve.server.reasoning import ReasoningSplitter, split_reasoning
from dpserve.testing.server import ServerProcess

THINK, END_THINK = 299, 300  # token ids given to <think> and </think>
CHAT = [{"role": "user", "content": "Is the moon bright?"}]
SCHEMA = {
    "type": "object",
    "properties": {"bright": {"type": "boolean"}, "n": {"type": "integer", "minimum": 0, "maximum": 9}},
    "required": ["bright", "n"],
}


@pytest.mark.parametrize(
    "parser,text,expected",
    [
        ("deepseek-r1", "let me think</think>\n\nParis.", ("let me think", "Paris.")),
        ("deepseek-r1", "<think>hmm</think>ok", ("hmm", "ok")),
        ("deepseek-r1", "no end yet </thi", ("no end yet </thi", "")),
        ("qwen3", "<think>x</think>\n\nA", ("x", "A")),
        ("qwen3", "plain answer", ("", "plain answer")),
        ("qwen3", "<thi", ("", "<thi")),
    ],
)
def test_reasoning_is_split_the_same_however_the_text_streams(parser, text, expected):
    assert split_reasoning(text, parser) == expected
    for cut in range(len(text) + 1):  # two pieces, cut anywhere (a tag may be cut in two)
        for stream_reasoning in (True, False):
            splitter, got = ReasoningSplitter(parser, stream_reasoning), ["", ""]
            pieces = [splitter.feed(text[:cut]), splitter.feed(text[cut:], final=True)]
            for reasoning, content in pieces:
                got[0] += reasoning
                got[1] += content
            assert tuple(got) == expected, (cut, stream_reasoning)
            if not stream_reasoning and expected[0] and cut < len(text):
                assert sum(bool(r) for r, _ in pieces) == 1  # the reasoning came whole


@pytest.fixture(scope="module")
def think_model(model_dirs, tmp_path_factory) -> str:
    """The tiny Llama with two of its tokens renamed <think> and </think> (added tokens, not
    special: they stay in the text, as DeepSeek-R1's do)."""
    out = tmp_path_factory.mktemp("think") / "llama"
    shutil.copytree(model_dirs["llama"], out)
    path = out / "tokenizer.json"
    tok = json.loads(path.read_text())
    vocab = tok["model"]["vocab"]
    names = {i: t for t, i in vocab.items()}
    old = {names[THINK], names[END_THINK]}
    for i, text in ((THINK, "<think>"), (END_THINK, "</think>")):
        del vocab[names[i]]
        vocab[text] = i
        tok["added_tokens"].append(
            {"id": i, "content": text, "single_word": False, "lstrip": False, "rstrip": False}
            | {"normalized": False, "special": False}
        )

    def parts(merge) -> list[str]:
        return merge if isinstance(merge, list) else merge.split(" ")

    merges = tok["model"]["merges"]
    tok["model"]["merges"] = [m for m in merges if not ({"".join(parts(m)), *parts(m)} & old)]
    path.write_text(json.dumps(tok))
    return str(out)


@pytest.fixture(scope="module")
def client(think_model):
    with ServerProcess(
        "--model-path", think_model, "--reasoning-parser", "deepseek-r1", "--dtype", "float32"
    ) as srv:
        yield OpenAI(base_url=f"{srv.url}/v1", api_key="none")


def _chat(client, model, **kw):
    kw = {"temperature": 0, "max_tokens": 40, **kw}
    return client.chat.completions.create(model=model, messages=CHAT, **kw)


BIAS = {"logit_bias": {str(END_THINK): 2.0}}  # the random model then ends its reasoning at token 11


def test_reasoning_content_apart_from_content(client, think_model):
    raw = _chat(client, think_model, extra_body={"separate_reasoning": False}, **BIAS).choices[0].message
    assert "</think>" in raw.content and getattr(raw, "reasoning_content", None) is None
    split = _chat(client, think_model, **BIAS).choices[0].message
    assert (split.reasoning_content, split.content) == split_reasoning(raw.content, "deepseek-r1")
    assert split.reasoning_content and split.content  # both parts there: the test shows something
    for stream_reasoning in (True, False):
        chunks = _chat(
            client, think_model, stream=True, extra_body={"stream_reasoning": stream_reasoning}, **BIAS
        )
        deltas = [c.choices[0].delta for c in chunks if c.choices]
        reasoning = [d.reasoning_content for d in deltas if getattr(d, "reasoning_content", None)]
        assert "".join(reasoning) == split.reasoning_content
        assert "".join(d.content or "" for d in deltas) == split.content
        assert len(reasoning) > 1 if stream_reasoning else len(reasoning) == 1


def test_grammar_applies_from_the_end_of_the_reasoning(client, think_model):
    """The reasoning is free text; what follows </think> follows the schema."""
    fmt = {"type": "json_schema", "json_schema": {"name": "a", "schema": SCHEMA}}
    reply = _chat(client, think_model, response_format=fmt, max_tokens=120, **BIAS).choices[0]
    raw = _chat(
        client,
        think_model,
        response_format=fmt,
        max_tokens=120,
        extra_body={"separate_reasoning": False},
        **BIAS,
    ).choices[0]
    assert reply.finish_reason == "stop" and reply.message.reasoning_content
    jsonschema.validate(json.loads(reply.message.content), SCHEMA)
    with pytest.raises(json.JSONDecodeError):
        json.loads(raw.message.content)  # the reasoning before it is no JSON: it was not constrained
