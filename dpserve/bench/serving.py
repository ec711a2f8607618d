"""Online serving benchmark for dpserve's HTTP server, modelled on SGLang's bench_serving.

Token-id prompts are streamed at a given request rate (Poisson arrivals) under an optional concurrency
cap; the report has throughput, TTFT / ITL / TPOT / end-to-end latency and the prefix-cache hit rate.
Workloads (``--dataset-name``):

    random                   random prompts and lengths (``/v1/completions``)
    generated-shared-prefix  G groups of Q questions sharing a long system prompt (SGLang's name)
    multi-turn               C conversations of T turns: each turn sends the whole history (earlier
                             prompts and answers) plus a new question, after the previous answer
                             arrived (native ``/generate``, which returns the answer's token ids)
    repeat                   chat prompts asking to repeat a paragraph word for word (copy-heavy text,
                             where speculative n-gram drafts are right most of the time)
    chat                     chat prompts asking for a short story on a topic (plain generation)

``--baseline transformers`` then generates the same prompts and output lengths with transformers (on
``--baseline-device``) and prints dpserve's output throughput over transformers'. ``--offline-engine`` runs them through
dpserve's offline Engine with the served instance's options, so the report shows what the HTTP path
costs (served over offline output throughput).

    python -m dpserve.launch_server --model-path /tmp/tiny_v2 --port 30000 &
    python -m dpserve.bench.serving --base-url http://127.0.0.1:30000 --model-path /tmp/tiny_v2 \\
        --num-prompts 200 --random-input-len 256 --random-output-len 64 --request-rate inf \\
        --max-concurrency 32 --baseline transformers
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import os
import platform
import shlex
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import torch
from tqdm import tqdm
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel

from dpserve.cli import HelpFormatter, positive_int
from dpserve.models.gguf import resolve_model_path


@dataclass
class RequestInput:
    """One benchmark request: prompt token ids and the exact number of tokens to generate. A
    conversation's later turns are `follow_ups`: each is sent as the previous turn's prompt, its
    answer and these new tokens."""

    prompt: list[int]
    output_len: int
    follow_ups: list[list[int]] = field(default_factory=list)
    json_schema: str | None = None  # the output follows it (structured output)


@dataclass
class RequestOutput:
    """What one streamed request recorded; times are ``time.perf_counter()`` values."""

    prompt_len: int
    requested_len: int = 0  # max_tokens asked for (greedy, ignore_eos: exactly what should come)
    success: bool = False
    output_len: int = 0  # usage.completion_tokens, or the number of choice chunks if no usage came
    start: float = 0.0
    end: float = 0.0
    chunk_times: list[float] = field(default_factory=list)  # arrivals of chunks carrying text
    cached_tokens: int = 0  # prompt tokens the server found in its prefix cache
    output_ids: list[int] = field(default_factory=list)  # the answer (native /generate only)
    error: str = ""

    @property
    def ttft(self) -> float:
        return self.chunk_times[0] - self.start

    @property
    def latency(self) -> float:
        return self.end - self.start

    @property
    def itls(self) -> list[float]:
        return np.diff(self.chunk_times).tolist()


def random_lengths(n: int, length: int, range_ratio: float, rng: np.random.Generator) -> np.ndarray:
    """``n`` lengths drawn uniformly from the integers in ``[max(1, range_ratio * length), length]``."""
    # round() first so that e.g. 0.3 * 10 = 3.0000000000000004 does not ceil to 4.
    low = max(1, math.ceil(round(range_ratio * length, 6)))
    return rng.integers(low, length + 1, size=n)


def prompt_token_ids(tokenizer: Any) -> np.ndarray:
    """Token ids that random prompts draw from: the whole vocabulary except the special tokens."""
    return np.setdiff1d(np.arange(len(tokenizer)), tokenizer.all_special_ids)


def sample_requests(
    num: int,
    input_len: int,
    output_len: int,
    range_ratio: float,
    token_ids: np.ndarray,
    rng: np.random.Generator,
) -> list[RequestInput]:
    """Random prompts (ids drawn uniformly from ``token_ids``) with random input and output lengths."""
    input_lens = random_lengths(num, input_len, range_ratio, rng)
    output_lens = random_lengths(num, output_len, range_ratio, rng)
    return [
        RequestInput(rng.choice(token_ids, size=int(i)).tolist(), int(o))
        for i, o in zip(input_lens, output_lens, strict=True)
    ]


def sample_shared_prefix_requests(
    groups: int,
    per_group: int,
    system_len: int,
    question_len: int,
    output_len: int,
    token_ids: np.ndarray,
    rng: np.random.Generator,
) -> list[RequestInput]:
    """SGLang's generated-shared-prefix workload: `groups` system prompts, each followed by
    `per_group` different questions; the requests are shuffled so that the groups interleave."""
    requests = []
    for _ in range(groups):
        system = rng.choice(token_ids, size=system_len).tolist()
        requests += [
            RequestInput(system + rng.choice(token_ids, size=question_len).tolist(), output_len)
            for _ in range(per_group)
        ]
    order = rng.permutation(len(requests))
    return [requests[i] for i in order]


def sample_multi_turn_requests(
    conversations: int,
    turns: int,
    turn_len: int,
    output_len: int,
    token_ids: np.ndarray,
    rng: np.random.Generator,
) -> list[RequestInput]:
    """`conversations` chats of `turns` turns, each turn adding `turn_len` new tokens."""
    return [
        RequestInput(
            rng.choice(token_ids, size=turn_len).tolist(),
            output_len,
            [rng.choice(token_ids, size=turn_len).tolist() for _ in range(turns - 1)],
        )
        for _ in range(conversations)
    ]


PARAGRAPHS = [
    "The river runs past the old mill, under the stone bridge and through the fields where the farmers "
    "grow wheat and barley. In spring the water is high and fast; in late summer it is slow and clear.",
    "Our team meets every Monday at nine to plan the week. Each person says what they finished, what "
    "they will do next, and what is blocking them, and the notes go to everyone before lunch.",
    "To make bread, mix flour, water, salt and yeast, knead the dough for ten minutes, let it rise for "
    "an hour, shape it, let it rise again, and bake it in a hot oven until the crust is brown.",
    "The library opens at eight on weekdays and at ten on weekends. Books can be borrowed for three "
    "weeks and renewed twice online, unless another reader has reserved them.",
]
TOPICS = ["a lighthouse keeper", "a lost umbrella", "the first day of school", "a robot gardener",
          "a storm at sea", "an old clock", "a mountain village", "a talking cat"]  # fmt: skip


def sample_text_requests(
    kind: str, num: int, output_len: int, tokenizer, rng: np.random.Generator
) -> list[RequestInput]:
    """Chat prompts through the model's chat template: `repeat` asks to copy a paragraph word for
    word, `chat` for a short story."""
    requests = []
    for _ in range(num):
        if kind == "repeat":
            content = "Repeat this paragraph word for word:\n\n" + PARAGRAPHS[rng.integers(len(PARAGRAPHS))]
        else:
            content = f"Write a short story about {TOPICS[rng.integers(len(TOPICS))]}."
        messages = [{"role": "user", "content": content}]
        ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_dict=False)
        requests.append(RequestInput(list(ids), output_len))
    return requests


def arrival_times(n: int, request_rate: float, rng: np.random.Generator) -> np.ndarray:
    """Send times in seconds from the start: all 0 for an infinite rate, else a Poisson process
    (exponential gaps with mean ``1 / request_rate``) whose first request goes at 0."""
    if math.isinf(request_rate):
        return np.zeros(n)
    gaps = rng.exponential(1.0 / request_rate, size=n - 1)
    return np.concatenate([[0.0], np.cumsum(gaps)])


def summarize(name: str, seconds: list[float]) -> dict[str, float | None]:
    """Mean, median and p99 (numpy's linear interpolation) in milliseconds; None when there is no sample."""
    if not seconds:
        return {f"{stat}_{name}_ms": None for stat in ("mean", "median", "p99")}
    ms = np.asarray(seconds) * 1000.0
    return {
        f"mean_{name}_ms": float(np.mean(ms)),
        f"median_{name}_ms": float(np.median(ms)),
        f"p99_{name}_ms": float(np.percentile(ms, 99)),
    }


def compute_metrics(outputs: list[RequestOutput], duration: float) -> dict[str, Any]:
    """Throughput and latency statistics over the successful requests of a run that took ``duration`` s.

    TTFT is the first text chunk's arrival minus the send time; ITL pools the gaps between consecutive
    text chunks of every request; TPOT is ``(e2e - ttft) / (output_len - 1)`` per request with at least
    two output tokens; E2E is the last byte's arrival minus the send time.
    """
    done = [o for o in outputs if o.success]
    input_tokens = sum(o.prompt_len for o in done)
    output_tokens = sum(o.output_len for o in done)
    latencies = [o.latency for o in done]
    metrics: dict[str, Any] = {
        "completed": len(done),
        "cache_hit_rate": sum(o.cached_tokens for o in done) / input_tokens if input_tokens else None,
        "failed": len(outputs) - len(done),
        "duration": duration,
        "total_input_tokens": input_tokens,
        "total_output_tokens": output_tokens,
        "request_throughput": len(done) / duration,
        "input_throughput": input_tokens / duration,
        "output_throughput": output_tokens / duration,
        "total_throughput": (input_tokens + output_tokens) / duration,
        "concurrency": sum(latencies) / duration,  # mean number of requests in flight
    }
    metrics |= summarize("ttft", [o.ttft for o in done])
    metrics |= summarize("itl", [gap for o in done for gap in o.itls])
    metrics |= summarize(
        "tpot", [(o.latency - o.ttft) / (o.output_len - 1) for o in done if o.output_len > 1]
    )
    metrics |= summarize("e2e_latency", latencies)
    return metrics


def error_message(status: int, body: bytes) -> str:
    try:
        return f"HTTP {status}: {json.loads(body)['error']['message']}"
    except (ValueError, KeyError, TypeError):
        return f"HTTP {status}: {body[:500].decode(errors='replace')}"


async def send_request(
    client: httpx.AsyncClient,
    base_url: str,
    model: str,
    prompt: list[int],
    output_len: int,
    native: bool,
    json_schema: str | None = None,
) -> RequestOutput:
    """Stream one completion (OpenAI's /v1/completions, or the native /generate when `native`) and
    record its chunk arrival times; failures are recorded, never raised."""
    grammar = {} if json_schema is None else {"json_schema": json_schema}
    if native:
        url, payload = (
            f"{base_url}/generate",
            {
                "input_ids": prompt,
                "sampling_params": {
                    "max_new_tokens": output_len,
                    "temperature": 0.0,
                    "ignore_eos": True,
                    **grammar,
                },
                "stream": True,
            },
        )
    else:
        url, payload = (
            f"{base_url}/v1/completions",
            {
                "model": model,
                "prompt": prompt,
                "max_tokens": output_len,
                "temperature": 0.0,
                "stream": True,
                "ignore_eos": True,
                "stream_options": {"include_usage": True},
                **grammar,
            },
        )
    out = RequestOutput(prompt_len=len(prompt), requested_len=output_len)
    first_choice: float | None = None
    choice_chunks = 0
    usage = None
    out.start = time.perf_counter()
    try:
        async with client.stream("POST", url, json=payload) as response:
            if not response.is_success:
                out.error = error_message(response.status_code, await response.aread())
                return out
            async for line in response.aiter_lines():
                now = time.perf_counter()
                if not line.startswith("data:"):
                    continue
                data = line[len("data:") :].strip()
                if data == "[DONE]":
                    break
                chunk = json.loads(data)
                if error := chunk.get("error"):
                    message = error.get("message", error) if isinstance(error, dict) else error
                    out.error = f"error in stream: {message}"
                    return out
                if native:  # every event carries the whole output so far
                    if len(chunk["output_ids"]) > len(out.output_ids):
                        first_choice = first_choice or now
                        out.chunk_times.append(now)
                    out.output_ids = chunk["output_ids"]
                    usage = {"completion_tokens": len(out.output_ids), **chunk["meta_info"]}
                    continue
                usage = chunk.get("usage") or usage
                for choice in chunk.get("choices") or []:
                    choice_chunks += 1
                    first_choice = first_choice or now
                    if choice.get("text"):
                        out.chunk_times.append(now)
    except (httpx.HTTPError, ValueError, KeyError) as e:
        out.error = f"{type(e).__name__}: {e}"
        return out
    finally:
        out.end = time.perf_counter()
    out.output_len = usage["completion_tokens"] if usage else choice_chunks
    if usage:
        out.cached_tokens = usage.get("cached_tokens") or (usage.get("prompt_tokens_details") or {}).get(
            "cached_tokens", 0
        )
    # A stream whose tokens all decode to empty text (e.g. special tokens) still has a first token.
    if not out.chunk_times and first_choice is not None:
        out.chunk_times.append(first_choice)
    out.success = out.output_len > 0 and bool(out.chunk_times)
    if not out.success:
        out.error = "the stream carried no completion tokens"
    return out


def make_client(timeout: float) -> httpx.AsyncClient:
    # No connection cap: --max-concurrency is the only limit. trust_env=False: never route via a proxy.
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    return httpx.AsyncClient(timeout=httpx.Timeout(timeout), limits=limits, trust_env=False)


async def run_requests(
    base_url: str,
    model: str,
    requests: list[RequestInput],
    arrivals: np.ndarray,
    max_concurrency: int | None,
    timeout: float,
    disable_tqdm: bool,
) -> tuple[list[RequestOutput], float]:
    """Send each request at its arrival time (then waiting for a concurrency slot; a conversation's
    turns one after the other); return the outputs of every turn in request order and the wall time
    from the first send to the last completion."""
    semaphore = asyncio.Semaphore(max_concurrency) if max_concurrency else contextlib.nullcontext()
    total = sum(1 + len(r.follow_ups) for r in requests)
    pbar = tqdm(total=total, desc="requests", unit="req", disable=disable_tqdm)

    async def one(client: httpx.AsyncClient, request: RequestInput, at: float) -> list[RequestOutput]:
        # Sleeping until an absolute time keeps timer drift from accumulating over the schedule.
        await asyncio.sleep(at - (time.perf_counter() - start))
        prompt, outs = request.prompt, []
        native = bool(request.follow_ups)  # the next turn needs this answer's token ids
        for follow_up in [None, *request.follow_ups]:
            if follow_up is not None:
                if not outs[-1].success:
                    break
                prompt = prompt + outs[-1].output_ids + follow_up
            async with semaphore:
                outs.append(
                    await send_request(
                        client, base_url, model, prompt, request.output_len, native, request.json_schema
                    )
                )
            pbar.update(1)
        return outs

    async with make_client(timeout) as client:
        start = time.perf_counter()
        outputs = await asyncio.gather(
            *(one(client, r, float(t)) for r, t in zip(requests, arrivals, strict=True))
        )
        duration = time.perf_counter() - start
    pbar.close()
    return [o for outs in outputs for o in outs], duration


def served_model_id(base_url: str, timeout: float) -> str:
    try:
        response = httpx.get(f"{base_url}/v1/models", timeout=timeout, trust_env=False)
        response.raise_for_status()
        return response.json()["data"][0]["id"]
    except (httpx.HTTPError, ValueError, KeyError, IndexError) as e:
        raise SystemExit(f"error: cannot read the served model from {base_url}/v1/models: {e}") from e


@torch.inference_mode()
def transformers_generate(
    model: PreTrainedModel, requests: list[RequestInput], batch_size: int, pad_id: int, disable_tqdm: bool
) -> list[list[int]]:
    """Greedy-generate exactly ``output_len`` new tokens per request (eos suppressed), in left-padded batches.

    Requests are sorted by output then input length: every row of a batch runs for the batch's longest
    output, so grouping similar output lengths wastes the fewest decode steps, and similar prompt
    lengths the least padding.
    """
    order = sorted(range(len(requests)), key=lambda i: (requests[i].output_len, len(requests[i].prompt)))
    results: list[list[int]] = [[] for _ in requests]
    for first in tqdm(range(0, len(order), batch_size), desc="transformers batches", disable=disable_tqdm):
        batch = [requests[i] for i in order[first : first + batch_size]]
        width = max(len(r.prompt) for r in batch)
        input_ids = torch.full((len(batch), width), pad_id, dtype=torch.long)
        attention_mask = torch.zeros((len(batch), width), dtype=torch.long)
        for row, r in enumerate(batch):
            input_ids[row, width - len(r.prompt) :] = torch.tensor(r.prompt)
            attention_mask[row, width - len(r.prompt) :] = 1
        new_tokens = max(r.output_len for r in batch)
        sequences = model.generate(
            input_ids.to(model.device),
            attention_mask=attention_mask.to(model.device),
            do_sample=False,
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,
            pad_token_id=pad_id,
        )
        for row, i in enumerate(order[first : first + batch_size]):
            results[i] = sequences[row, width : width + requests[i].output_len].tolist()
    return results


def run_transformers_baseline(
    model_path: str,
    requests: list[RequestInput],
    batch_size: int,
    pad_id: int,
    disable_tqdm: bool,
    dtype: str = "float32",
    device: str = "cpu",
) -> dict[str, Any]:
    """Time transformers on the benchmark's requests; throughput counts requested tokens only."""
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=getattr(torch, dtype)).to(device).eval()
    transformers_generate(model, [RequestInput(requests[0].prompt, 2)], 1, pad_id, True)  # warm-up
    start = time.perf_counter()
    outputs = transformers_generate(model, requests, batch_size, pad_id, disable_tqdm)
    duration = time.perf_counter() - start  # transformers_generate's .tolist() waits for the device
    short = [i for i, (o, r) in enumerate(zip(outputs, requests, strict=True)) if len(o) != r.output_len]
    if short:
        raise RuntimeError(f"transformers generated fewer tokens than requested for requests {short}")
    input_tokens = sum(len(r.prompt) for r in requests)
    output_tokens = sum(r.output_len for r in requests)
    return {
        "backend": "transformers",
        "dtype": dtype,
        "device": device,
        "batch_size": batch_size,
        "torch_threads": torch.get_num_threads(),
        "duration": duration,
        "total_input_tokens": input_tokens,
        "total_output_tokens": output_tokens,
        "request_throughput": len(requests) / duration,
        "output_throughput": output_tokens / duration,
        "total_throughput": (input_tokens + output_tokens) / duration,
    }


