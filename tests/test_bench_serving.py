"""bench_serving: metrics from recorded timestamps, random lengths, arrivals, the streaming client against a
real dpserve server, and the transformers baseline on a tiny model."""

from __future__ import annotations

import asyncio
import itertools
import json
from collections.abc import Iterator

import numpy as np
import pytest
from transformers import AutoModelForCausalLM, AutoTokenizer

from dpserve.bench import serving as bs
from dpserve.testing.reference import hf_greedy_reference
from dpserve.testing.server import ServerProcess
from dpserve.testing.tiny_models import write_tiny_model


def output(
    prompt_len: int, start: float, chunks: list[float], end: float, output_len: int
) -> bs.RequestOutput:
    return bs.RequestOutput(
        prompt_len, success=True, output_len=output_len, start=start, end=end, chunk_times=chunks
    )


def test_metrics_from_timestamps() -> None:
    outputs = [
        output(10, start=0.0, chunks=[0.1, 0.2, 0.4], end=0.5, output_len=3),
        output(20, start=1.0, chunks=[1.3, 1.4], end=1.6, output_len=2),
        bs.RequestOutput(prompt_len=5, error="HTTP 400: too long"),
    ]
    m = bs.compute_metrics(outputs, duration=2.0)
    expected = {
        "completed": 2,
        "failed": 1,
        "total_input_tokens": 30,  # failed requests count neither input nor output tokens
        "total_output_tokens": 5,
        "request_throughput": 1.0,
        "input_throughput": 15.0,
        "output_throughput": 2.5,
        "total_throughput": 17.5,
        "concurrency": 0.55,  # (0.5 + 0.6) / 2
        # TTFT 100, 300 ms; p99 interpolates linearly: 100 + 0.99 * 200.
        "mean_ttft_ms": 200.0,
        "median_ttft_ms": 200.0,
        "p99_ttft_ms": 298.0,
        # ITL pools the gaps of both requests: 100, 200 and 100 ms.
        "mean_itl_ms": 400.0 / 3,
        "median_itl_ms": 100.0,
        "p99_itl_ms": 198.0,
        # TPOT: (500 - 100) / 2 = 200 and (600 - 300) / 1 = 300 ms.
        "mean_tpot_ms": 250.0,
        "median_tpot_ms": 250.0,
        "p99_tpot_ms": 299.0,
        "mean_e2e_latency_ms": 550.0,
        "median_e2e_latency_ms": 550.0,
        "p99_e2e_latency_ms": 599.0,
    }
    for key, value in expected.items():
        assert m[key] == pytest.approx(value, rel=1e-9), key


def test_metrics_single_token_and_all_failed() -> None:
    m = bs.compute_metrics([output(4, 0.0, [0.25], 0.25, 1)], duration=1.0)
    assert m["mean_ttft_ms"] == pytest.approx(250.0)
    assert m["mean_itl_ms"] is None and m["mean_tpot_ms"] is None  # one token: no gap, no TPOT
    m = bs.compute_metrics([bs.RequestOutput(prompt_len=3, error="x")], duration=1.0)
    assert m["completed"] == 0 and m["failed"] == 1 and m["p99_e2e_latency_ms"] is None


@pytest.mark.parametrize(("ratio", "length", "low"), [(0.0, 10, 1), (0.3, 10, 3), (0.5, 7, 4), (1.0, 9, 9)])
def test_random_lengths_range(ratio: float, length: int, low: int) -> None:
    values = bs.random_lengths(2000, length, ratio, np.random.default_rng(0))
    assert values.min() == low and values.max() == length  # every bound is reached, none crossed
    assert low >= ratio * length


def test_random_lengths_ratio_one_is_exact() -> None:
    assert (bs.random_lengths(50, 128, 1.0, np.random.default_rng(3)) == 128).all()


