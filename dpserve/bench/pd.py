"""Decoding beside long prompts, co-located and disaggregated (prefill-decode disaggregation,
docs/design.md section 14), on the same cores.

    python -m dpserve.bench.pd --model-path smollm2-135m-instruct

Short chats stream their answers while long prompts arrive among them. Co-located: one instance
(tp 1) on every given core, a long prompt's prefill sharing steps with the chats' decoding.
Disaggregated: a prefill instance on the first half of the cores and a decode instance on the rest,
SGLang's router (--pd-disaggregation) in front, the KV moved by Mooncake's transfer engine. Same
requests, same arrival times, greedy; reported: the short chats' time per output token (p50, p99)
and the long prompts' time to first token, for both, side by side.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os

import numpy as np
from transformers import AutoTokenizer

from dpserve.bench.serving import RequestOutput, make_client, prompt_token_ids, send_request
from dpserve.bench.spec import cpu_model
from dpserve.engine.worker_pool import free_port
from dpserve.models.gguf import resolve_model_path
from dpserve.testing.server import RouterProcess, ServerProcess


def workload(args: argparse.Namespace, token_ids: np.ndarray) -> list[tuple[float, list[int], int, bool]]:
    """(arrival second, prompt, output tokens, long) of every request: a short chat every
    `interval` seconds, the long prompts spread evenly among them."""
    rng = np.random.default_rng(args.seed)
    reqs = [
        (i * args.interval, rng.choice(token_ids, args.short_input).tolist(), args.short_output, False)
        for i in range(args.short)
    ]
    span = args.short * args.interval
    reqs += [
        (
            (i + 0.5) * span / args.long,
            rng.choice(token_ids, args.long_input).tolist(),
            args.long_output,
            True,
        )
        for i in range(args.long)
    ]
    return sorted(reqs, key=lambda r: r[0])


async def drive(url: str, reqs: list[tuple[float, list[int], int, bool]]) -> list[tuple[RequestOutput, bool]]:
    async with make_client(600) as client:
        loop = asyncio.get_running_loop()
        start = loop.time()

        async def one(at: float, prompt: list[int], n: int, long: bool) -> tuple[RequestOutput, bool]:
            await asyncio.sleep(max(0.0, start + at - loop.time()))
            return await send_request(client, url, "", prompt, n, native=True), long

        return await asyncio.gather(*(one(*r) for r in reqs))


def figures(results: list[tuple[RequestOutput, bool]]) -> dict:
    failed = [o.error for o, _ in results if not o.success]
    if failed:
        raise RuntimeError(f"{len(failed)} request(s) failed: {failed[0]}")
    tpot = [(o.chunk_times[-1] - o.chunk_times[0]) / (o.output_len - 1) for o, long in results if not long]
    itl = [gap for o, long in results if not long for gap in o.itls]
    return {
        "tpot_ms": {q: float(np.percentile(tpot, p)) * 1e3 for q, p in (("p50", 50), ("p99", 99))},
        "itl_ms_p99": float(np.percentile(itl, 99)) * 1e3,
        "long_ttft_s": float(np.mean([o.ttft for o, long in results if long])),
        "outputs": [o.output_ids for o, _ in results],
    }


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model-path", default="smollm2-135m-instruct")
    p.add_argument("--dtype", default="float32")
    p.add_argument(
        "--cores", default=None, help="cores to use, e.g. 0,1 (default: every core this process may use)"
    )
    p.add_argument("--short", type=int, default=24, help="short chats")
    p.add_argument("--short-input", type=int, default=128)
    p.add_argument("--short-output", type=int, default=64)
    p.add_argument("--interval", type=float, default=0.5, help="seconds between short chats")
    p.add_argument("--long", type=int, default=4, help="long prompts among them")
    p.add_argument("--long-input", type=int, default=2048)
    p.add_argument("--long-output", type=int, default=4)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", action="store_true", help="print the figures as one JSON line")
    args = p.parse_args(argv)
    cores = sorted(os.sched_getaffinity(0)) if args.cores is None else [int(c) for c in args.cores.split(",")]
    if len(cores) < 2:
        p.error("disaggregation needs at least two cores: one half for prefill, the other for decode")
    model = resolve_model_path(args.model_path)
    reqs = workload(args, prompt_token_ids(AutoTokenizer.from_pretrained(model)))
    common = ("--model-path", model, "--dtype", args.dtype, "--served-model-name", "bench")
    half = len(cores) // 2
    with ServerProcess(*common, cpus=set(cores)) as colocated:
        together = figures(asyncio.run(drive(colocated.url, reqs)))
    port = free_port()
    prefill_args = ("--disaggregation-mode", "prefill", "--disaggregation-bootstrap-port", str(port))
    with (
        ServerProcess(*common, *prefill_args, cpus=set(cores[:half])) as prefill,
        ServerProcess(*common, "--disaggregation-mode", "decode", cpus=set(cores[half:])) as decode,
        RouterProcess([decode.url], "--log-level", "warn", prefill=[(prefill.url, port)]) as router,
    ):
        apart = figures(asyncio.run(drive(router.url, reqs)))
    same = together.pop("outputs") == apart.pop("outputs")
    r = {
        "machine": f"{cpu_model()}, cores {cores}",
        "model": args.model_path,
        "workload": {
            k: getattr(args, k)
            for k in ("short", "short_input", "short_output", "interval", "long", "long_input", "long_output")
        },
        "colocated": together,
        "disaggregated": apart,
        "same_outputs": same,
        "p99_tpot_ratio": together["tpot_ms"]["p99"] / apart["tpot_ms"]["p99"],
    }
    if args.json:
        print(json.dumps(r))
        return
    print(f"{r['machine']}; {args.model_path} ({args.dtype}); outputs equal: {same}")
    print(
        f"{args.short} chats ({args.short_input} -> {args.short_output} tokens, one per {args.interval} s) and "
        f"{args.long} prompts of {args.long_input} tokens among them"
    )
    print(f"{'':>16} {'TPOT p50 (ms)':>14} {'TPOT p99 (ms)':>14} {'ITL p99 (ms)':>13} {'long TTFT (s)':>14}")
    for name, f in (("co-located", together), ("disaggregated", apart)):
        print(
            f"{name:>16} {f['tpot_ms']['p50']:14.1f} {f['tpot_ms']['p99']:14.1f} {f['itl_ms_p99']:13.1f} "
            f"{f['long_ttft_s']:14.2f}"
        )
    print(f"p99 TPOT, co-located over disaggregated: {r['p99_tpot_ratio']:.2f}x")


if __name__ == "__main__":
    main()
