"""Scaling out: two dpserve instances (tp=1) behind SGLang's router (sglang-router, its Rust binary)
with the cache_aware policy. Requests go through it as SGLang's clients send them (the router adds
SGLang's fields), a prompt sharing a long prefix with an earlier one reaches the instance that
cached it, load and cache flushes reach every instance, and when one instance stops the router
keeps answering every request from the other."""

from __future__ import annotations

import json
import re

import httpx
import pytest
from openai import OpenAI
from transformers import AutoTokenizer

from dpserve.testing.server import RouterProcess, ServerProcess

NAME = "tiny"  # --served-model-name: the model id the router learns from /server_info
GREEDY = {"temperature": 0, "max_tokens": 8, "extra_body": {"ignore_eos": True}}
CHAT = [{"role": "user", "content": "What is the capital of France?"}]
PREFIX = "The quick brown fox jumps over the lazy dog while the cat sleeps in the warm sun. " * 4
# Failover: a router that opens a worker's circuit at its first failed connection and retries at once.
ROUTER_FLAGS = ("--policy", "cache_aware", "--cb-failure-threshold", "1", "--retry-initial-backoff-ms", "10")
http = httpx.Client(timeout=120)  # two busy cores: a request may wait seconds


def served(server: ServerProcess) -> int:
    """Sequences this instance has taken (its dpserve_requests_total)."""
    text = http.get(f"{server.url}/metrics").text
    return int(float(re.search(r"^dpserve_requests_total (\S+)$", text, re.M).group(1)))


@pytest.fixture(scope="module")
def cluster(model_dirs):
    model = model_dirs["deepseek_v2"]
    args = ("--model-path", model, "--tp", "1", "--dtype", "float32", "--served-model-name", NAME)
    with (
        ServerProcess(*args) as a,
        ServerProcess(*args) as b,
        RouterProcess([a.url, b.url], *ROUTER_FLAGS, "--log-level", "warn") as router,
    ):
        yield {"instances": [a, b], "router": router, "model": model}


def ask(base_url: str) -> dict:
    """A chat, a streamed completion and a native /generate, greedy; their texts."""
    client = OpenAI(base_url=f"{base_url}/v1", api_key="none", max_retries=0)
    chat = client.chat.completions.create(model=NAME, messages=CHAT, **GREEDY)
    stream = client.completions.create(model=NAME, prompt="Once upon a time", stream=True, **GREEDY)
    native = http.post(
        f"{base_url}/generate",
        json={"text": "The capital of Italy is", "sampling_params": {"max_new_tokens": 8, "temperature": 0}},
    )
    assert native.status_code == 200, native.text
    return {
        "chat": chat.choices[0].message.content,
        "completion": "".join(c.choices[0].text for c in stream if c.choices),
        "generate": native.json()["text"],
    }


def test_requests_through_the_router(cluster):
    a, b = cluster["instances"]
    router = cluster["router"]
    direct = ask(a.url)
    before = served(a) + served(b)
    assert ask(router.url) == direct
    assert served(a) + served(b) == before + 3
    assert [m["id"] for m in http.get(f"{router.url}/v1/models").json()["data"]] == [NAME]
    assert http.get(f"{router.url}/get_model_info").json()["served_model_name"] == NAME


def test_cache_aware_routing_load_and_flush(cluster):
    """The second prompt shares a long prefix with the first: it goes to the instance that served
    the first and finds the shared tokens cached there."""
    a, b = cluster["instances"]
    router = cluster["router"]
    tok = AutoTokenizer.from_pretrained(cluster["model"])
    first, second = PREFIX + "What is the first question?", PREFIX + "Here comes another one."
    ids = [tok.encode(first), tok.encode(second)]
    shared = next(i for i, (x, y) in enumerate(zip(*ids, strict=False)) if x != y)

    def generate(text: str) -> dict:
        body = {"text": text, "sampling_params": {"max_new_tokens": 2}}
        return http.post(f"{router.url}/generate", json=body).json()["meta_info"]

    counts = [served(a), served(b)]
    generate(first)
    cached = 0 if served(a) > counts[0] else 1  # the instance that served (and cached) the first
    counts[cached] += 1
    assert [served(a), served(b)] == counts
    assert generate(second)["cached_tokens"] == shared
    assert [served(a), served(b)][cached] == counts[cached] + 1
    cluster["cached"] = cluster["instances"][cached]
    # /get_load of both instances, as the router reads it: idle, so 0 tokens each (not -1: unread).
    loads = http.get(f"{router.url}/get_loads").json()["workers"]
    assert sorted((w["worker"], w["load"]) for w in loads) == sorted((s.url, 0) for s in (a, b))
    # The router's flush reaches both instances: the prefix is gone.
    flushed = http.post(f"{router.url}/flush_cache").json()
    assert flushed["workers_flushed"] == 2, json.dumps(flushed)
    assert generate(second)["cached_tokens"] == 0


def test_failover_when_an_instance_stops(cluster):
    """The instance holding the prefix (the one cache_aware prefers) stops: every request that
    follows, the shared-prefix one first, is answered by the other."""
    stopped = cluster.get("cached") or cluster["instances"][0]
    (survivor,) = [s for s in cluster["instances"] if s is not stopped]
    router = cluster["router"]
    expected = ask(survivor.url)
    assert stopped.stop() == 0
    before = served(survivor)
    body = {"text": PREFIX + "Here comes another one.", "sampling_params": {"max_new_tokens": 2}}
    assert http.post(f"{router.url}/generate", json=body).status_code == 200
    for _ in range(2):
        assert ask(router.url) == expected
    assert served(survivor) == before + 1 + 2 * 3
