"""Faults, overload and access (real processes, real sockets): the watchdog for a stopped rank (server
and offline Engine), load shedding, the API key and body limit, the graceful stop, and a 30-second
soak of mixed traffic that must lose and leak nothing."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time

import httpx
import pytest
from openai import APIError, OpenAI

from dpserve import Engine
from dpserve.engine.worker_pool import Watchdog, WorkerFailure
from dpserve.testing.server import ServerProcess

KEY = "sk-test-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
BODY_LIMIT = 4096
SLOW = 200  # tokens of a request that stays in flight for a while (hundreds of decode steps)
WATCHDOG_S = 5
STACK_LINE = "(most recent call first)"  # faulthandler's header of each thread's stack


def layout(model: str) -> list[str]:
    return ["--model-path", model, "--tp", "2", "--dp", "2", "--enable-dp-attention", "--dtype", "float32"]


@pytest.fixture(scope="module")
def model(model_dirs) -> str:
    return model_dirs["deepseek_v2"]


def test_watchdog_tells_silent_from_busy():
    """The decision rule: a rank computing a long step keeps beating and trips only past the
    timeout; a silent one trips after the timeout; silence while nobody listened does not count."""
    t0 = 1000.0  # a fixed origin: (t0 + 300) - t0 is exactly 300 (not so for every monotonic reading)
    dog = Watchdog(timeout=300, now=t0)
    dog.beat(0, step_age=0.0, now=t0)
    dog.beat(1, step_age=0.0, now=t0)
    for second in range(1, 300):  # a 299-second step: rank 0 beats throughout
        dog.beat(0, step_age=float(second), now=t0 + second)
    assert dog.stalled() == []  # 299 s < 300: a long step is not a hang
    assert [r for r, _ in dog.silent(t0 + 299)] == []  # rank 1 was heard at t0: 299 s < 300
    assert [r for r, _ in dog.silent(t0 + 300)] == [1]
    dog.beat(0, step_age=300 + 2 * dog.interval, now=t0 + 302)
    assert [r for r, _ in dog.stalled()] == [0]
    idle = Watchdog(timeout=5, now=t0)
    idle.beat(0, step_age=0.0, now=t0)
    idle.leave(t0)
    idle.listen(t0 + 60)  # an Engine idle for a minute starts reading again
    assert idle.listening_since == t0 + 60
    assert idle.silent(t0 + 64) == []
    assert [r for r, _ in idle.silent(t0 + 65)] == [0]


# --- a server with an API key, a body limit, a queue limit and a graceful stop -------------------


@pytest.fixture(scope="module")
def guarded(model, engine_cache):
    engine_cache.close()  # two cores: no idle engine's ranks beside the server
    args = ["--api-key", KEY, "--max-request-bytes", str(BODY_LIMIT), "--max-queued-requests", "1"]
    args += ["--max-running-requests", "2"]  # SGLang's meaning: the instance's, one per DP group
    args += ["--graceful-shutdown-timeout", "120", "--log-level", "info"]
    with ServerProcess(*layout(model), *args) as srv:
        yield srv


ENDPOINTS = [
    ("GET", "/get_server_info"),
    ("GET", "/server_info"),
    ("GET", "/get_model_info"),
    ("GET", "/get_load"),
    ("GET", "/metrics"),
    ("GET", "/v1/models"),
    ("POST", "/flush_cache"),
    ("POST", "/generate"),
    ("POST", "/v1/completions"),
    ("POST", "/v1/chat/completions"),
]


def test_api_key_guards_every_endpoint_but_health(guarded, model):
    for method, path in ENDPOINTS:
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}):
            r = httpx.request(method, f"{guarded.url}{path}", headers=headers, json={})
            assert r.status_code == 401, (path, headers, r.text)
            assert r.json()["error"]["type"] == "authentication_error"
            assert r.headers["www-authenticate"] == "Bearer"
    assert httpx.get(f"{guarded.url}/health").text == "ok"
    assert httpx.get(f"{guarded.url}/get_load", headers=AUTH).status_code == 200
    client = OpenAI(base_url=f"{guarded.url}/v1", api_key=KEY)
    out = client.completions.create(model=model, prompt="hi", max_tokens=3, extra_body={"ignore_eos": True})
    assert out.usage.completion_tokens == 3
    with pytest.raises(Exception, match="401"):
        OpenAI(base_url=f"{guarded.url}/v1", api_key="wrong").models.list()


def test_oversized_body_gets_413_unread(guarded, model):
    big = {"model": model, "prompt": "x" * BODY_LIMIT, "max_tokens": 1}
    r = httpx.post(f"{guarded.url}/v1/completions", json=big, headers=AUTH)
    assert r.status_code == 413 and "--max-request-bytes 4096" in r.json()["error"]["message"]

    def chunks():  # no Content-Length: counted as it arrives
        yield b'{"prompt": "'
        for _ in range(10):
            yield b"x" * 1000
        yield b'"}'

    r = httpx.post(f"{guarded.url}/generate", content=chunks(), headers=AUTH)
    assert r.status_code == 413
    info = httpx.get(f"{guarded.url}/get_server_info", headers=AUTH).json()
    assert info["rejected_requests"]["too_large"] == 2


def open_stream(stack: contextlib.ExitStack, url: str, body: dict):
    """A streaming request (closed with `stack`) whose first event has arrived, so it is running:
    (that event, the rest of its lines)."""
    r = stack.enter_context(httpx.stream("POST", url, json=body, headers=AUTH, timeout=300))
    assert r.status_code == 200, r.read()
    lines = r.iter_lines()
    return next(line for line in lines if line.startswith("data: ")), lines


def test_queue_limit_counts_waiting_requests_as_sglang_does(guarded, model):
    """--max-running-requests 2 --max-queued-requests 1 at dp=2: each group runs one request, one more
    may wait, and the rest are shed with 503 + Retry-After; the admitted ones finish whole."""
    slow = {"model": model, "prompt": "a story", "max_tokens": SLOW, "ignore_eos": True, "stream": True}
    slow |= {"stream_options": {"include_usage": True}}
    native = {"input_ids": [7, 8, 9, 10], "sampling_params": {"max_new_tokens": SLOW, "temperature": 0.0}}
    native["sampling_params"]["ignore_eos"] = True
    waited: dict = {}

    def wait_in_group_0() -> None:
        body = {**native, "data_parallel_rank": 0}
        waited["r"] = httpx.post(f"{guarded.url}/generate", json=body, headers=AUTH, timeout=300)

    waiter = threading.Thread(target=wait_in_group_0)
    with contextlib.ExitStack() as stack:
        _, first_lines = open_stream(
            stack, f"{guarded.url}/v1/completions", {**slow, "data_parallel_rank": 0}
        )
        second_first, second_lines = open_stream(
            stack, f"{guarded.url}/generate", {**native, "stream": True, "data_parallel_rank": 1}
        )
        waiter.start()  # behind the first, in group 0
        deadline = time.monotonic() + 60
        while httpx.get(f"{guarded.url}/get_server_info", headers=AUTH).json()["requests_in_flight"] < 3:
            assert time.monotonic() < deadline
        shed = [httpx.post(f"{guarded.url}/v1/completions", json=slow, headers=AUTH) for _ in range(3)]
        info = httpx.get(f"{guarded.url}/get_server_info", headers=AUTH).json()
        metrics = httpx.get(f"{guarded.url}/metrics", headers=AUTH).text
        first_events = [json.loads(x.removeprefix("data: ")) for x in first_lines if x.startswith("data: {")]
        second_events = [second_first, *(x for x in second_lines if x.startswith("data: {"))]
    waiter.join()
    for r in shed:
        assert r.status_code == 503 and r.headers["retry-after"] == "1"
        assert r.json()["error"] == {
            "message": "the server is overloaded: 1 requests waiting (--max-queued-requests 1) beside 2 "
            "running; retry later",
            "type": "service_unavailable",
            "code": 503,
        }
    assert (info["requests_in_flight"], info["requests_waiting"], info["max_queued_requests"]) == (3, 1, 1)
    assert info["rejected_requests"]["overloaded"] == 3
    assert 'dpserve_rejected_requests_total{reason="overloaded"} 3.0' in metrics
    assert "dpserve_requests_in_flight 3.0" in metrics and "dpserve_requests_waiting 1.0" in metrics
    # The admitted ones finish whole: all their tokens, the same as the request run alone.
    assert first_events[-1]["usage"]["completion_tokens"] == SLOW
    assert first_events[-2]["choices"][0]["finish_reason"] == "length"
    streamed = json.loads(second_events[-1].removeprefix("data: "))
    alone = httpx.post(f"{guarded.url}/generate", json=native, headers=AUTH, timeout=300).json()
    assert streamed["meta_info"]["finish_reason"]["type"] == "length"
    assert streamed["output_ids"] == alone["output_ids"] == waited["r"].json()["output_ids"]
    assert len(alone["output_ids"]) == SLOW


def test_shared_prompts_fill_every_group_before_any_request_waits(guarded):
    """Users share system prompts: two long requests with the same prompt run one per group (the
    prefix alone would put both on one group, the second waiting while the other group idles);
    then of six more sent at once exactly one waits (--max-queued-requests 1) and five are shed:
    3 served and 5 shed, what the instance as a whole can start or queue."""
    prompt = {"input_ids": [11, 12, 13, 14, 15, 16, 17, 18], "sampling_params": {"ignore_eos": True}}
    answers: dict[str, httpx.Response] = {}

    def send(name: str, tokens: int) -> threading.Thread:
        body = {**prompt, "sampling_params": {"ignore_eos": True, "max_new_tokens": tokens}}

        def post() -> None:
            answers[name] = httpx.post(f"{guarded.url}/generate", json=body, headers=AUTH, timeout=300)

        thread = threading.Thread(target=post)
        thread.start()
        return thread

    def in_flight() -> list[int]:  # per group, as the router counts them
        return [g["num_reqs"] for g in httpx.get(f"{guarded.url}/get_load", headers=AUTH).json()]

    deadline = time.monotonic() + 60
    long = [send("first", 480)]
    while sum(in_flight()) < 1:  # routed, running
        assert time.monotonic() < deadline
    long.append(send("second", 480))
    while sum(routed := in_flight()) < 2:
        assert time.monotonic() < deadline
    burst = [send(str(i), 4) for i in range(6)]
    while len(answers) < 5:  # the shed ones answer at once; the admitted one waits for a slot
        assert time.monotonic() < deadline
    shed = dict(answers)
    for thread in long + burst:
        thread.join()
    assert routed == [1, 1]  # one per group: neither waited
    assert {a.status_code for a in shed.values()} == {503} and len(shed) == 5
    assert answers["first"].json()["meta_info"]["dp_rank"] != answers["second"].json()["meta_info"]["dp_rank"]
    served = [k for k, a in answers.items() if a.status_code == 200]
    assert len(served) == 3 and {"first", "second"} <= set(served)


def test_graceful_stop_finishes_the_request_in_flight(guarded, model):
    body = {"model": model, "prompt": "a story", "max_tokens": SLOW, "ignore_eos": True, "stream": True}
    body |= {"stream_options": {"include_usage": True}}
    with contextlib.ExitStack() as stack:
        _, lines = open_stream(stack, f"{guarded.url}/v1/completions", body)
        guarded.proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + 30
        while httpx.get(f"{guarded.url}/health").status_code != 503:  # draining has begun
            assert time.monotonic() < deadline
        refused = httpx.post(f"{guarded.url}/v1/completions", json=body, headers=AUTH)
        events = [json.loads(x.removeprefix("data: ")) for x in lines if x.startswith("data: {")]
    assert refused.status_code == 503 and "admits no new requests" in refused.json()["error"]["message"]
    assert events[-1]["usage"]["completion_tokens"] == SLOW
    assert events[-2]["choices"][0]["finish_reason"] == "length"
    assert guarded.wait(60) == 0
    assert "shut down cleanly" in guarded.output


# --- a server with a 5-second watchdog: 12 s of soak, then a rank stopped -----------------------


@pytest.fixture(scope="module")
def watched(model, engine_cache):
    engine_cache.close()
    args = ["--watchdog-timeout", str(WATCHDOG_S), "--max-request-bytes", "65536", "--log-level", "info"]
    with ServerProcess(*layout(model), *args) as srv:
        yield srv


def test_soak_loses_and_leaks_nothing(watched):
    # 12 s in the suite; docs/benchmarks.md records the long soak.
    cmd = [sys.executable, "-m", "dpserve.bench.soak", "--base-url", watched.url, "--duration", "12"]
    cmd += ["--concurrency", "4", "--warmup", "10", "--seed", "1"]
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout + run.stderr
    assert "violations: 0" in run.stdout
    assert "watchdog" not in watched.output  # 12 s of steps under a 5 s watchdog: never tripped


def test_stopped_rank_gets_503_stacks_and_exit_1(watched, model):
    """A rank stopped mid-request: a plain request gets a 503 naming the rank; streamed ones (headers
    sent with 200 already) end with an error event naming it, which the openai client raises."""
    pid = httpx.get(f"{watched.url}/get_server_info").json()["worker_pids"]["1"]
    body = {"input_ids": [5] * 10, "sampling_params": {"max_new_tokens": 480, "ignore_eos": True}}
    answer: dict = {}

    def request() -> None:
        answer["r"] = httpx.post(f"{watched.url}/generate", json=body, timeout=120)

    def native_stream() -> None:
        with httpx.stream("POST", f"{watched.url}/generate", json={**body, "stream": True}, timeout=120) as r:
            answer["native"] = [x.removeprefix("data: ") for x in r.iter_lines() if x.startswith("data: ")]

    def openai_stream() -> None:
        client = OpenAI(base_url=f"{watched.url}/v1", api_key="none", max_retries=0)
        chunks = client.completions.create(
            model=model, prompt="a story", max_tokens=480, stream=True, extra_body={"ignore_eos": True}
        )
        try:
            answer["openai"] = [c.choices[0].finish_reason for c in chunks if c.choices]
        except APIError as e:
            answer["openai"] = e

    threads = [threading.Thread(target=f) for f in (request, native_stream, openai_stream)]
    for thread in threads:
        thread.start()
    deadline = time.monotonic() + 60
    while sum(g["num_reqs"] for g in httpx.get(f"{watched.url}/get_load").json()) < 3:  # all in flight
        assert time.monotonic() < deadline
    try:
        stopped = time.monotonic()
        os.kill(pid, signal.SIGSTOP)
        code = watched.wait(WATCHDOG_S + 30)
        detected = time.monotonic() - stopped
        for thread in threads:
            thread.join()
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    assert code == 1 and detected < WATCHDOG_S + 30
    r = answer["r"]
    assert r.status_code == 503
    assert "worker rank 1 is silent" in r.json()["error"]["message"]
    *events, error, done = answer["native"]
    assert json.loads(events[-1])["meta_info"]["finish_reason"]["type"] == "abort" and done == "[DONE]"
    error = json.loads(error)["error"]
    assert error["code"] == 503 and "worker rank 1 is silent" in error["message"]
    assert isinstance(answer["openai"], APIError), answer["openai"]
    assert "worker rank 1 is silent" in answer["openai"].message
    # Rank 0's stack: waiting for rank 1 in a collective.
    assert STACK_LINE in watched.output and "dpserve/distributed.py" in watched.output
    assert f"watchdog: worker rank 1 is silent (no heartbeat for {WATCHDOG_S}." in watched.output


def test_offline_engine_raises_for_a_stopped_worker(model, engine_cache):
    engine_cache.close()
    engine = Engine(
        model_path=model, tp_size=2, dp_size=2, enable_dp_attention=True, device="cpu", watchdog_timeout=3
    )
    pid = engine.front.workers.procs[1].pid
    try:
        assert (
            len(engine.generate(input_ids=[1, 2, 3], sampling_params={"max_new_tokens": 2})["output_ids"])
            >= 1
        )
        os.kill(pid, signal.SIGSTOP)
        with pytest.raises(WorkerFailure, match="worker rank 1 is silent"):
            engine.generate(input_ids=[1, 2, 3], sampling_params={"max_new_tokens": 400, "ignore_eos": True})
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
        engine.shutdown()


def test_a_script_that_raises_without_shutting_the_engine_down_exits(model_dirs, tmp_path):
    """The ranks ignore SIGTERM, so an Engine nobody shut down must not leave the interpreter waiting
    for them at exit: the script ends with its own traceback and exit code."""
    script = tmp_path / "forgets_shutdown.py"
    script.write_text(
        "from dpserve import Engine\n\n\n"
        "def main():\n"
        f"    engine = Engine(model_path={model_dirs['llama']!r}, device='cpu', dtype='float32')\n"
        "    engine.generate(input_ids=[5, 6, 7], sampling_params={'max_new_tokens': 2})\n"
        "    raise RuntimeError('the script failed')\n\n\n"
        "if __name__ == '__main__':\n"
        "    main()\n"
    )
    run = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120)
    assert run.returncode == 1
    assert run.stderr.rstrip().endswith("RuntimeError: the script failed")
