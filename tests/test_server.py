"""The HTTP server as users run it: a real `launch_server` process (tiny DeepseekV2, tp=2, dp=2 with
DP attention), real sockets, the official `openai` client."""

from __future__ import annotations

import asyncio
import json
import re
import time
from typing import Literal

import httpx
import pytest
from conftest import metrics
from openai import APIError, AsyncOpenAI, OpenAI
from pydantic import BaseModel, Field
from transformers import AutoTokenizer

from dpserve.testing.server import ServerProcess

POOL = 256  # KV tokens per DP group: small enough to test the pool limit, large enough for 32 requests
CHAT = [{"role": "user", "content": "What is the capital of France?"}]
COMPLETION_PROMPT = "The quick brown fox"
GREEDY_EXTRA = {"ignore_eos": True}
NEW = 12
CONTINUED = [*CHAT, {"role": "assistant", "content": "The capital"}]  # continue_final_message
PENALTIES = {"frequency_penalty": -1.5, "presence_penalty": 0.5, "repetition_penalty": 0.7}
# What sglang-router 0.3.2 adds to every request it forwards (SGLang's defaults), seen on the wire.
ROUTER_DEFAULTS = {
    "/v1/chat/completions": {
        "continue_final_message": False,
        "ignore_eos": False,
        "logprobs": False,
        "no_stop_trim": False,
        "return_hidden_states": False,
        "separate_reasoning": True,
        "skip_special_tokens": True,
        "stream": False,
        "stream_reasoning": True,
    },
    "/v1/completions": {
        "echo": False,
        "ignore_eos": False,
        "no_stop_trim": False,
        "return_hidden_states": False,
        "skip_special_tokens": True,
        "stream": False,
    },
    "/generate": {
        "background": False,
        "log_metrics": True,
        "model": None,
        "no_logs": False,
        "return_bytes": False,
        "return_entropy": False,
        "return_hidden_states": False,
        "return_text_in_logprobs": False,
        "stream": False,
    },
}


@pytest.fixture(scope="module")
def model(model_dirs) -> str:
    return model_dirs["deepseek_v2"]


@pytest.fixture(scope="module")
def engine_outputs(engine_cache, model) -> dict:
    """What Engine.generate gives for the requests the server is asked below."""
    tok = AutoTokenizer.from_pretrained(model)
    chat_ids = tok.encode(
        tok.apply_chat_template(CHAT, add_generation_prompt=True, tokenize=False), add_special_tokens=False
    )
    continued_ids = tok.encode(
        tok.apply_chat_template(CONTINUED, continue_final_message=True, tokenize=False),
        add_special_tokens=False,
    )
    engine = engine_cache.get(model, tp_size=2, dp_size=2, enable_dp_attention=True, max_total_tokens=POOL)
    params = {"max_new_tokens": NEW, "temperature": 0.0, "ignore_eos": True}
    chat = engine.generate(input_ids=chat_ids, sampling_params=params)
    completion = engine.generate(prompt=COMPLETION_PROMPT, sampling_params=params)
    penalized = engine.generate(prompt=COMPLETION_PROMPT, sampling_params={**params, **PENALTIES})
    continued = engine.generate(input_ids=continued_ids, sampling_params=params)
    engine_cache.close()  # two cores: do not keep its ranks around while the server runs
    assert penalized["output_ids"] != completion["output_ids"]  # the penalties matter
    return {
        "chat": chat,
        "completion": completion,
        "chat_ids": chat_ids,
        "penalized": penalized,
        "continued": continued,
        "continued_ids": continued_ids,
    }


@pytest.fixture(scope="module")
def server(model, engine_outputs):
    with ServerProcess(
        "--model-path",
        model,
        "--tp",
        "2",
        "--dp",
        "2",
        "--enable-dp-attention",
        "--dtype",
        "float32",  # as the engine outputs compared against
        "--max-total-tokens",
        str(POOL),
        "--log-level",
        "info",
    ) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server) -> OpenAI:
    return OpenAI(base_url=f"{server.url}/v1", api_key="none")


def kv_used(server) -> float:
    m = metrics(server)
    return sum(v for k, v in m.items() if k.startswith("dpserve_kv_used_tokens"))


