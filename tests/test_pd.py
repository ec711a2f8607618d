"""Prefill-decode disaggregation behind SGLang's router in PD mode (`sglang-router
--pd-disaggregation`): a prefill instance (tp 2) and a decode instance of another layout (tp 2, dp 2,
DP attention), the KV moved by Mooncake's transfer engine over TCP. Outputs equal transformers'
greedy ones token for token on every endpoint, and every failure is an error that names its cause
and leaves no KV behind."""

from __future__ import annotations

import re
import threading
import time

import httpx
import pytest
import zmq
from conftest import GREEDY, NEW_TOKENS, assert_matches_reference, http_outputs
from openai import OpenAI
from transformers import AutoTokenizer

from dpserve.bench import kv_transfer
from dpserve.disagg.transfer import PoolDescriptor
from dpserve.engine.worker_pool import free_port
from dpserve.testing.reference import hf_greedy_reference
from dpserve.testing.server import RouterProcess, ServerProcess
from dpserve.testing.trained_mtp import synthetic_sequences, trained_mtp_model

NAME = "tiny"
TIMEOUT_S = 3  # --disaggregation-timeout of both instances
CHAT = [{"role": "user", "content": "What is the capital of France?"}]
http = httpx.Client(timeout=120)


def metric(server: ServerProcess, name: str) -> float:
    """A metric summed over the instance's DP groups."""
    text = http.get(f"{server.url}/metrics").text
    return sum(float(v) for v in re.findall(rf"^dpserve_{name}(?:{{[^}}]*}})? (\S+)$", text, re.M))


def kv_settles(server: ServerProcess, within_s: float) -> bool:
    """Whether the instance's KV in use drops to 0 within `within_s` seconds."""
    deadline = time.monotonic() + within_s
    while metric(server, "kv_used_tokens") != 0:
        if time.monotonic() > deadline:
            return False
        time.sleep(0.1)
    return True


@pytest.fixture(scope="module")
def pd(model_dirs):
    model = model_dirs["deepseek_v2"]
    common = ("--model-path", model, "--dtype", "float32", "--served-model-name", NAME)
    common += ("--disaggregation-timeout", str(TIMEOUT_S))
    port = free_port()
    prefill_args = ("--tp", "2", "--disaggregation-mode", "prefill")
    prefill_args += ("--disaggregation-bootstrap-port", str(port))
    decode_args = ("--tp", "2", "--dp", "2", "--enable-dp-attention", "--disaggregation-mode", "decode")
    with (
        ServerProcess(*common, *prefill_args) as prefill,
        ServerProcess(*common, *decode_args) as decode,
        RouterProcess([decode.url], "--log-level", "warn", prefill=[(prefill.url, port)]) as router,
    ):
        yield {"prefill": prefill, "decode": decode, "router": router, "port": port, "model": model}


def generate(url: str, prompts, **body) -> httpx.Response:
    sampling = {"max_new_tokens": NEW_TOKENS, "temperature": 0.0, "ignore_eos": True}
    return http.post(f"{url}/generate", json={"input_ids": prompts, "sampling_params": sampling, **body})


def both_sides(prefill: ServerProcess, decode: ServerProcess, prompts, **body) -> dict[str, httpx.Response]:
    """The same /generate sent to both sides at once, as the PD router sends it; both must answer 200."""
    answers: dict[str, httpx.Response] = {}

    def send(server: ServerProcess) -> None:
        answers[server.url] = generate(server.url, prompts, **body)

    sides = [threading.Thread(target=send, args=(s,)) for s in (prefill, decode)]
    for t in sides:
        t.start()
    for t in sides:
        t.join()
    for r in answers.values():
        assert r.status_code == 200, r.text
    return answers


