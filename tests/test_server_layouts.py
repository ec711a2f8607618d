"""Server layouts beyond one node with DP attention: replicas, two nodes on loopback, a dying worker."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import threading
import time

import httpx
import pytest
from conftest import GREEDY, assert_matches_reference

from dpserve.engine.worker_pool import free_port
from dpserve.testing.server import ServerProcess


def generate(server: ServerProcess, input_ids, **extra) -> dict | list[dict]:
    """/generate's outputs, their logprob entries ([logprob, token id, text]) reduced to logprobs."""
    body = {"input_ids": input_ids, "sampling_params": GREEDY, "return_logprob": True, **extra}
    r = httpx.post(f"{server.url}/generate", json=body, timeout=300)
    assert r.status_code == 200, r.text
    outputs = r.json()
    for out in outputs if isinstance(outputs, list) else [outputs]:
        entries = out["meta_info"]["output_token_logprobs"]
        assert [token for _, token, _ in entries] == out["output_ids"]
        out["meta_info"]["output_token_logprobs"] = [logprob for logprob, _, _ in entries]
    return outputs


@pytest.fixture(scope="module")
def replicas(model_dirs, engine_cache):
    engine_cache.close()
    model = model_dirs["deepseek_v2"]
    with ServerProcess(
        "--model-path",
        model,
        "--tp",
        "1",
        "--dp",
        "2",
        "--load-balance-method",
        "round_robin",
        "--dtype",
        "float32",
    ) as srv:
        yield srv


def test_replicas_alternate_and_match_reference(replicas, prompts, references):
    info = httpx.get(f"{replicas.url}/get_server_info").json()
    assert (info["tp_size"], info["dp_size"], info["enable_dp_attention"], len(info["worker_pids"])) == (
        1,
        2,
        False,
        2,
    )
    outputs = [generate(replicas, p) for p in prompts]
    assert [o["meta_info"]["dp_rank"] for o in outputs] == [0, 1] * (len(prompts) // 2)
    assert_matches_reference(outputs, references["deepseek_v2"])


def test_killed_worker_stops_the_server_nonzero(replicas):
    pid = httpx.get(f"{replicas.url}/get_server_info").json()["worker_pids"]["1"]
    os.kill(pid, signal.SIGKILL)
    assert replicas.wait(60) != 0
    assert "worker rank 1 exited with code -9" in replicas.output


def test_two_nodes_on_loopback_form_one_instance(model_dirs, prompts, references, engine_cache):
    """tp=4, dp=2 with DP attention: ranks 0-1 in the node-0 launch, ranks 2-3 in the node-1 launch."""
    engine_cache.close()
    model = model_dirs["deepseek_v2"]
    layout = ["--model-path", model, "--tp", "4", "--dp", "2", "--enable-dp-attention", "--nnodes", "2"]
    layout += ["--dtype", "float32"]  # as the transformers reference
    layout += ["--dist-init-addr", f"127.0.0.1:{free_port()}"]
    node1 = ServerProcess(*layout, "--node-rank", "1", wait_ready=False)
    try:
        with ServerProcess(*layout, "--node-rank", "0") as node0:
            info = httpx.get(f"{node0.url}/get_server_info").json()
            assert (info["tp_size"], info["dp_size"], info["attn_tp_size"], info["nnodes"]) == (4, 2, 2, 2)
            assert sorted(info["worker_pids"]) == ["0", "1"]  # node 0's share
            outputs = generate(node0, prompts)
            assert sorted({o["meta_info"]["dp_rank"] for o in outputs}) == [0, 1]
            assert_matches_reference(outputs, references["deepseek_v2"])
            assert node0.stop() == 0
        try:
            code = node1.wait(60)
        except subprocess.TimeoutExpired:
            pytest.fail(f"node 1 did not exit 60 s after node 0 stopped:\n{node1.output}")
        assert code == 0, node1.output
        assert "started ranks ['dpserve-rank2', 'dpserve-rank3']" in node1.output
    finally:
        node1.kill()


def running(pid: int) -> bool:
    """The process exists and is not a zombie (a dead rank may wait for its reaper)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def test_ranks_die_with_a_killed_server(model_dirs):
    """SIGKILL to the server (no shutdown at all): its ranks, forked by the fork server, follow it."""
    srv = ServerProcess("--model-path", model_dirs["llama"], "--tp", "2")
    pids = [int(p) for p in httpx.get(f"{srv.url}/get_server_info").json()["worker_pids"].values()]
    try:
        assert len(pids) == 2 and all(running(p) for p in pids)
        srv.proc.kill()  # not srv.kill(): its reader would wait for the ranks, which hold the pipe
        srv.proc.wait(60)
        deadline = time.monotonic() + 30
        while any(running(p) for p in pids):
            assert time.monotonic() < deadline, f"ranks {pids} outlived their server"
            time.sleep(0.1)
    finally:
        for pid in filter(running, pids):
            os.kill(pid, signal.SIGKILL)


@pytest.mark.parametrize("how", ["SIGTERM to the ranks, then to the group", "SIGINT to the group"])
def test_a_signal_to_the_whole_process_group_is_a_normal_stop(model_dirs, how):
    """A service manager stops a server by signalling every process of its group (systemd's
    KillMode=control-group), Ctrl-C signals the terminal's group: at tp 2 dp 2 either is a normal
    stop, with the ranks signalled first too: the requests in flight (plain and streamed) end naming
    the shutdown, nothing is logged as an error, no traceback, exit 0."""
    sig = signal.SIGTERM if how.startswith("SIGTERM") else signal.SIGINT
    args = ["--model-path", model_dirs["deepseek_v2"], "--tp", "2", "--dp", "2", "--enable-dp-attention"]
    srv = ServerProcess(*args, "--dtype", "float32", own_group=True)
    pids = [int(p) for p in httpx.get(f"{srv.url}/get_server_info").json()["worker_pids"].values()]
    body = {"input_ids": [5] * 10, "sampling_params": {"max_new_tokens": 480, "ignore_eos": True}}
    answers: dict = {}

    def plain() -> None:
        answers["plain"] = httpx.post(f"{srv.url}/generate", json=body, timeout=120)

    def streamed() -> None:
        with httpx.stream("POST", f"{srv.url}/generate", json={**body, "stream": True}, timeout=120) as r:
            answers["stream"] = [x.removeprefix("data: ") for x in r.iter_lines() if x.startswith("data: ")]

    threads = [threading.Thread(target=f) for f in (plain, streamed)]
    try:
        for thread in threads:
            thread.start()
        deadline = time.monotonic() + 60
        while sum(g["num_reqs"] for g in httpx.get(f"{srv.url}/get_load").json()) < 2:  # both in flight
            assert time.monotonic() < deadline
        if how.startswith("SIGTERM to the ranks"):
            for pid in pids:
                os.kill(pid, sig)
        os.killpg(srv.proc.pid, sig)
        code = srv.wait(60)
        for thread in threads:
            thread.join()
    finally:
        srv.kill()
        for pid in filter(running, pids):
            os.kill(pid, signal.SIGKILL)
    assert code == 0, srv.output
    assert "shut down cleanly" in srv.output
    assert " ERROR " not in srv.output and "Traceback" not in srv.output, srv.output
    cause = "the request was aborted: the server is shutting down"
    assert answers["plain"].status_code == 503 and answers["plain"].json()["error"]["message"] == cause
    assert answers["stream"][-1] == "[DONE]"
    assert json.loads(answers["stream"][-2])["error"] == {
        "message": cause,
        "type": "service_unavailable",
        "code": 503,
    }