def test_chat_and_completion_match_engine(client, model, engine_outputs):
    common = {"model": model, "max_tokens": NEW, "temperature": 0, "extra_body": GREEDY_EXTRA}
    chat = client.chat.completions.create(messages=CHAT, **common)
    expected = engine_outputs["chat"]
    assert chat.choices[0].message.content == expected["text"]
    assert chat.choices[0].finish_reason == "length"
    assert chat.usage.prompt_tokens == len(engine_outputs["chat_ids"]) and chat.usage.completion_tokens == NEW

    assert chat.usage.prompt_tokens_details.cached_tokens == 0

    stream = client.chat.completions.create(
        messages=CHAT, stream=True, stream_options={"include_usage": True}, **common
    )
    chunks = list(stream)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == expected["text"]
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[-1].usage.completion_tokens == NEW and chunks[-1].choices == []
    # The same chat again: cache_aware routed it to the group that cached it; all but the last
    # prompt token came from the prefix cache.
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens == chat.usage.prompt_tokens - 1

    completion = client.completions.create(prompt=COMPLETION_PROMPT, **common)
    assert completion.choices[0].text == engine_outputs["completion"]["text"]
    streamed = client.completions.create(prompt=COMPLETION_PROMPT, stream=True, **common)
    assert "".join(c.choices[0].text for c in streamed) == engine_outputs["completion"]["text"]


def test_n_seed_stop_and_logprobs(client, model, engine_outputs):
    expected = engine_outputs["completion"]
    common = {"model": model, "prompt": COMPLETION_PROMPT, "max_tokens": NEW, "extra_body": GREEDY_EXTRA}
    # n choices with a seed: reproducible, and each choice has its own seed.
    first = client.completions.create(n=3, temperature=1.0, seed=7, **common)
    again = client.completions.create(n=3, temperature=1.0, seed=7, **common)
    assert [c.text for c in first.choices] == [c.text for c in again.choices]
    assert [c.index for c in first.choices] == [0, 1, 2] and len({c.text for c in first.choices}) > 1
    assert (
        first.usage.completion_tokens == 3 * NEW
        and first.usage.prompt_tokens == expected["meta_info"]["prompt_tokens"]
    )
    # A stop string cuts the text before it.
    text = expected["text"]
    stop = next(
        text[i : i + 2]
        for i in range(3, len(text) - 2)
        if text[i : i + 2].strip() and text[i : i + 2] not in text[:i]
    )
    cut = client.completions.create(temperature=0, stop=[stop], **common).choices[0]
    assert cut.text == text[: text.index(stop)] and cut.finish_reason == "stop"
    # Logprobs of the chosen tokens, in both APIs.
    with_lp = client.completions.create(temperature=0, logprobs=0, **common).choices[0]
    assert len(with_lp.logprobs.token_logprobs) == NEW and all(
        lp <= 0 for lp in with_lp.logprobs.token_logprobs
    )
    chat = client.chat.completions.create(
        model=model, messages=CHAT, max_tokens=NEW, temperature=0, logprobs=True, extra_body=GREEDY_EXTRA
    )
    content = chat.choices[0].logprobs.content
    assert len(content) == NEW and "".join(t.token for t in content) == chat.choices[0].message.content


def test_32_concurrent_streams(server, model):
    async def one(client: AsyncOpenAI, i: int) -> tuple[int, int, str]:
        stream = await client.completions.create(
            model=model,
            prompt=f"request {i}: " + "x " * (i % 7),
            max_tokens=4 + i % 9,
            temperature=0.7,
            seed=i,
            stream=True,
            stream_options={"include_usage": True},
            extra_body=GREEDY_EXTRA,
        )
        usage, text = None, ""
        async for chunk in stream:
            text += "".join(c.text for c in chunk.choices)
            usage = chunk.usage or usage
        return usage.prompt_tokens, usage.completion_tokens, text

    async def run() -> list:
        async with AsyncOpenAI(base_url=f"{server.url}/v1", api_key="none") as client:
            return await asyncio.gather(*(one(client, i) for i in range(32)))

    before = metrics(server)
    results = asyncio.run(run())
    tok = AutoTokenizer.from_pretrained(model)
    for i, (prompt_tokens, completion_tokens, _) in enumerate(results):
        assert prompt_tokens == len(tok.encode(f"request {i}: " + "x " * (i % 7)))
        assert completion_tokens == 4 + i % 9
    after = metrics(server)
    generated = [
        after[f'dpserve_generation_tokens_total{{dp_rank="{g}"}}']
        - before[f'dpserve_generation_tokens_total{{dp_rank="{g}"}}']
        for g in (0, 1)
    ]
    assert sum(generated) == sum(4 + i % 9 for i in range(32))
    assert min(generated) > 0  # both DP groups served
    assert kv_used(server) == 0