def run_offline_engine(
    base_url: str, requests: list[RequestInput], max_concurrency: int | None, timeout: float
) -> dict[str, Any]:
    """The same requests through the offline Engine started with the served instance's options (from
    /get_server_info), all submitted at once, at most --max-concurrency running (split over the DP
    groups); throughput counts requested tokens only."""
    from dataclasses import fields

    from dpserve import Engine
    from dpserve.config import EngineConfig

    info = httpx.get(f"{base_url}/get_server_info", timeout=timeout, trust_env=False).json()
    options = {f.name: info[f.name] for f in fields(EngineConfig) if f.name in info}
    options |= {"dist_init_addr": None, "nnodes": 1, "node_rank": 0}  # its own ports, beside the server
    if max_concurrency:
        per_group = -(-max_concurrency // options["dp_size"])  # DP attention: divided among the groups
        options["max_running_requests"] = per_group * (
            options["dp_size"] if options["enable_dp_attention"] else 1
        )
    greedy = {"temperature": 0.0, "ignore_eos": True}
    with Engine(**options) as engine:
        engine.generate(input_ids=requests[0].prompt, sampling_params={**greedy, "max_new_tokens": 2})
        start = time.perf_counter()
        rids = [engine.submit(r.prompt, {**greedy, "max_new_tokens": r.output_len}) for r in requests]
        outputs = [engine.wait(rid) for rid in rids]
        duration = time.perf_counter() - start
    output_tokens = sum(len(o["output_ids"]) for o in outputs)
    return {
        "backend": "dpserve offline Engine",
        "max_running_requests": engine.cfg.running_per_group,
        "duration": duration,
        "total_output_tokens": output_tokens,
        "request_throughput": len(requests) / duration,
        "output_throughput": output_tokens / duration,
    }


def machine_info() -> dict[str, Any]:
    return {
        "cpu_count": os.cpu_count(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "torch": torch.__version__,
    }


def fmt(value: float | None, spec: str = ".2f") -> str:
    return "n/a" if value is None else format(value, spec)


def report(r: dict[str, Any]) -> str:
    lines = ["{s:{c}^50}".format(s=" Serving Benchmark Result ", c="=")]

    def add(label: str, value: Any) -> None:
        lines.append(f"{label + ':':<40} {value:>9}")

    def section(title: str) -> None:
        lines.append("{s:{c}^50}".format(s=title, c="-"))

    if "completed" in r:
        add("Traffic request rate", r["request_rate"])
        add("Max request concurrency", r["max_concurrency"] or "not set")
        add("Constrained requests (JSON schema)", r.get("constrained_requests", 0))
        add("Successful requests", r["completed"])
        add("Failed requests", r["failed"])
        add("Benchmark duration (s)", fmt(r["duration"]))
        add("Total input tokens", r["total_input_tokens"])
        add("Total generated tokens", r["total_output_tokens"])
        add("Request throughput (req/s)", fmt(r["request_throughput"]))
        add("Input token throughput (tok/s)", fmt(r["input_throughput"]))
        add("Output token throughput (tok/s)", fmt(r["output_throughput"]))
        add("Total token throughput (tok/s)", fmt(r["total_throughput"]))
        add("Concurrency", fmt(r["concurrency"]))
        add("Prefix cache hit rate", fmt(r["cache_hit_rate"], ".1%"))
        for name, title in (
            ("ttft", "Time to First Token"),
            ("itl", "Inter-Token Latency"),
            ("tpot", "Time per Output Token (excl. 1st token)"),
            ("e2e_latency", "End-to-End Latency"),
        ):
            section(title)
            short = "E2E" if name == "e2e_latency" else name.upper()
            for stat, label in (("mean", "Mean"), ("median", "Median"), ("p99", "P99")):
                add(f"{label} {short} (ms)", fmt(r[f"{stat}_{name}_ms"]))
    if "offline_engine" in r:
        e = r["offline_engine"]
        section(f"offline Engine (max {e['max_running_requests']} running per group)")
        add("Duration (s)", fmt(e["duration"]))
        add("Output token throughput (tok/s)", fmt(e["output_throughput"]))
        add("Output throughput served/offline", fmt(r["served_over_offline"]))
    if "baseline" in r:
        b = r["baseline"]
        section(
            f"transformers baseline ({b.get('dtype', 'float32')} on {b.get('device', 'cpu')}, "
            f"batch {b['batch_size']})"
        )
        add("Duration (s)", fmt(b["duration"]))
        add("Output token throughput (tok/s)", fmt(b["output_throughput"]))
        add("Total token throughput (tok/s)", fmt(b["total_throughput"]))
        if "output_throughput_ratio" in r:
            add("Output throughput dpserve/transformers", fmt(r["output_throughput_ratio"]))
    lines.append("=" * 50)
    return "\n".join(lines)


TABLE_COLUMNS = (
    ("dataset", "dataset_name", ""),
    ("prompts", "num_prompts", "d"),
    ("input len", "random_input_len", "d"),
    ("output len", "random_output_len", "d"),
    ("range ratio", "random_range_ratio", "g"),
    ("rate (req/s)", "request_rate", ""),
    ("max conc.", "max_concurrency", "d"),
    ("ok", "completed", "d"),
    ("failed", "failed", "d"),
    ("duration (s)", "duration", ".2f"),
    ("req/s", "request_throughput", ".2f"),
    ("input tok/s", "input_throughput", ".1f"),
    ("output tok/s", "output_throughput", ".1f"),
    ("cache hit", "cache_hit_rate", ".1%"),
    ("TTFT mean (ms)", "mean_ttft_ms", ".1f"),
    ("TTFT p99 (ms)", "p99_ttft_ms", ".1f"),
    ("ITL mean (ms)", "mean_itl_ms", ".2f"),
    ("ITL p99 (ms)", "p99_itl_ms", ".2f"),
    ("TPOT mean (ms)", "mean_tpot_ms", ".2f"),
    ("TPOT p99 (ms)", "p99_tpot_ms", ".2f"),
    ("E2E mean (ms)", "mean_e2e_latency_ms", ".1f"),
    ("E2E p99 (ms)", "p99_e2e_latency_ms", ".1f"),
    ("offline Engine tok/s", "offline_output_throughput", ".1f"),
    ("served / offline", "served_over_offline", ".2f"),
    ("transformers output tok/s", "baseline_output_throughput", ".1f"),
    ("dpserve / transformers", "output_throughput_ratio", ".2f"),
)


def markdown_table(r: dict[str, Any]) -> str:
    """A header and one row for docs/benchmarks.md; absent figures and unset limits print as -."""
    values = r | {
        "baseline_output_throughput": r.get("baseline", {}).get("output_throughput"),
        "offline_output_throughput": r.get("offline_engine", {}).get("output_throughput"),
    }
    cells = ["-" if values.get(key) is None else format(values[key], spec) for _, key, spec in TABLE_COLUMNS]
    return "\n".join(
        [
            "| " + " | ".join(title for title, _, _ in TABLE_COLUMNS) + " |",
            "|" + "---:|" * len(TABLE_COLUMNS),
            "| " + " | ".join(cells) + " |",
        ]
    )


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m dpserve.bench.serving",
        description="Online serving benchmark: random token-id prompts (uniform over the tokenizer's "
        "vocabulary less its special tokens) streamed to an OpenAI-compatible "
        "/v1/completions endpoint (greedy, ignore_eos, so each request generates exactly its output "
        "length). Reports request/token throughput and TTFT, ITL, TPOT and end-to-end latency (mean, "
        "median, p99) over the successful requests, optionally against a transformers baseline.",
        formatter_class=HelpFormatter,
    )
    p.add_argument("--base-url", default="http://127.0.0.1:30000", help="server URL, without /v1")
    p.add_argument(
        "--model", default=None, help="model name sent in requests (unset: the first id of GET /v1/models)"
    )
    p.add_argument(
        "--model-path",
        default=None,
        help="Hugging Face checkpoint directory (or a .gguf / smollm2-135m-instruct, as launch_server takes): its tokenizer gives the prompt vocabulary, and the "
        "transformers baseline loads it (unset: the served model id, if that is a local directory)",
    )
    p.add_argument("--tokenizer", default=None, help="tokenizer directory (unset: --model-path)")
    p.add_argument(
        "--dataset-name",
        choices=("random", "generated-shared-prefix", "multi-turn", "repeat", "chat"),
        default="random",
        help="workload: random prompts; groups of questions sharing a system prompt (--gsp-*); "
        "conversations whose every turn resends the history (--mt-*); or chat prompts (the model's chat "
        "template) asking to repeat a paragraph (copy-heavy) or for a story (--num-prompts prompts, "
        "--random-output-len tokens each)",
    )
    p.add_argument("--num-prompts", type=positive_int, default=100, help="number of requests (random)")
    p.add_argument("--random-input-len", type=positive_int, default=256, help="maximum prompt length L_in")
    p.add_argument(
        "--random-output-len", type=positive_int, default=64, help="maximum output length L_out (tokens)"
    )
    p.add_argument(
        "--random-range-ratio",
        type=float,
        default=0.0,
        help="each prompt and output length is drawn uniformly from the integers in [max(1, ratio * L), L] "
        "(SGLang's convention): 1.0 gives exactly L, 0.0 anything from 1 to L",
    )
    p.add_argument(
        "--request-rate",
        type=float,
        default=float("inf"),
        help="requests per second; inf sends all at once, otherwise Poisson arrivals (exponential gaps "
        "seeded by --seed)",
    )
    p.add_argument(
        "--max-concurrency",
        type=positive_int,
        default=None,
        help="most requests in flight at once; later arrivals wait for a slot (unset: no cap)",
    )
    gsp = p.add_argument_group("generated-shared-prefix")
    gsp.add_argument("--gsp-num-groups", type=positive_int, default=8, help="system prompts")
    gsp.add_argument(
        "--gsp-prompts-per-group", type=positive_int, default=8, help="questions per system prompt"
    )
    gsp.add_argument("--gsp-system-prompt-len", type=positive_int, default=512, help="system prompt tokens")
    gsp.add_argument("--gsp-question-len", type=positive_int, default=32, help="question tokens")
    gsp.add_argument("--gsp-output-len", type=positive_int, default=32, help="tokens generated per question")
    mt = p.add_argument_group("multi-turn")
    mt.add_argument("--mt-num-conversations", type=positive_int, default=16, help="conversations")
    mt.add_argument("--mt-turns", type=positive_int, default=4, help="turns per conversation")
    mt.add_argument("--mt-turn-len", type=positive_int, default=64, help="new user tokens per turn")
    mt.add_argument("--mt-output-len", type=positive_int, default=32, help="tokens generated per turn")
    p.add_argument(
        "--json-schema",
        default=None,
        metavar="FILE",
        help="structured output: requests' outputs follow the JSON schema in FILE (the server's "
        "grammar backend; the offline engine and transformers baselines run unconstrained)",
    )
    p.add_argument(
        "--constrained-fraction",
        type=float,
        default=1.0,
        help="with --json-schema: the share of requests constrained, spread evenly over them",
    )
    p.add_argument("--seed", type=int, default=0, help="seed of the prompts, lengths and arrival times")
    p.add_argument(
        "--warmup-requests",
        type=int,
        default=1,
        help="unmeasured requests (random prompts of their own) sent at once before the run; the benchmark "
        "stops if one fails",
    )
    p.add_argument("--request-timeout", type=float, default=3600.0, help="per-request HTTP timeout (s)")
    p.add_argument(
        "--baseline",
        choices=("transformers",),
        default=None,
        help="after the server run, generate the same prompts and output lengths with transformers "
        "(greedy, left-padded batches, on --baseline-device) and report dpserve's output throughput over its own",
    )
    p.add_argument(
        "--offline-engine",
        action="store_true",
        help="after the server run, run the same requests through the offline Engine with the served "
        "instance's options and report the served output throughput over the offline one",
    )
    p.add_argument(
        "--baseline-dtype",
        choices=("float32", "bfloat16"),
        default="float32",
        help="dtype transformers runs in (compare at the server's --dtype)",
    )
    p.add_argument(
        "--baseline-device",
        choices=("cpu", "cuda"),
        default="cpu",
        help="device transformers runs on (compare on the server's device)",
    )
    p.add_argument(
        "--baseline-batch-size",
        type=positive_int,
        default=None,
        help="transformers batch size (unset: --max-concurrency, or 16 without one)",
    )
    p.add_argument(
        "--skip-server",
        action="store_true",
        help="run only the baseline (with the server stopped, so it does not share the CPU)",
    )
    p.add_argument("--output-file", default=None, help="append the result as one JSON line to this file")
    p.add_argument("--disable-tqdm", action="store_true", help="no progress bars")
    args = p.parse_args(argv)
    if not 0.0 <= args.random_range_ratio <= 1.0:
        p.error("--random-range-ratio must be in [0, 1]")
    if not args.request_rate > 0:
        p.error("--request-rate must be > 0 (inf for all at once)")
    if args.warmup_requests < 0:
        p.error("--warmup-requests must be >= 0")
    if args.skip_server and args.baseline is None:
        p.error("--skip-server needs --baseline")
    if args.baseline and args.model_path is None:
        p.error("--baseline needs --model-path")
    if (args.baseline or args.offline_engine) and args.dataset_name == "multi-turn":
        p.error(
            "--baseline and --offline-engine cannot replay multi-turn (later prompts hold the server's answers)"
        )
    if args.offline_engine and args.skip_server:
        p.error("--offline-engine reads the served instance's options: it needs the server")
    # The same names launch_server takes: a .gguf file or smollm2-135m-instruct become their cached conversion.
    args.model_path = args.model_path and resolve_model_path(args.model_path)
    return args


def workload_params(args: argparse.Namespace) -> dict[str, Any]:
    """The flags of the chosen workload, for the record."""
    prefix = {"generated-shared-prefix": "gsp_", "multi-turn": "mt_"}.get(args.dataset_name, "random_")
    return {k: v for k, v in vars(args).items() if k.startswith(prefix)}


def workload(args: argparse.Namespace, token_ids: np.ndarray, tokenizer) -> list[RequestInput]:
    rng = np.random.default_rng(args.seed)
    if args.dataset_name in ("repeat", "chat"):
        return sample_text_requests(
            args.dataset_name, args.num_prompts, args.random_output_len, tokenizer, rng
        )
    if args.dataset_name == "generated-shared-prefix":
        return sample_shared_prefix_requests(
            args.gsp_num_groups,
            args.gsp_prompts_per_group,
            args.gsp_system_prompt_len,
            args.gsp_question_len,
            args.gsp_output_len,
            token_ids,
            rng,
        )
    if args.dataset_name == "multi-turn":
        return sample_multi_turn_requests(
            args.mt_num_conversations, args.mt_turns, args.mt_turn_len, args.mt_output_len, token_ids, rng
        )
    return sample_requests(
        args.num_prompts,
        args.random_input_len,
        args.random_output_len,
        args.random_range_ratio,
        token_ids,
        rng,
    )


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Run the benchmark from command-line arguments; return the result dict (also printed)."""
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    base_url = args.base_url.rstrip("/")
    model = None
    if not args.skip_server:
        model = args.model or served_model_id(base_url, args.request_timeout)
    tokenizer_path = args.tokenizer or args.model_path
    if tokenizer_path is None and model is not None and os.path.isdir(model):
        tokenizer_path = model
    if tokenizer_path is None:
        raise SystemExit("error: pass --model-path or --tokenizer (the served model id is not a directory)")
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_path)
    token_ids = prompt_token_ids(tokenizer)
    requests = workload(args, token_ids, tokenizer)
    if args.json_schema:
        schema = json.dumps(json.loads(Path(args.json_schema).read_text()))
        for i, r in enumerate(requests):  # spread evenly: request i if the fraction steps up there
            if math.floor((i + 1) * args.constrained_fraction) > math.floor(i * args.constrained_fraction):
                r.json_schema = schema
    result: dict[str, Any] = {
        "backend": "dpserve",
        "base_url": base_url,
        "model": model,
        "dataset_name": args.dataset_name,
        "num_prompts": sum(1 + len(r.follow_ups) for r in requests),
        **workload_params(args),
        "request_rate": "inf" if math.isinf(args.request_rate) else args.request_rate,  # JSON has no inf
        "max_concurrency": args.max_concurrency,
        "seed": args.seed,
        "constrained_requests": sum(r.json_schema is not None for r in requests),
        "command": shlex.join(["python", "-m", "dpserve.bench.serving", *argv]),
        "machine": machine_info(),
    }
    if not args.skip_server:
        assert model is not None
        if args.warmup_requests:
            # Prompts of their own, so that no measured prompt could hit a prefix cache the warm-up filled.
            warmup = sample_requests(
                args.warmup_requests,
                args.random_input_len,
                args.random_output_len,
                args.random_range_ratio,
                token_ids,
                np.random.default_rng([args.seed, 2]),
            )
            outs, _ = asyncio.run(
                run_requests(base_url, model, warmup, np.zeros(len(warmup)), None, args.request_timeout, True)
            )
            failed = [o.error for o in outs if not o.success]
            if failed:
                raise SystemExit(f"error: warm-up request failed: {failed[0]}")
        arrivals = arrival_times(len(requests), args.request_rate, np.random.default_rng([args.seed, 1]))
        outputs, duration = asyncio.run(
            run_requests(
                base_url,
                model,
                requests,
                arrivals,
                args.max_concurrency,
                args.request_timeout,
                args.disable_tqdm,
            )
        )
        result |= compute_metrics(outputs, duration)
        errors = [o.error for o in outputs if not o.success]
        result["errors"] = dict(Counter(errors))
        mismatched = sum(o.success and o.output_len != o.requested_len for o in outputs)
        result["output_len_mismatches"] = mismatched
        if errors:
            print(f"warning: {len(errors)} requests failed; first error: {errors[0]}", file=sys.stderr)
        if mismatched:
            print(f"warning: {mismatched} requests generated other than max_tokens tokens", file=sys.stderr)
    if args.offline_engine:
        result["offline_engine"] = run_offline_engine(
            base_url, requests, args.max_concurrency, args.request_timeout
        )
        result["served_over_offline"] = (
            result["output_throughput"] / result["offline_engine"]["output_throughput"]
        )
    if args.baseline:
        batch_size = args.baseline_batch_size or args.max_concurrency or 16
        pad_id = next(i for i in (tokenizer.pad_token_id, tokenizer.eos_token_id, 0) if i is not None)
        result["baseline"] = run_transformers_baseline(
            args.model_path,
            requests,
            batch_size,
            pad_id,
            args.disable_tqdm,
            args.baseline_dtype,
            args.baseline_device,
        )
        if "output_throughput" in result:
            result["output_throughput_ratio"] = (
                result["output_throughput"] / result["baseline"]["output_throughput"]
            )
    print(report(result))
    print(markdown_table(result))
    if args.output_file:
        with open(args.output_file, "a") as f:
            f.write(json.dumps(result) + "\n")
    return result


if __name__ == "__main__":
    main()