def test_sample_requests_avoid_special_ids_and_are_seeded() -> None:
    token_ids = np.arange(3, 50)  # as prompt_token_ids gives for specials 0..2 and 50 tokens
    a = bs.sample_requests(20, 16, 8, 0.5, token_ids, np.random.default_rng(7))
    b = bs.sample_requests(20, 16, 8, 0.5, token_ids, np.random.default_rng(7))
    assert a == b
    assert all(8 <= len(r.prompt) <= 16 and 4 <= r.output_len <= 8 for r in a)
    assert all(3 <= t < 50 for r in a for t in r.prompt)


def test_arrival_times() -> None:
    a = bs.arrival_times(20000, 4.0, np.random.default_rng(5))
    assert np.array_equal(a, bs.arrival_times(20000, 4.0, np.random.default_rng(5)))
    assert not np.array_equal(a, bs.arrival_times(20000, 4.0, np.random.default_rng(6)))
    gaps = np.diff(a)
    assert a[0] == 0.0 and (gaps >= 0).all()
    assert gaps.mean() == pytest.approx(0.25, rel=0.03)  # exponential: mean = std = 1 / rate
    assert gaps.std() == pytest.approx(0.25, rel=0.05)
    assert (bs.arrival_times(5, float("inf"), np.random.default_rng(5)) == 0).all()


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory) -> str:
    return str(write_tiny_model("llama", tmp_path_factory.mktemp("bench_llama")))


@pytest.fixture(scope="module")
def server(llama_dir: str, engine_cache) -> Iterator[ServerProcess]:
    engine_cache.close()  # two cores: no idle engine ranks next to the server's
    with ServerProcess("--model-path", llama_dir, "--tp", "1") as srv:
        yield srv


def run(base_url: str, model: str, requests: list[bs.RequestInput], max_concurrency: int | None = None):
    arrivals = np.zeros(len(requests))
    return asyncio.run(bs.run_requests(base_url, model, requests, arrivals, max_concurrency, 60.0, True))


def test_client_streams_and_records(server: ServerProcess, llama_dir: str) -> None:
    too_long = [5] * 600  # the tiny model's context is 512 tokens
    (a, b, bad), duration = run(
        server.url,
        llama_dir,
        [bs.RequestInput([5, 6, 7], 4), bs.RequestInput([8], 1), bs.RequestInput(too_long, 2)],
    )
    assert a.success and a.output_len == 4 and 1 <= len(a.chunk_times) <= 4
    assert a.start < a.chunk_times[0] <= a.chunk_times[-1] <= a.end <= a.start + duration
    assert b.success and b.output_len == 1 and len(b.chunk_times) == 1
    assert not bad.success and bad.error.startswith("HTTP 400: ") and "context length is 512" in bad.error


def test_client_concurrency_cap(server: ServerProcess, llama_dir: str) -> None:
    outputs, _ = run(server.url, llama_dir, [bs.RequestInput([4, 5], 6) for _ in range(6)], max_concurrency=2)
    assert all(o.success and o.output_len == 6 for o in outputs)
    events = sorted([(o.start, 1) for o in outputs] + [(o.end, -1) for o in outputs])
    in_flight = np.cumsum([e for _, e in events])
    assert in_flight.max() == 2


def test_connection_refused_is_a_failure() -> None:
    (out,), _ = run("http://127.0.0.1:1", "m", [bs.RequestInput([4], 2)])
    assert not out.success and out.error


def test_prompt_token_ids_exclude_special_tokens(llama_dir: str) -> None:
    ids = bs.prompt_token_ids(AutoTokenizer.from_pretrained(llama_dir))
    assert np.array_equal(ids, np.arange(3, 301))  # bos, eos, pad are ids 0..2 of a 301-token vocabulary