def test_native_generate_pins_and_stops(server, engine_outputs):
    expected = engine_outputs["completion"]
    body = {
        "text": COMPLETION_PROMPT,
        "sampling_params": {"max_new_tokens": NEW, "temperature": 0, "ignore_eos": True},
    }
    for g in (0, 1):
        out = httpx.post(
            f"{server.url}/generate", json={**body, "data_parallel_rank": g, "return_logprob": True}
        ).json()
        assert out["meta_info"]["dp_rank"] == g
        assert out["output_ids"] == expected["output_ids"] and out["text"] == expected["text"]
        assert len(out["meta_info"]["output_token_logprobs"]) == NEW
        assert 0 <= out["meta_info"]["cached_tokens"] < out["meta_info"]["prompt_tokens"]
    # A stop string taken from the middle of the known output: the text ends right before it.
    text = expected["text"]
    stop = next(
        text[i : i + 2]
        for i in range(3, len(text) - 2)
        if text[i : i + 2].strip() and text[i : i + 2] not in text[:i]
    )
    cut = text.index(stop)
    out = httpx.post(
        f"{server.url}/generate", json={**body, "sampling_params": {**body["sampling_params"], "stop": stop}}
    ).json()
    assert out["text"] == text[:cut]
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}
    streamed = httpx.post(f"{server.url}/generate", json={**body, "stream": True}).text
    events = [json.loads(e.removeprefix("data: ")) for e in streamed.strip().split("\n\n")[:-1]]
    assert events[-1]["text"] == text and streamed.endswith("data: [DONE]\n\n")
    # The prompt is cached by now: every event reports its cached tokens, not only the last one.
    cached = {e["meta_info"]["cached_tokens"] for e in events}
    assert cached == {events[-1]["meta_info"]["prompt_tokens"] - 1}, cached


class Reply(BaseModel):
    """A reply shape for `chat.completions.parse` (the openai client turns it into a strict JSON schema)."""

    answer: Literal["yes", "no"]
    score: int = Field(ge=0, le=9)
    tags: list[Literal["a", "b"]] = Field(max_length=2)
    note: str = Field(max_length=5)


def test_structured_output_through_the_openai_client(server, client, model):
    """A random-weight model answers in the shape asked for: response_format from a pydantic model
    (parsed by the client), json_object, SGLang's regex and ebnf on completions, chat streams and
    /generate; a bad schema is a 400 naming the fault, and the grammars show in /metrics."""
    parsed = client.chat.completions.parse(
        model=model, messages=CHAT, response_format=Reply, max_tokens=180, temperature=0
    )
    assert isinstance(parsed.choices[0].message.parsed, Reply), parsed
    assert parsed.choices[0].finish_reason == "stop"
    anything = client.chat.completions.create(
        model=model, messages=CHAT, response_format={"type": "json_object"}, max_tokens=8, temperature=0
    )
    assert anything.choices[0].message.content.startswith("{")
    completion = client.completions.create(
        model=model,
        prompt=COMPLETION_PROMPT,
        max_tokens=20,
        temperature=0,
        extra_body={"regex": "[0-9]{3}-[a-z]{2}"},
    )
    assert re.fullmatch("[0-9]{3}-[a-z]{2}", completion.choices[0].text)
    stopped = client.completions.create(
        model=model,
        prompt=COMPLETION_PROMPT,
        max_tokens=20,
        n=2,
        temperature=1.0,
        seed=3,
        stop=["-"],
        extra_body={"regex": "[0-9]{3}-[a-z]{2}"},
    )  # n > 1 (a matcher per choice) and a stop string inside the grammar's text
    assert [c.finish_reason for c in stopped.choices] == ["stop", "stop"]
    assert all(re.fullmatch("[0-9]{3}", c.text) for c in stopped.choices)
    stream = client.chat.completions.create(
        model=model,
        messages=CHAT,
        max_tokens=20,
        stream=True,
        extra_body={"ebnf": 'root ::= "Paris" | "Lyon"'},
    )
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) in ("Paris", "Lyon")
    body = {
        "text": COMPLETION_PROMPT,
        "sampling_params": {"json_schema": '{"enum": [1, 2]}', "temperature": 0},
    }
    assert json.loads(httpx.post(f"{server.url}/generate", json=body).json()["text"]) in (1, 2)
    bad = {"type": "json_schema", "json_schema": {"name": "r", "schema": {"type": "wat"}}}
    r = httpx.post(
        f"{server.url}/v1/chat/completions",
        json={"model": model, "messages": CHAT, "response_format": bad},
    )
    assert (
        r.status_code == 400 and 'invalid json_schema: Unsupported type "wat"' in r.json()["error"]["message"]
    )
    m = metrics(server)
    assert sum(v for k, v in m.items() if k.startswith("dpserve_grammar_compiles_total")) >= 4


