"""KV-on-demand benchmarks: prefix caching and routing, head-of-line blocking, an oversubscribed pool.

    python -m dpserve.bench.kv routing --model-path smollm2-135m-instruct      # hit rate, TTFT per router
    python -m dpserve.bench.kv hol --base-url http://127.0.0.1:30000           # a short request behind a long one
    python -m dpserve.bench.kv oversubscribed --model-path smollm2-135m-instruct --pool 1024 --big-pool 8192

`routing` and `oversubscribed` start one server per configuration (as users start it) and run
`dpserve.bench.serving` against it; `hol` talks to a running server, so that any build can be
measured the same way.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from typing import Any

import httpx

from dpserve.bench import serving as bench_serving
from dpserve.testing.server import ServerProcess

DP_ATTENTION = ["--tp", "2", "--dp", "2", "--enable-dp-attention"]
ROUTING_CONFIGS = {
    "dp=1 (tp=1)": ["--tp", "1"],
    "cache_aware": [*DP_ATTENTION, "--load-balance-method", "cache_aware"],
    "minimum_tokens": [*DP_ATTENTION, "--load-balance-method", "minimum_tokens"],
    "round_robin": [*DP_ATTENTION, "--load-balance-method", "round_robin"],
    "no radix cache": [*DP_ATTENTION, "--disable-radix-cache"],
}
WORKLOADS = {
    "generated-shared-prefix": [
        "--dataset-name", "generated-shared-prefix", "--gsp-num-groups", "8", "--gsp-prompts-per-group", "8",
        "--gsp-system-prompt-len", "512", "--gsp-question-len", "32", "--gsp-output-len", "32",
    ],
    "multi-turn": [
        "--dataset-name", "multi-turn", "--mt-num-conversations", "16", "--mt-turns", "4",
        "--mt-turn-len", "64", "--mt-output-len", "32",
    ],
}  # fmt: skip
COLUMNS = (
    ("cache hit", "cache_hit_rate", ".1%"),
    ("TTFT mean (ms)", "mean_ttft_ms", ".0f"),
    ("TTFT p99 (ms)", "p99_ttft_ms", ".0f"),
    ("output tok/s", "output_throughput", ".1f"),
    ("duration (s)", "duration", ".1f"),
)


def serve_and_bench(model_path: str, server_flags: list[str], bench_runs: dict[str, list[str]]) -> dict:
    """Starts a server, runs bench_serving once per entry, stops the server; returns the results."""
    results = {}
    with ServerProcess("--model-path", model_path, *server_flags, timeout=900) as server:
        for name, flags in bench_runs.items():
            argv = ["--base-url", server.url, "--model-path", model_path, "--disable-tqdm", *flags]
            before = server_counters(server.url)
            results[name] = bench_serving.main(argv)
            after = server_counters(server.url)
            results[name] |= {k: after[k] - before[k] for k in after}
            results[name]["server_flags"] = server_flags
    return results


def server_counters(base_url: str) -> dict[str, float]:
    """Retractions and prefix-cache figures summed over the DP ranks, from /metrics."""
    wanted = {
        "dpserve_retractions_total": "retractions",
        "dpserve_prefix_cache_hit_tokens_total": "hit_tokens",
    }
    sums = dict.fromkeys(wanted.values(), 0.0)
    for line in httpx.get(f"{base_url}/metrics", trust_env=False).text.splitlines():
        name = line.split("{")[0]
        if name in wanted:
            sums[wanted[name]] += float(line.rsplit(" ", 1)[1])
    return sums


def table(rows: dict[str, dict[str, dict]], columns=COLUMNS) -> str:
    lines = []
    for workload in next(iter(rows.values())):
        lines += [f"\n{workload}\n", "| configuration | " + " | ".join(c[0] for c in columns) + " |"]
        lines.append("|---|" + "---:|" * len(columns))
        for config, results in rows.items():
            r = results[workload]
            cells = ["-" if r.get(k) is None else format(r[k], spec) for _, k, spec in columns]
            lines.append(f"| {config} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def routing(args: argparse.Namespace) -> dict:
    bench = {
        name: [
            *flags,
            "--request-rate",
            str(args.request_rate),
            "--max-concurrency",
            str(args.max_concurrency),
        ]
        for name, flags in WORKLOADS.items()
    }
    rows = {name: serve_and_bench(args.model_path, flags, bench) for name, flags in ROUTING_CONFIGS.items()}
    print(table(rows))
    return rows


async def _chat(client: httpx.AsyncClient, url: str, model: str, content: str, extra: dict) -> dict:
    start = time.perf_counter()
    r = await client.post(
        url, json={"model": model, "messages": [{"role": "user", "content": content}], **extra}
    )
    r.raise_for_status()
    return {
        "seconds": time.perf_counter() - start,
        "completion_tokens": r.json()["usage"]["completion_tokens"],
    }


async def _hol(base_url: str, model: str, long_tokens: int | None) -> dict:
    url = f"{base_url}/v1/chat/completions"
    # No max_tokens, as most clients send; ignore_eos so that the long request runs its whole budget.
    long_extra = {"ignore_eos": True, "temperature": 0} | ({"max_tokens": long_tokens} if long_tokens else {})
    short_extra = {"max_tokens": 8, "temperature": 0}
    async with httpx.AsyncClient(timeout=3600, trust_env=False) as client:
        alone = await _chat(client, url, model, "Say hi", short_extra)
        long_task = asyncio.create_task(_chat(client, url, model, "Write a long story.", long_extra))
        while True:  # the long request is running once the server reports it
            info = (await client.get(f"{base_url}/get_server_info")).json()
            if sum(r.get("running", 0) for r in info["dp_ranks"]):
                break
            await asyncio.sleep(0.05)
        behind = await _chat(client, url, model, "Say hi", short_extra)
        long = await long_task
    return {"short_alone_s": alone["seconds"], "short_behind_long_s": behind["seconds"], "long": long}


def hol(args: argparse.Namespace) -> dict:
    model = bench_serving.served_model_id(args.base_url, 60)
    result = asyncio.run(_hol(args.base_url.rstrip("/"), model, args.long_max_tokens))
    print(json.dumps(result, indent=2))
    return result


def oversubscribed(args: argparse.Namespace) -> dict:
    flags = [
        "--num-prompts", str(args.num_prompts), "--random-input-len", "128", "--random-output-len", "128",
        "--random-range-ratio", "1.0", "--request-rate", "inf",
    ]  # fmt: skip
    rows = {
        f"pool {pool} per group": serve_and_bench(
            args.model_path, [*DP_ATTENTION, "--max-total-tokens", str(pool)], {"random": flags}
        )
        for pool in (args.pool, args.big_pool)
    }
    print(table(rows, (*COLUMNS[1:], ("retractions", "retractions", ".0f"), ("failed", "failed", "d"))))
    return rows


def main(argv: list[str] | None = None) -> Any:
    p = argparse.ArgumentParser(prog="python -m dpserve.bench.kv", description=__doc__.split("\n")[0])
    sub = p.add_subparsers(dest="command", required=True)
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--output-file", default=None, help="write the results as JSON")
    r = sub.add_parser("routing", parents=[common], help="shared-prefix and multi-turn workloads per router")
    r.add_argument("--model-path", default="smollm2-135m-instruct")
    r.add_argument("--request-rate", type=float, default=float("inf"))
    r.add_argument("--max-concurrency", type=int, default=16)
    h = sub.add_parser("hol", parents=[common], help="latency of a short request alone and behind a long one")
    h.add_argument("--base-url", default="http://127.0.0.1:30000")
    h.add_argument("--long-max-tokens", type=int, default=None, help="unset: no max_tokens, as chat clients")
    o = sub.add_parser(
        "oversubscribed", parents=[common], help="the same request set with a small and a big KV pool"
    )
    o.add_argument("--model-path", default="smollm2-135m-instruct")
    o.add_argument("--pool", type=int, default=1024, help="KV tokens per DP group (4x too small)")
    o.add_argument("--big-pool", type=int, default=8192, help="KV tokens per DP group (enough for all)")
    o.add_argument("--num-prompts", type=int, default=32)
    args = p.parse_args(argv)
    result = {"routing": routing, "hol": hol, "oversubscribed": oversubscribed}[args.command](args)
    if args.output_file:
        with open(args.output_file, "w") as f:
            json.dump(result, f, indent=1)
    return result


if __name__ == "__main__":
    main()