def test_outputs_through_the_pd_router(pd, prompts, references):
    router, prefill, decode = pd["router"], pd["prefill"], pd["decode"]
    # A batch: each prompt its own room; the decode instance spreads them over its two groups.
    r = generate(router.url, prompts, return_logprob=True)
    assert r.status_code == 200, r.text
    assert_matches_reference(http_outputs(r.json()), references["deepseek_v2"])
    assert {o["meta_info"]["dp_rank"] for o in r.json()} == {0, 1}
    # Chat, streamed and not, and completions: what /generate gives for the same tokens.
    tok = AutoTokenizer.from_pretrained(pd["model"])
    text = tok.apply_chat_template(CHAT, add_generation_prompt=True, tokenize=False)
    chat_ids = tok.encode(text, add_special_tokens=False)  # as the server renders a chat
    client = OpenAI(base_url=f"{router.url}/v1", api_key="none", max_retries=0)
    greedy = {"temperature": 0, "max_tokens": NEW_TOKENS, "extra_body": {"ignore_eos": True}}
    chat = client.chat.completions.create(model=NAME, messages=CHAT, **greedy)
    streamed = client.chat.completions.create(model=NAME, messages=CHAT, stream=True, **greedy)
    direct = generate(router.url, chat_ids).json()
    assert chat.choices[0].message.content == direct["text"]
    assert "".join(c.choices[0].delta.content or "" for c in streamed if c.choices) == direct["text"]
    completion = client.completions.create(model=NAME, prompt="Once upon a time", **greedy)
    sampling = {"max_new_tokens": NEW_TOKENS, "temperature": 0.0, "ignore_eos": True}
    body = {"text": "Once upon a time", "sampling_params": sampling}
    assert completion.choices[0].text == http.post(f"{router.url}/generate", json=body).json()["text"]
    # The prefill side's prefix cache: the same prompt again is found there but for its last token.
    hits = metric(prefill, "prefix_cache_hit_tokens_total")
    assert generate(router.url, prompts[1]).json()["output_ids"] == r.json()[1]["output_ids"]
    assert metric(prefill, "prefix_cache_hit_tokens_total") == hits + len(prompts[1]) - 1
    # Nothing holds KV on either side once the answers are in.
    assert metric(prefill, "kv_used_tokens") == 0 and metric(decode, "kv_used_tokens") == 0
    # The prefill side sends each prompt's KV in the step after its first token: no overlap there.
    overlap = {
        side: http.get(f"{pd[side].url}/get_server_info").json()["overlap_schedule"]
        for side in ("prefill", "decode")
    }
    assert overlap == {"prefill": False, "decode": True}


def test_a_half_without_its_partner_fails_naming_it(pd, prompts):
    """A request that reaches only one side fails after the timeout, naming the side that never came;
    the same room twice on one side is a 400 at once; afterwards no KV is held anywhere."""
    prefill, decode, port = pd["prefill"], pd["decode"], pd["port"]
    room = {"bootstrap_host": "127.0.0.1", "bootstrap_port": port}
    answers: dict[str, httpx.Response] = {}

    def send(side: str, server: ServerProcess, number: int, bootstrap_port: int = port) -> None:
        body = {**room, "bootstrap_port": bootstrap_port}
        answers[side] = generate(server.url, prompts[2], bootstrap_room=number, **body)

    gone = free_port()  # a prefill instance that is not there
    alone = [
        threading.Thread(target=send, args=("decode", decode, 101)),
        threading.Thread(target=send, args=("prefill", prefill, 202)),
        threading.Thread(target=send, args=("nobody", decode, 303, gone)),
    ]
    for t in alone:
        t.start()
    deadline = time.monotonic() + 60
    while metric(decode, "num_running_reqs") + metric(prefill, "num_running_reqs") < 3:
        assert time.monotonic() < deadline, "the two requests never reached their instances"
        time.sleep(0.05)
    for server, number in ((decode, 101), (prefill, 202)):
        twice = generate(server.url, prompts[2], bootstrap_room=number, **room)
        assert twice.status_code == 400 and f"bootstrap_room {number} is already in use" in twice.text
    for t in alone:
        t.join()
    assert answers["decode"].status_code == 503
    assert (
        f"no request with bootstrap_room 101 reached the prefill instance within {TIMEOUT_S} s"
        in answers["decode"].text
    )
    assert answers["nobody"].status_code == 503
    assert (
        f"the prefill instance 127.0.0.1:{gone} did not deliver the KV of bootstrap_room 303 within "
        f"{TIMEOUT_S} s" in answers["nobody"].text
    )
    assert answers["prefill"].status_code == 503
    assert f"no decode instance asked for bootstrap_room 202 within {TIMEOUT_S} s" in answers["prefill"].text
    # Requests without a room are not for a PD instance.
    plain = generate(decode.url, prompts[2])
    assert plain.status_code == 400 and "requests come through the PD router" in plain.text
    # The decode side keeps the failed request's slots for one more timeout (the prefill side may
    # still be writing), then frees them.
    assert kv_settles(prefill, 5) and kv_settles(decode, 3 * TIMEOUT_S)