def test_server_info_and_metrics(server):
    info = httpx.get(f"{server.url}/get_server_info").json()
    assert (info["tp_size"], info["dp_size"], info["attn_tp_size"]) == (2, 2, 1)
    assert [r["max_total_num_tokens"] for r in info["dp_ranks"]] == [POOL, POOL]
    assert len(info["worker_pids"]) == 2
    m = metrics(server)
    for g in (0, 1):
        label = f'{{dp_rank="{g}"}}'
        # Nothing runs: every slot is free or held by the prefix cache, all of it evictable.
        assert m[f"dpserve_kv_free_tokens{label}"] + m[f"dpserve_kv_cached_tokens{label}"] == POOL
        assert m[f"dpserve_kv_cached_tokens{label}"] == m[f"dpserve_kv_evictable_tokens{label}"] > 0
        assert m[f"dpserve_kv_used_tokens{label}"] == 0 and m[f"dpserve_retractions_total{label}"] == 0
        assert f"dpserve_steps_eager_total{label}" in m and f"dpserve_num_queue_reqs{label}" in m
    assert m["dpserve_time_to_first_token_seconds_count"] == m["dpserve_requests_total"] > 0
    assert m["dpserve_time_per_output_token_seconds_count"] > 0
    # Decode steps so far ran padded to a bucket (the CPU's stand-in for graphs), and are counted so.
    assert sum(m[f'dpserve_steps_padded_total{{dp_rank="{g}"}}'] for g in (0, 1)) > 0
    # The completion prompt is cached in both groups (test_native_generate_pins_and_stops): sent again
    # to each, all but its last token are hits, and the group's hit counter grows by exactly that.
    body = {"text": COMPLETION_PROMPT, "sampling_params": {"max_new_tokens": 1}}
    for g in (0, 1):
        label = f'{{dp_rank="{g}"}}'
        out = httpx.post(f"{server.url}/generate", json={**body, "data_parallel_rank": g}).json()
        assert out["meta_info"]["cached_tokens"] == out["meta_info"]["prompt_tokens"] - 1
        hits = metrics(server)[f"dpserve_prefix_cache_hit_tokens_total{label}"]
        assert hits - m[f"dpserve_prefix_cache_hit_tokens_total{label}"] == out["meta_info"]["cached_tokens"]
    assert httpx.get(f"{server.url}/health").status_code == 200
    assert httpx.get(f"{server.url}/v1/models").json()["data"][0]["max_model_len"] == 512


def test_sglang_router_defaults_are_accepted(server, model, engine_outputs):
    """Requests as sglang-router forwards them, SGLang's fields at their defaults: the same answers."""
    chat = httpx.post(
        f"{server.url}/v1/chat/completions",
        json={
            **ROUTER_DEFAULTS["/v1/chat/completions"],
            "model": model,
            "messages": CHAT,
            "max_completion_tokens": NEW,
            "temperature": 0,
            "ignore_eos": True,
        },
    )
    assert chat.status_code == 200, chat.text
    assert chat.json()["choices"][0]["message"]["content"] == engine_outputs["chat"]["text"]
    body = {
        "model": model,
        "prompt": COMPLETION_PROMPT,
        "max_tokens": NEW,
        "temperature": 0,
        "ignore_eos": True,
    }
    completion = httpx.post(
        f"{server.url}/v1/completions", json={**ROUTER_DEFAULTS["/v1/completions"], **body}
    )
    assert completion.status_code == 200, completion.text
    assert completion.json()["choices"][0]["text"] == engine_outputs["completion"]["text"]
    params = {"max_new_tokens": NEW, "temperature": 0, "ignore_eos": True}
    native = httpx.post(
        f"{server.url}/generate",
        json={**ROUTER_DEFAULTS["/generate"], "text": COMPLETION_PROMPT, "sampling_params": params},
    )
    assert native.status_code == 200, native.text
    assert native.json()["output_ids"] == engine_outputs["completion"]["output_ids"]


def test_penalties_min_tokens_and_special_tokens(client, model, engine_outputs):
    common = {"model": model, "prompt": COMPLETION_PROMPT, "max_tokens": NEW, "temperature": 0}
    penalized = client.completions.create(**common, extra_body={**GREEDY_EXTRA, **PENALTIES})
    assert penalized.choices[0].text == engine_outputs["penalized"]["text"]
    # The second token of the greedy output as a stop token: the request ends there, unless min_tokens.
    stop_id = engine_outputs["completion"]["output_ids"][1]
    stopped = client.completions.create(**common, extra_body={"stop_token_ids": [stop_id], **GREEDY_EXTRA})
    assert (stopped.usage.completion_tokens, stopped.choices[0].finish_reason) == (2, "stop")
    held = client.completions.create(
        **common, extra_body={"stop_token_ids": [stop_id], "min_tokens": NEW, **GREEDY_EXTRA}
    )
    assert (held.usage.completion_tokens, held.choices[0].finish_reason) == (NEW, "length")
    # logit_bias makes <|pad|> (id 2) every token: special, so skipped from the text unless asked.
    pads = {**common, "max_tokens": 3, "logit_bias": {"2": 100}}
    assert client.completions.create(**pads).choices[0].text == ""
    shown = client.completions.create(**pads, extra_body={"skip_special_tokens": False})
    assert shown.choices[0].text == "<|pad|>" * 3 and shown.usage.completion_tokens == 3
    spaced = client.completions.create(
        **pads, extra_body={"skip_special_tokens": False, "spaces_between_special_tokens": False}
    )
    assert spaced.choices[0].text == "<|pad|>" * 3  # fast tokenizers never add spaces anyway
    # no_stop_trim keeps the matched stop string at the end of the text.
    text = engine_outputs["completion"]["text"]
    stop = next(
        text[i : i + 2]
        for i in range(3, len(text) - 2)
        if text[i : i + 2].strip() and text[i : i + 2] not in text[:i]
    )
    kept = client.completions.create(**common, stop=[stop], extra_body={"no_stop_trim": True, **GREEDY_EXTRA})
    assert kept.choices[0].text == text[: text.index(stop) + len(stop)]


