"""Soak test: a seeded, bounded mix of requests against a running server for a while, then the
checks that nothing was lost or leaked.

    python -m dpserve.bench.soak --base-url http://127.0.0.1:30000 --duration 600 --concurrency 64

Each of `--concurrency` clients sends one request after another until `--duration` seconds passed.
The kinds: completions and chat, each streamed or not; n=2; stop strings; /generate pinned to a DP
rank; prompts near the context limit; 10% clients that disconnect mid-stream; 10% malformed or
over-limit requests (a body over --max-request-bytes when that is at most 1 MiB). Every well-formed
request asks ignore_eos with max_tokens k, so it must finish with exactly k tokens per choice (a
stop string: finish_reason stop with at most k, or length with k). At the end: every malformed
request got its 4xx, no 5xx but shedding (503 with Retry-After, after which that client waits as
told), KV used back to 0 on every DP rank, the prefix cache within the pool, each process's RSS
growth after warm-up. Exits 1 on any violation.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import random
import sys
import time
from collections import Counter, defaultdict
from dataclasses import dataclass, field

import httpx

WORDS = [
    "the",
    "a",
    "river",
    "stone",
    "light",
    "quiet",
    "north",
    "garden",
    "paper",
    "window",
    "silver",
    "morning",
    "story",
    "small",
    "old",
]
MAX_NEW = 24  # largest k of a well-formed request: keeps every request short and the mix bounded
DISCONNECT_TOKENS = 400  # a disconnecting client's request: it leaves long before this
OVER_LIMIT_MAX = 1 << 20  # over-limit bodies are sent only to a server whose limit is at most this
SETTLE_S = 60  # after the last request: how long KV may take to return to 0
KINDS = {  # kind: weight (disconnect and malformed are 10% each)
    "completion": 14,
    "completion_stream": 14,
    "chat": 12,
    "chat_stream": 12,
    "n2": 10,
    "stop": 10,
    "pinned": 10,
    "near_context": 8,
    "disconnect": 10,
    "malformed": 10,
}


@dataclass
class Server:
    """What the soak needs to know of the server, from its info endpoints."""

    url: str
    headers: dict
    model: str
    context_len: int
    dp_size: int
    max_request_bytes: int
    kv_pool: int  # the smallest DP group's KV pool, in tokens
    pids: dict[str, int]  # process name -> pid (the HTTP server and this node's ranks)


@dataclass
class Tally:
    sent: Counter = field(default_factory=Counter)
    completed: Counter = field(default_factory=Counter)
    rejected_as_expected: Counter = field(default_factory=Counter)  # malformed: their 4xx
    shed: Counter = field(default_factory=Counter)  # 503 + Retry-After
    latencies: list[float] = field(default_factory=list)
    violations: list[str] = field(default_factory=list)
    retry_after: float = 0.0  # a shed request's Retry-After: its client waits that long

    def violate(self, kind: str, message: str) -> None:
        self.violations.append(f"{kind}: {message}")


async def discover(client: httpx.AsyncClient, url: str, headers: dict) -> Server:
    info = (await client.get(f"{url}/get_server_info", headers=headers)).json()
    model = (await client.get(f"{url}/get_model_info", headers=headers)).json()
    pids = {"server": info["pid"], **{f"rank{r}": p for r, p in info["worker_pids"].items()}}
    return Server(
        url=url,
        headers=headers,
        model=info["served_model_name"],
        context_len=model["max_context_length"],
        dp_size=info["dp_size"],
        max_request_bytes=info["max_request_bytes"],
        kv_pool=min(r["max_total_num_tokens"] for r in info["dp_ranks"]),
        pids=pids,
    )


def text(rng: random.Random, words: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(words))


def malformed(rng: random.Random, srv: Server) -> tuple[str, object, int]:
    """(path, body, the status it must get): bytes bodies are sent raw."""
    cases = [
        ("/v1/completions", b"{not json", 400),
        ("/v1/completions", {"model": srv.model, "prompt": "hi", "max_tokens": 0}, 400),
        ("/v1/completions", {"model": srv.model, "prompt": "hi", "max_tokens": srv.context_len + 1}, 400),
        ("/v1/completions", {"model": "no-such-model", "prompt": "hi", "max_tokens": 1}, 404),
        ("/v1/chat/completions", {"model": srv.model, "max_tokens": 1}, 400),
        (
            "/generate",
            {"text": "hi", "sampling_params": {"max_new_tokens": 1}, "data_parallel_rank": srv.dp_size},
            400,
        ),
        (
            "/generate",
            {"input_ids": [1] * (srv.context_len + 1), "sampling_params": {"max_new_tokens": 1}},
            400,
        ),
    ]
    if srv.max_request_bytes <= OVER_LIMIT_MAX:
        cases.append(("/generate", {"text": "x" * (srv.max_request_bytes + 1)}, 413))
    return rng.choice(cases)


async def one_request(client: httpx.AsyncClient, rng: random.Random, srv: Server, tally: Tally) -> None:
    kind = rng.choices(list(KINDS), weights=list(KINDS.values()))[0]
    tally.sent[kind] += 1
    k = rng.randint(1, MAX_NEW)
    start = time.monotonic()
    tally.retry_after = 0.0
    try:
        ok = await _send(client, rng, srv, kind, k, tally)
    except httpx.HTTPError as e:
        tally.violate(kind, f"{type(e).__name__}: {e}")
        return
    if tally.retry_after:  # shed: back off as told
        await asyncio.sleep(tally.retry_after)
    if ok:
        tally.completed[kind] += 1
        if kind != "disconnect":
            tally.latencies.append(time.monotonic() - start)


async def _send(client, rng, srv: Server, kind: str, k: int, tally: Tally) -> bool:
    """Sends one request of `kind`; True when it completed as its parameters imply."""
    url, h = srv.url, srv.headers
    common = {"model": srv.model, "max_tokens": k, "ignore_eos": True, "temperature": rng.choice([0.0, 0.8])}
    if kind == "malformed":
        path, body, status = malformed(rng, srv)
        kwargs = {"content": body} if isinstance(body, bytes) else {"json": body}
        r = await client.post(f"{url}{path}", headers={**h, "content-type": "application/json"}, **kwargs)
        if r.status_code == status:
            tally.rejected_as_expected[kind] += 1
        elif r.status_code != 503 or "retry-after" not in r.headers:
            tally.violate(kind, f"{path} got {r.status_code}, expected {status}: {r.text[:200]}")
        else:
            tally.shed[kind] += 1
            tally.retry_after = float(r.headers["retry-after"])
        return False
    if kind == "disconnect":
        body = {**common, "prompt": text(rng, 8), "max_tokens": DISCONNECT_TOKENS, "stream": True}
        async with client.stream("POST", f"{url}/v1/completions", json=body, headers=h) as r:
            if r.status_code != 200:
                await r.aread()
                return _shed(r, kind, tally)
            events = 0
            async for line in r.aiter_lines():
                events += line.startswith("data: ")
                if events >= rng.randint(1, 5):
                    break  # leaving closes the connection mid-stream
        return True
    if kind in ("completion", "completion_stream", "n2", "stop"):
        body = {**common, "prompt": text(rng, rng.randint(1, 40))}
        if kind == "n2":
            body["n"] = 2
        if kind == "stop":
            body["stop"] = [rng.choice(WORDS), "\n"]
        if kind == "completion_stream":
            body |= {"stream": True, "stream_options": {"include_usage": True}}
        return await _openai(client, f"{url}/v1/completions", body, h, kind, k, tally)
    if kind in ("chat", "chat_stream"):
        body = {**common, "messages": [{"role": "user", "content": text(rng, rng.randint(1, 30))}]}
        if kind == "chat_stream":
            body |= {"stream": True, "stream_options": {"include_usage": True}}
        return await _openai(client, f"{url}/v1/chat/completions", body, h, kind, k, tally)
    # Native /generate: pinned to a DP rank, or a prompt just short of the context (or the pool).
    pin = rng.randrange(srv.dp_size) if kind == "pinned" else None
    length = rng.randint(1, 32)
    if kind == "near_context":
        length = min(srv.context_len, srv.kv_pool) - k - rng.randint(0, 4)
    params = {"max_new_tokens": k, "ignore_eos": True, "temperature": common["temperature"]}
    body = {"input_ids": [rng.randrange(10, 250) for _ in range(length)], "sampling_params": params}
    if pin is not None:
        body["data_parallel_rank"] = pin
    r = await client.post(f"{url}/generate", json=body, headers=h)
    if r.status_code != 200:
        return _shed(r, kind, tally)
    meta = r.json()["meta_info"]
    if meta["completion_tokens"] != k or meta["finish_reason"]["type"] != "length":
        tally.violate(kind, f"{meta['completion_tokens']} tokens ({meta['finish_reason']}), expected {k}")
        return False
    if pin is not None and meta["dp_rank"] != pin:
        tally.violate(kind, f"pinned to DP rank {pin}, ran on {meta['dp_rank']}")
        return False
    return True


async def _openai(client, url: str, body: dict, h: dict, kind: str, k: int, tally: Tally) -> bool:
    n = body.get("n", 1)
    if body.get("stream"):
        finish, usage, texts = {}, None, defaultdict(str)
        async with client.stream("POST", url, json=body, headers=h) as r:
            if r.status_code != 200:
                await r.aread()
                return _shed(r, kind, tally)
            async for line in r.aiter_lines():
                if not line.startswith("data: {"):
                    continue
                event = json.loads(line.removeprefix("data: "))
                usage = event.get("usage") or usage
                for c in event["choices"]:
                    texts[c["index"]] += c.get("text") or (c.get("delta") or {}).get("content") or ""
                    if c["finish_reason"]:
                        finish[c["index"]] = c["finish_reason"]
        tokens = usage["completion_tokens"] if usage else None
    else:
        r = await client.post(url, json=body, headers=h)
        if r.status_code != 200:
            return _shed(r, kind, tally)
        out = r.json()
        finish = {c["index"]: c["finish_reason"] for c in out["choices"]}
        texts = {c["index"]: c["text"] if "text" in c else c["message"]["content"] for c in out["choices"]}
        tokens = out["usage"]["completion_tokens"]
    if sorted(finish) != list(range(n)):
        tally.violate(kind, f"finish reasons for choices {sorted(finish)}, expected {n}")
        return False
    if kind == "stop":
        # A stop string ends a choice early (stop, at most k tokens, the string not in the text).
        bad = [
            i
            for i, reason in finish.items()
            if reason not in ("stop", "length")
            or any(s in texts[i] for s in body["stop"] if reason == "stop")
        ]
        if (
            bad
            or tokens is None
            or tokens > k * n
            or (all(r == "length" for r in finish.values()) and tokens != k * n)
        ):
            tally.violate(kind, f"finish {finish}, {tokens} tokens for k={k}")
            return False
        return True
    if any(reason != "length" for reason in finish.values()) or tokens != k * n:
        tally.violate(kind, f"finish {finish}, {tokens} tokens, expected {k * n} (length)")
        return False
    return True


def _shed(r: httpx.Response, kind: str, tally: Tally) -> bool:
    """A well-formed request refused: a 503 with Retry-After is load shedding (allowed), anything
    else a violation. False: the request did not complete."""
    if r.status_code == 503 and "retry-after" in r.headers:
        tally.shed[kind] += 1
        tally.retry_after = float(r.headers["retry-after"])
    else:
        tally.violate(kind, f"status {r.status_code}: {r.text[:200]}")
    return False


def rss(pids: dict[str, int]) -> dict[str, int]:
    """Resident bytes of each process (those on this machine: /proc)."""
    out = {}
    for name, pid in pids.items():
        with contextlib.suppress(OSError):
            with open(f"/proc/{pid}/status") as f:
                kib = next(line for line in f if line.startswith("VmRSS:")).split()[1]
            out[name] = int(kib) * 1024
    return out


async def metrics(client: httpx.AsyncClient, srv: Server) -> dict[str, float]:
    text_ = (await client.get(f"{srv.url}/metrics", headers=srv.headers)).text
    return {
        key: float(value)
        for key, value in (
            line.rsplit(" ", 1) for line in text_.splitlines() if line and not line.startswith("#")
        )
    }


def per_rank(m: dict[str, float], name: str) -> dict[str, float]:
    prefix = f'dpserve_{name}{{dp_rank="'
    return {k.removeprefix(prefix).split('"')[0]: v for k, v in m.items() if k.startswith(prefix)}


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    s = sorted(values)
    return s[min(len(s) - 1, int(q * len(s)))]


async def soak(args: argparse.Namespace) -> dict:
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    limits = httpx.Limits(max_connections=args.concurrency + 8)
    async with httpx.AsyncClient(timeout=args.request_timeout, limits=limits) as client:
        srv = await discover(client, args.base_url.rstrip("/"), headers)
        tally = Tally()
        start = time.monotonic()
        warm_until = start + min(args.warmup, args.duration / 3)
        deadline = start + args.duration
        rss_warm: dict[str, int] = {}

        async def client_loop(i: int) -> None:
            rng = random.Random(args.seed * 1_000_003 + i)
            while time.monotonic() < deadline:
                await one_request(client, rng, srv, tally)

        async def sample_warm_rss() -> None:
            await asyncio.sleep(max(0.0, warm_until - time.monotonic()))
            rss_warm.update(rss(srv.pids))

        rss_start = rss(srv.pids)
        warm = asyncio.create_task(sample_warm_rss())
        await asyncio.gather(*(client_loop(i) for i in range(args.concurrency)))
        await warm
        elapsed = time.monotonic() - start
        # Aborts of disconnected clients reach the schedulers after the last answer: wait for KV.
        settle = time.monotonic() + SETTLE_S
        try:
            while True:
                m = await metrics(client, srv)
                used = per_rank(m, "kv_used_tokens")
                if not any(used.values()) or time.monotonic() > settle:
                    break
                await asyncio.sleep(0.2)
        except httpx.HTTPError as e:
            tally.violate("end", f"the server stopped answering: {type(e).__name__}: {e}")
            m, used = {}, {}
        rss_end = rss(srv.pids)
        cached, pool = per_rank(m, "kv_cached_tokens"), per_rank(m, "max_total_num_tokens")
        running, queued = per_rank(m, "num_running_reqs"), per_rank(m, "num_queue_reqs")
        for r, v in used.items():  # nothing when the server is gone
            if v:
                tally.violate(
                    "end", f"DP rank {r} still holds {v:.0f} KV tokens {SETTLE_S} s after the last request"
                )
            if running[r] or queued[r]:
                tally.violate(
                    "end", f"DP rank {r}: {running[r]:.0f} running, {queued[r]:.0f} queued at the end"
                )
            if cached[r] > pool[r]:
                tally.violate("end", f"DP rank {r}: prefix cache {cached[r]:.0f} tokens > pool {pool[r]:.0f}")
        growth = {
            name: (rss_end[name] - rss_warm[name]) / rss_warm[name] * 100
            for name in rss_end
            if name in rss_warm
        }
        for name, pct in growth.items():
            if pct > args.max_rss_growth:
                tally.violate(
                    "end", f"{name} RSS grew {pct:.1f}% after warm-up (limit {args.max_rss_growth}%)"
                )
        return {
            "duration_s": round(elapsed, 1),
            "concurrency": args.concurrency,
            "seed": args.seed,
            "sent": dict(tally.sent),
            "completed": dict(tally.completed),
            "rejected_as_expected": dict(tally.rejected_as_expected),
            "shed_503": dict(tally.shed),
            "violations": tally.violations,
            "kv_used_end": used,
            "kv_cached_end": cached,
            "kv_pool": pool,
            "rss_mib": {
                name: [round(x.get(name, 0) / 2**20, 1) for x in (rss_start, rss_warm, rss_end)]
                for name in rss_end
            },
            "rss_growth_after_warmup_pct": {n: round(p, 2) for n, p in growth.items()},
            "latency_s": {"p50": percentile(tally.latencies, 0.5), "p99": percentile(tally.latencies, 0.99)},
        }


def print_report(report: dict) -> None:
    print(f"soak: {report['duration_s']} s at concurrency {report['concurrency']} (seed {report['seed']})")
    print(f"{'kind':<18}{'sent':>8}{'completed':>11}{'4xx ok':>8}{'shed':>6}")
    for kind in KINDS:
        row = [report[key].get(kind, 0) for key in ("sent", "completed", "rejected_as_expected", "shed_503")]
        print(f"{kind:<18}{row[0]:>8}{row[1]:>11}{row[2]:>8}{row[3]:>6}")
    print(f"KV used at the end per DP rank: {report['kv_used_end']}; prefix cache: {report['kv_cached_end']}")
    print("RSS MiB (start, after warm-up, end) and growth after warm-up:")
    for name, values in report["rss_mib"].items():
        print(f"  {name:<8} {values}  {report['rss_growth_after_warmup_pct'].get(name, float('nan')):+.2f}%")
    lat = report["latency_s"]
    print(f"latency of completed requests: p50 {lat['p50']:.3f} s, p99 {lat['p99']:.3f} s")
    print(f"violations: {len(report['violations'])}")
    for v in report["violations"][:20]:
        print(f"  {v}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m dpserve.bench.soak", description=__doc__.split("\n\n")[0])
    p.add_argument("--base-url", required=True)
    p.add_argument("--duration", type=float, required=True, help="seconds of traffic")
    p.add_argument("--concurrency", type=int, required=True, help="clients, each one request at a time")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--api-key", default=None, help="sent as Authorization: Bearer KEY")
    p.add_argument(
        "--warmup", type=float, default=60, help="seconds before the RSS baseline (at most duration/3)"
    )
    p.add_argument("--max-rss-growth", type=float, default=5.0, help="percent per process after warm-up")
    p.add_argument("--request-timeout", type=float, default=300)
    p.add_argument("--json", default=None, help="also write the report here")
    args = p.parse_args(argv)
    report = asyncio.run(soak(args))
    print_report(report)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)
    return 1 if report["violations"] else 0


if __name__ == "__main__":
    sys.exit(main())