def test_a_decode_side_that_went_away(pd, prompts):
    """The destination's transfer engine is gone (its instance stopped after asking): the prefill
    request fails naming the write, the decode side hears why, the prefill side holds no KV, and
    after three such failures in a row its /health says so until a transfer works again."""
    prefill, port = pd["prefill"], pd["port"]
    pool, _ = kv_transfer.make_pool(pd["model"], "float32", 64)  # the rows a decode pool would have
    rows = tuple((b.data_ptr(), b.stride(0) * b.element_size()) for layer in pool.layers for b in layer)
    gone = PoolDescriptor(f"127.0.0.1:{free_port()}", rows).to_json()
    ctx = zmq.Context()
    peer = ctx.socket(zmq.DEALER)
    peer.connect(f"tcp://127.0.0.1:{port}")
    boot = {"bootstrap_host": "127.0.0.1", "bootstrap_port": port}
    try:
        answers: dict[int, httpx.Response] = {}

        def send(room: int) -> None:
            answers[room] = generate(prefill.url, prompts[3], bootstrap_room=room, **boot)

        for room in (501, 502, 503):
            sender = threading.Thread(target=send, args=(room,))
            sender.start()
            slots = list(range(1, len(prompts[3]) + 1))
            dest = {"slots": slots, "ranks": [gone], "kv_heads": 1, "nextn": False}
            dest |= {"window": 0, "window_slots": []}
            peer.send_json({"room": room, "dest": dest})
            assert peer.poll(60_000), "the prefill instance never answered the room"
            reply = peer.recv_json()
            sender.join()
            assert reply["room"] == room and reply["write_failed"]
            moved = len(slots) * sum(row for _, row in rows)  # one batch: every layer's rows, one run
            assert f"writing {moved} bytes of KV to {gone['session']} failed" in reply["error"]
            assert answers[room].status_code == 500 and "writing the KV failed" in answers[room].text
    finally:
        ctx.destroy(linger=0)
    assert metric(prefill, "kv_used_tokens") == 0
    health = http.get(f"{prefill.url}/health")
    assert health.status_code == 503 and "the last 3 KV transfers failed" in health.text
    assert generate(pd["router"].url, prompts[3]).status_code == 200
    assert http.get(f"{prefill.url}/health").text == "ok"


def test_gqa_heads_and_window_slots_between_layouts(model_dirs, prompts):
    """gpt-oss: GQA heads split over attention TP and window layers in a hybrid pool of their own
    (8-token windows). A prefill instance holding both KV heads per rank (tp 1) writes each decode
    rank (tp 2) its own head, the window layers' rows into window slots for the prompt's last
    positions; sent straight to both sides, as the router does."""
    model, port = model_dirs["gpt_oss"], free_port()
    longer = [p for p in prompts if len(p) > 8][:3]  # each outgrows its window
    refs = hf_greedy_reference(model, longer, NEW_TOKENS)
    common = ("--model-path", model, "--dtype", "float32", "--disaggregation-timeout", str(TIMEOUT_S))
    prefill_args = ("--disaggregation-mode", "prefill", "--disaggregation-bootstrap-port", str(port))
    with (
        ServerProcess(*common, *prefill_args) as prefill,
        ServerProcess(*common, "--tp", "2", "--disaggregation-mode", "decode") as decode,
    ):
        rooms = {"bootstrap_host": "127.0.0.1", "bootstrap_port": port, "bootstrap_room": [7, 8, 9]}
        answers = both_sides(prefill, decode, longer, return_logprob=True, **rooms)
        assert metric(decode, "kv_window_pool_tokens") > 0  # the hybrid pool is on
    assert_matches_reference(http_outputs(answers[decode.url].json()), refs)


def test_nextn_drafts_and_mtp_kv_carry_over(engine_cache):
    """NEXTN on both sides (the trained tiny DeepSeek-V3, whose MTP layer's drafts are mostly right):
    the prefill instance sends the MTP layer's KV with the prompt's and its first draft chain with the
    first token, so the decode instance (tp 2, dp 2) verifies exactly as a co-located instance does:
    the same tokens and the same verify steps, request by request."""
    model, port = str(trained_mtp_model()), free_port()
    prompts = [synthetic_sequences(1, n, seed=200 + i)[0] for i, n in enumerate((7, 33, 18, 61))]
    refs = hf_greedy_reference(model, prompts, NEW_TOKENS)
    nextn = {"speculative_algorithm": "NEXTN", "speculative_num_steps": 2}
    colocated = engine_cache.get(model, **nextn).generate(input_ids=prompts, sampling_params=GREEDY)
    common = ("--model-path", model, "--dtype", "float32", "--disaggregation-timeout", str(TIMEOUT_S))
    common += ("--speculative-algorithm", "NEXTN", "--speculative-num-steps", "2")
    prefill_args = ("--disaggregation-mode", "prefill", "--disaggregation-bootstrap-port", str(port))
    decode_args = ("--tp", "2", "--dp", "2", "--enable-dp-attention", "--disaggregation-mode", "decode")
    with ServerProcess(*common, *prefill_args) as prefill, ServerProcess(*common, *decode_args) as decode:
        rooms = {"bootstrap_host": "127.0.0.1", "bootstrap_port": port, "bootstrap_room": [11, 12, 13, 14]}
        answers = both_sides(prefill, decode, prompts, return_logprob=True, **rooms)
    assert_matches_reference(http_outputs(answers[decode.url].json()), refs)
    verify_steps = [o["meta_info"]["spec_verify_ct"] for o in answers[decode.url].json()]
    assert verify_steps == [o["meta_info"]["spec_verify_ct"] for o in colocated]
    assert sum(verify_steps) < len(prompts) * (NEW_TOKENS - 1)  # drafts were accepted