def test_echo_and_top_logprobs(server, client, model, engine_outputs):
    expected = engine_outputs["completion"]["text"]
    common = {"model": model, "prompt": COMPLETION_PROMPT, "max_tokens": NEW, "temperature": 0}
    echoed = client.completions.create(**common, echo=True, n=2, extra_body=GREEDY_EXTRA)
    assert [c.text for c in echoed.choices] == [COMPLETION_PROMPT + expected] * 2
    streamed = client.completions.create(**common, echo=True, stream=True, extra_body=GREEDY_EXTRA)
    assert "".join(c.choices[0].text for c in streamed) == COMPLETION_PROMPT + expected
    # Greedy without penalties: the chosen token is the top alternative, with the same logprob.
    top = client.completions.create(**common, logprobs=3, extra_body=GREEDY_EXTRA).choices[0].logprobs
    assert len(top.top_logprobs) == NEW and all(1 <= len(t) <= 3 for t in top.top_logprobs)
    for token, lp, alternatives in zip(top.tokens, top.token_logprobs, top.top_logprobs, strict=True):
        assert max(alternatives.values()) == lp and alternatives[token] == lp
    chat = client.chat.completions.create(
        model=model,
        messages=CHAT,
        max_tokens=NEW,
        temperature=0,
        logprobs=True,
        top_logprobs=2,
        extra_body=GREEDY_EXTRA,
    )
    for entry in chat.choices[0].logprobs.content:
        assert len(entry.top_logprobs) == 2 and entry.top_logprobs[0].token == entry.token
        assert entry.top_logprobs[0].logprob == entry.logprob >= entry.top_logprobs[1].logprob
    # /generate: SGLang's [logprob, token id, text] entries.
    params = {"max_new_tokens": 4, "temperature": 0, "ignore_eos": True}
    body = {
        "text": COMPLETION_PROMPT,
        "sampling_params": params,
        "return_logprob": True,
        "top_logprobs_num": 2,
    }
    plain = httpx.post(f"{server.url}/generate", json=body).json()
    named = httpx.post(f"{server.url}/generate", json={**body, "return_text_in_logprobs": True}).json()
    tok = AutoTokenizer.from_pretrained(model)
    ids = engine_outputs["completion"]["output_ids"][:4]
    assert [e[1:] for e in plain["meta_info"]["output_token_logprobs"]] == [[t, None] for t in ids]
    assert [e[1:] for e in named["meta_info"]["output_token_logprobs"]] == [[t, tok.decode([t])] for t in ids]
    for entry, alternatives in zip(
        named["meta_info"]["output_token_logprobs"], named["meta_info"]["output_top_logprobs"], strict=True
    ):
        assert len(alternatives) == 2 and alternatives[0] == entry


def test_continue_final_message(client, model, engine_outputs):
    messages = [{"role": m["role"], "content": m["content"]} for m in CONTINUED]
    reply = client.chat.completions.create(
        model=model,
        messages=messages,
        max_tokens=NEW,
        temperature=0,
        extra_body={"continue_final_message": True, **GREEDY_EXTRA},
    )
    assert reply.usage.prompt_tokens == len(engine_outputs["continued_ids"])
    assert reply.choices[0].message.content == engine_outputs["continued"]["text"]


def test_load_model_info_and_flush_cache(server, model):
    """What sglang-router reads from a worker: its load per DP group, its model, and a cache flush."""
    assert httpx.get(f"{server.url}/get_load").json() == [
        {"dp_rank": g, "num_reqs": 0, "num_waiting_reqs": 0, "num_tokens": 0} for g in (0, 1)
    ]
    info = httpx.get(f"{server.url}/server_info").json()
    assert (info["served_model_name"], info["model_path"], info["dp_size"]) == (model, model, 2)
    assert (
        httpx.get(f"{server.url}/model_info").json()
        == httpx.get(f"{server.url}/get_model_info").json()
        == {
            "model_path": model,
            "tokenizer_path": model,
            "served_model_name": model,
            "is_generation": True,
            "model_type": "deepseek_v2",
            "architectures": ["DeepseekV2ForCausalLM"],
            "max_context_length": 512,
        }
    )
    body = {"text": "flush me " * 10, "sampling_params": {"max_new_tokens": 1}}
    first = httpx.post(f"{server.url}/generate", json=body).json()["meta_info"]
    assert httpx.post(f"{server.url}/generate", json=body).json()["meta_info"]["cached_tokens"] == (
        first["prompt_tokens"] - 1
    )
    assert httpx.post(f"{server.url}/flush_cache").status_code == 200
    assert httpx.post(f"{server.url}/generate", json=body).json()["meta_info"]["cached_tokens"] == 0