def test_transformers_baseline_exact_lengths_and_greedy(llama_dir: str) -> None:
    rng = np.random.default_rng(0)
    requests = bs.sample_requests(7, 24, 12, 0.0, np.arange(3, 301), rng)
    model = AutoModelForCausalLM.from_pretrained(llama_dir).eval()
    outputs = bs.transformers_generate(model, requests, batch_size=3, pad_id=2, disable_tqdm=True)
    assert [len(o) for o in outputs] == [r.output_len for r in requests]
    # Left padding must not change greedy tokens: compare with unpadded batch-1 generation.
    for r, out in zip(requests, outputs, strict=True):
        (ref,) = hf_greedy_reference(llama_dir, [r.prompt], r.output_len)
        assert out[: ref.compare_len] == ref.output_ids[: ref.compare_len]


def test_main_end_to_end(server: ServerProcess, llama_dir: str, tmp_path, capsys) -> None:
    out_file = tmp_path / "results.jsonl"
    argv = [
        "--base-url", server.url, "--model-path", llama_dir, "--num-prompts", "6",
        "--random-input-len", "8", "--random-output-len", "5", "--random-range-ratio", "1.0",
        "--request-rate", "200", "--max-concurrency", "3", "--disable-tqdm",
        "--baseline", "transformers", "--output-file", str(out_file),
    ]  # fmt: skip
    result = bs.main([*argv, "--offline-engine"])
    assert result["completed"] == 6 and result["failed"] == 0 and result["output_len_mismatches"] == 0
    assert result["total_input_tokens"] == 48 and result["total_output_tokens"] == 30
    assert result["baseline"]["total_output_tokens"] == 30
    # The same requests through the offline Engine with the server's options: 3 running at most.
    offline = result["offline_engine"]
    assert offline["total_output_tokens"] == 30 and offline["max_running_requests"] == 3
    assert result["served_over_offline"] == pytest.approx(
        result["output_throughput"] / offline["output_throughput"]
    )
    ratio = result["output_throughput"] / result["baseline"]["output_throughput"]
    assert result["output_throughput_ratio"] == pytest.approx(ratio)
    assert result["model"] == llama_dir and result["max_concurrency"] == 3
    bs.main(argv)  # appends
    lines = out_file.read_text().splitlines()
    assert len(lines) == 2
    saved = json.loads(lines[0])
    assert saved["command"].startswith("python -m dpserve.bench.serving --base-url")
    assert saved["machine"]["cpu_count"] >= 1 and saved["machine"]["platform"]
    printed = capsys.readouterr().out
    assert "Successful requests:" in printed and "| dataset | prompts | input len |" in printed
    assert "Output throughput served/offline:" in printed


def test_shared_prefix_and_multi_turn_workloads_hit_the_cache(server: ServerProcess, llama_dir: str) -> None:
    ids = np.arange(3, 301)
    gsp = bs.sample_shared_prefix_requests(2, 3, 20, 4, 3, ids, np.random.default_rng(0))
    assert len(gsp) == 6 and all(len(r.prompt) == 24 and r.output_len == 3 for r in gsp)
    assert len({tuple(r.prompt[:20]) for r in gsp}) == 2 and len({tuple(r.prompt) for r in gsp}) == 6
    outputs, _ = run(server.url, llama_dir, gsp, max_concurrency=1)
    assert all(o.success for o in outputs)
    # One at a time: every group's second and third question find its system prompt cached.
    assert sum(o.cached_tokens for o in outputs) >= 2 * 2 * 20

    conversations = bs.sample_multi_turn_requests(2, 3, 5, 4, ids, np.random.default_rng(1))
    outputs, _ = run(server.url, llama_dir, conversations)
    assert len(outputs) == 6 and all(o.success and o.output_len == 4 == len(o.output_ids) for o in outputs)
    for turns in (outputs[:3], outputs[3:]):
        for prev, cur in itertools.pairwise(turns):
            # History (the previous prompt and answer) plus 5 new tokens; all of the history but the
            # answer's last token (whose KV was never computed) comes from the cache.
            assert cur.prompt_len == prev.prompt_len + 4 + 5
            assert cur.cached_tokens == prev.prompt_len + 3