LONG_CONTEXT = "x " * 600  # the tiny models have a 512-token context
BAD_REQUESTS = [
    ("/v1/completions", b'{"model": "m", "prompt": ', 400, "not valid JSON"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": "many"}, 400, "max_tokens"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 0}, 400, "max_tokens: Input should be greater than 0"),
    (
        "/v1/chat/completions",
        {"messages": CHAT, "max_tokens": -3},
        400,
        "max_tokens: Input should be greater than 0",
    ),
    (
        "/v1/chat/completions",
        {"messages": CHAT, "temprature": 0},
        400,
        "temprature: Extra inputs are not permitted",
    ),
    (
        "/v1/chat/completions",
        {"messages": CHAT, "return_hidden_states": True},
        400,
        "return_hidden_states=true is not supported (only false)",
    ),
    (
        "/v1/chat/completions",
        {"messages": CHAT, "tools": [{"type": "function", "function": {"name": "f"}}]},
        400,
        'tools with tool_choice "auto" need the server started with --tool-call-parser',
    ),
    (
        "/v1/chat/completions",
        {"messages": CHAT, "top_logprobs": 2},
        400,
        "top_logprobs requires logprobs=true",
    ),
    (
        "/v1/chat/completions",
        {"messages": CHAT, "continue_final_message": True},
        400,
        "continue_final_message requires the last message to be the assistant's",
    ),
    ("/v1/completions", {"prompt": "hi", "best_of": 3}, 400, "best_of=3 is not supported (only null or 1)"),
    (
        "/v1/completions",
        {"prompt": "hi", "echo": True, "logprobs": 1},
        400,
        "echo with logprobs is not supported",
    ),
    (
        "/v1/completions",
        {"prompt": "hi", "frequency_penalty": 3},
        400,
        "frequency_penalty: Input should be less than or equal to 2",
    ),
    (
        "/v1/completions",
        {"prompt": "hi", "logit_bias": {"999": 1}},
        400,
        "logit_bias token id 999 is outside the vocabulary [0, 301)",
    ),
    (
        "/v1/completions",
        {"prompt": "hi", "max_tokens": 4, "min_tokens": 5},
        400,
        "min_tokens=5 is more than the 4 new tokens allowed",
    ),
    ("/v1/chat/completions", {"messages": CHAT, "temperature": 3}, 400, "temperature"),
    ("/v1/chat/completions", {"messages": []}, 400, "messages"),
    ("/v1/completions", {"prompt": LONG_CONTEXT}, 400, "the model's context length is 512"),
    (
        "/v1/completions",
        {"prompt": "x " * 100, "max_tokens": 100_000},  # over the context: rejected, never capped
        400,
        "the prompt has 200 tokens and max_new_tokens is 100000: 100200 tokens, but the model's context length is 512",
    ),
    (
        "/v1/completions",
        {"prompt": "x " * 100, "max_tokens": 200},
        400,
        f"its DP group's KV pool holds only {POOL} tokens",
    ),
    ("/v1/completions", {"prompt": [5, 99999]}, 400, "token id 99999 is outside the vocabulary"),
    ("/v1/completions", {"prompt": "hi", "model": "gpt-4"}, 404, "The model `gpt-4` does not exist"),
    (
        "/v1/completions",
        {"prompt": "hi", "data_parallel_rank": 5},
        400,
        "data_parallel_rank=5 is outside [0, 2)",
    ),
    (
        "/generate",
        {"text": "hi", "sampling_params": {"max_new_tokens": 0}},
        400,
        "max_new_tokens must be an int >= 1",
    ),
    (
        "/generate",
        {"text": "hi", "sampling_params": {"temprature": 0}},
        400,
        "unknown sampling parameter(s): temprature",
    ),
    ("/generate", {"text": "hi", "input_ids": [1]}, 400, "exactly one of text or input_ids"),
    ("/generate", {"text": "hi", "model": "gpt-4"}, 404, "The model `gpt-4` does not exist"),
    (
        "/generate",
        {"text": "hi", "return_hidden_states": True},
        400,
        "return_hidden_states=true is not supported (only false)",
    ),
    (
        "/generate",
        {"text": "hi", "logprob_start_len": 0},
        400,
        "logprob_start_len=0 is not supported (only null or -1)",
    ),
    (
        "/generate",
        {"text": "hi", "sampling_params": {"regex": "a("}},
        400,
        "invalid regex: Regex parsing error at position 3: The parenthesis is not closed.",
    ),
    (
        "/generate",
        {"text": "hi", "sampling_params": {"repetition_penalty": 0}},
        400,
        "repetition_penalty must be in (0, 2]",
    ),
]


# Hostile values: each once crashed a rank (top_k past int64) or sampled NaN, or was answered in
# another shape; all are 400s naming the field now, and the server keeps serving.
BAD_REQUESTS += [
    *[
        (
            path,
            {**body, "top_k": 2**63},
            400,
            "top_k: Input should be less than or equal to 9223372036854775807",
        )
        for path, body in (
            ("/v1/completions", {"prompt": "hi"}),
            ("/v1/chat/completions", {"messages": CHAT}),
        )
    ],
    (
        "/generate",
        {"text": "hi", "sampling_params": {"top_k": 2**63}},
        400,
        "top_k must be -1 or an int >= 1",
    ),
    (
        "/v1/completions",
        b'{"model": "m", "prompt": "hi", "temperature": NaN}',
        400,
        "temperature: Input should be a finite number",
    ),
    (
        "/generate",
        b'{"text": "hi", "sampling_params": {"top_p": Infinity}}',
        400,
        "top_p must be in (0, 1]",
    ),
    ("/v1/completions", {"prompt": "hi", "stop": ""}, 400, "stop: String should have at least 1 character"),
    ("/generate", {"text": "hi", "sampling_params": {"stop": [""]}}, 400, "stop must be a string or a list"),
    ("/generate", {"input_ids": []}, 400, "input_ids: List should have at least 1 item"),
    ("/generate", {"text": []}, 400, "text: List should have at least 1 item"),
    ("/v1/completions", {"prompt": []}, 400, "prompt: List should have at least 1 item"),
    (
        "/v1/completions",
        {"prompt": "hi", "logit_bias": {str(t): 1 for t in range(1025)}},
        400,
        "logit_bias: Dictionary should have at most 1024 items",
    ),
    (
        "/v1/completions",  # min_tokens forbids every token: the request fails, nothing is sampled
        {"prompt": "hi", "max_tokens": 4, "min_tokens": 2, "stop_token_ids": list(range(301))},
        400,
        "the request was aborted: no token can be sampled",
    ),
]


@pytest.mark.parametrize("path,body,status,message", BAD_REQUESTS)
def test_bad_input_gets_4xx_and_server_keeps_serving(server, client, model, path, body, status, message):
    if isinstance(body, dict) and path.startswith("/v1"):
        body = {"model": model, **body}
    kwargs = (
        {"content": body, "headers": {"content-type": "application/json"}}
        if isinstance(body, bytes)
        else {"json": body}
    )
    r = httpx.post(f"{server.url}{path}", **kwargs)
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert message in error["message"] and error["code"] == status and error["type"]
    ok = client.completions.create(model=model, prompt="hi", max_tokens=2)
    assert ok.usage.completion_tokens >= 1


ERROR_SHAPES = [
    ("POST", "/v1/completions", b'{"prompt": "\xff"}', "application/json", 400, "it is not UTF-8"),
    ("POST", "/generate", b"[" * 100_000 + b"]" * 100_000, "application/json", 400, "nested too deeply"),
    ("POST", "/generate", b'{"text": "hi"}', "text/plain", 415, "Content-Type: application/json"),
    (
        "POST",
        "/v1/chat/completions",
        b"messages=hi",
        "application/x-www-form-urlencoded",
        415,
        "must be JSON",
    ),
    ("GET", "/no/such/path", None, None, 404, "Not Found"),
    ("DELETE", "/generate", None, None, 405, "Method Not Allowed"),
]


@pytest.mark.parametrize("method,path,body,content_type,status,message", ERROR_SHAPES)
def test_every_error_has_one_shape(server, method, path, body, content_type, status, message):
    """Errors FastAPI or the admission layer raise come in the API's one shape too."""
    headers = {"content-type": content_type} if content_type else {}
    r = httpx.request(method, f"{server.url}{path}", content=body, headers=headers)
    assert r.status_code == status and r.headers["content-type"] == "application/json", r.text
    assert set(r.json()) == {"error"} and set(r.json()["error"]) == {"message", "type", "code"}
    assert message in r.json()["error"]["message"] and r.json()["error"]["code"] == status


def test_openapi_document_says_what_the_server_does(server, model):
    doc = httpx.get(f"{server.url}/openapi.json").json()
    assert '"422"' not in json.dumps(doc)
    for path in ("/generate", "/v1/completions", "/v1/chat/completions"):
        responses = doc["paths"][path]["post"]["responses"]
        assert set(responses) == {"200", "400", "401", "404", "413", "415", "503"}
        assert set(responses["200"]["content"]) == {"application/json", "text/event-stream"}
        assert responses["400"]["content"]["application/json"]["schema"]["$ref"].endswith("/ErrorResponse")
    for path in ("/health", "/metrics"):
        assert set(doc["paths"][path]["get"]["responses"]["200"]["content"]) == {"text/plain"}
    schemas = doc["components"]["schemas"]
    completion = schemas["CompletionRequest"]["properties"]
    assert completion["top_k"] == {
        "type": "integer",
        "maximum": 2**63 - 1,
        "minimum": -1,
        "title": "Top K",
        "default": -1,
    }
    assert completion["model"]["enum"] == [model]
    assert completion["temperature"]["anyOf"] == [
        {"type": "number", "maximum": 2.0, "minimum": 0.0},
        {"type": "null"},  # null: the default, 1
    ]
    token_ids = schemas["GenerateRequestBody"]["properties"]["input_ids"]["anyOf"][0]
    assert (
        token_ids["items"] == {"type": "integer", "minimum": 0, "maximum": 300} and token_ids["minItems"] == 1
    )
    assert schemas["ChatCompletionRequest"]["properties"]["logit_bias"]["anyOf"][0]["maxProperties"] == 1024


def test_null_max_tokens_means_openai_default(server, model):
    """null is OpenAI's default where OpenAI says so: max_tokens 16 for completions (not "up to
    the context"), one choice, no stream, no echo."""
    nulls = dict.fromkeys(
        ("max_tokens", "n", "stream", "top_p", "echo", "frequency_penalty", "presence_penalty")
    )
    body = {"model": model, "prompt": "hi", "ignore_eos": True, "temperature": 0, **nulls}
    r = httpx.post(f"{server.url}/v1/completions", json=body)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 16
    assert len(r.json()["choices"]) == 1 and not r.json()["choices"][0]["text"].startswith("hi")


def test_a_streamed_request_left_nothing_to_sample_learns_why(server, model):
    """Its 200 went out with the stream: the last event is the error (400, naming the cause), then
    [DONE]; the openai client raises it."""
    body = {"model": model, "prompt": "hi", "max_tokens": 4, "min_tokens": 2, "stream": True}
    body["stop_token_ids"] = list(range(301))  # min_tokens forbids every token of the vocabulary
    with httpx.stream("POST", f"{server.url}/v1/completions", json=body) as r:
        events = [line.removeprefix("data: ") for line in r.iter_lines() if line.startswith("data: ")]
    assert r.status_code == 200 and events[-1] == "[DONE]"
    error = json.loads(events[-2])["error"]
    assert error["code"] == 400 and "no token can be sampled" in error["message"]
    assert json.loads(events[-3])["choices"][0]["finish_reason"] == "abort"
    client = OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0)
    stream = client.completions.create(
        model=model,
        prompt="hi",
        max_tokens=4,
        stream=True,
        extra_body={k: body[k] for k in ("min_tokens", "stop_token_ids")},
    )
    with pytest.raises(APIError, match="no token can be sampled"):
        list(stream)
    assert kv_used(server) == 0


def test_disconnect_mid_stream_frees_kv(server, model):
    assert kv_used(server) == 0
    body = {"model": model, "prompt": "a long story", "max_tokens": 200, "stream": True, "ignore_eos": True}
    with httpx.stream("POST", f"{server.url}/v1/completions", json=body) as r:
        lines = r.iter_lines()
        received = [next(lines) for _ in range(6)]  # a few events: the request is decoding
        assert all(not line or line.startswith("data: ") for line in received)
        assert kv_used(server) > 0
    deadline = time.monotonic() + 30
    while kv_used(server) > 0:  # the abort reaches the scheduler, which frees the slots
        assert time.monotonic() < deadline, "KV not freed after the client disconnected"
    assert metrics(server)["dpserve_aborted_requests_total"] >= 1


def test_sigterm_aborts_streams_and_exits_zero(server, model):
    body = {"model": model, "prompt": "never ending", "max_tokens": 200, "stream": True, "ignore_eos": True}
    with httpx.stream("POST", f"{server.url}/v1/completions", json=body) as r:
        lines = r.iter_lines()
        next(lines)
        server.proc.send_signal(15)
        events = [json.loads(line.removeprefix("data: ")) for line in lines if line.startswith("data: {")]
    assert events[-2]["choices"][0]["finish_reason"] == "abort"
    assert events[-1] == {  # the client learns why, after the 200 it got with the first event
        "error": {
            "message": "the request was aborted: the server is shutting down",
            "type": "service_unavailable",
            "code": 503,
        }
    }
    assert server.wait(60) == 0
    assert "shut down cleanly" in server.output
