"""Static batch latency benchmark, modelled on SGLang's bench_one_batch but run through dpserve's Engine.

For each batch size, one batch of random prompts is prefilled and then decoded to a fixed length; the
latencies come from the engine's per-step timings, so they cover the forward and sampling only. The
bytes a rank sends per step are those its collectives counted (`StepRecord.comm_bytes`), averaged
over the DP groups' leaders (every rank when each group has one rank).

    python -m dpserve.bench.one_batch --model-path /tmp/tiny_v2 --tp 2 --dp 2 --enable-dp-attention \\
        --batch-size 1 8 32 --input-len 128 --output-len 32
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import statistics
import time
from dataclasses import asdict

import numpy as np
from tqdm import tqdm

from dpserve import Engine
from dpserve.bench.floor import Machine, decode_floor, engine_model
from dpserve.cli import HelpFormatter, add_engine_args, engine_kwargs, positive_int
from dpserve.config import KV_CACHE_DTYPES

FIRST_PROMPT_ID = 3  # ids below are special tokens (bos, eos, pad) in dpserve's test checkpoints


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m dpserve.bench.one_batch",
        description="Static batch latency benchmark (prefill, decode and end-to-end) through dpserve's "
        "Engine. Prefill latency is the sum over every step in which some DP group prefilled: a batch's "
        "prompts may be spread over several steps (chunked prefill, or requests that reach the scheduler "
        "at different times), and such a step may also carry other requests' decode tokens. The decode "
        "latency is the median over the decode steps that ran the whole batch.",
        formatter_class=HelpFormatter,
    )
    add_engine_args(p, defaults={"log_level": "warning"})
    p.add_argument(
        "--batch-size", type=positive_int, nargs="+", default=[1], help="batch sizes to run, in order"
    )
    p.add_argument("--input-len", type=positive_int, default=1024, help="prompt length in tokens")
    p.add_argument(
        "--output-len",
        type=positive_int,
        default=16,
        help="new tokens per request (>= 2: the first token comes from the prefill)",
    )
    p.add_argument(
        "--warmup-output-len",
        type=int,
        default=4,
        help="new tokens per request of the unmeasured warm-up batch run before each batch size; 0 skips it",
    )
    p.add_argument(
        "--floor",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="measure this machine's floor of each decode step (dpserve.bench.roofline) and print the "
        "step's ratio to it",
    )
    p.add_argument("--result-file", default=None, help="append one JSON line per batch size to this file")
    p.add_argument(
        "--expert-load",
        default=None,
        metavar="FILE",
        help="append one JSON line per batch size to this file: the rows routed to each expert of each "
        "MoE layer during that batch's run ([layers][experts]), the input of a redundant-expert placement",
    )
    args = p.parse_args(argv)
    if args.output_len < 2:
        p.error("--output-len must be >= 2 so that there is at least one decode step")
    if args.warmup_output_len < 0:
        p.error("--warmup-output-len must be >= 0")
    return args


def check_fits(args: argparse.Namespace, engine: Engine, kv_capacity: int) -> None:
    """Exits with the numbers if a batch cannot run all at once in one DP group."""
    context_len = engine.model_cfg.context_len
    if args.input_len + args.output_len > context_len:
        raise SystemExit(
            f"error: --input-len {args.input_len} + --output-len {args.output_len} exceeds the model's "
            f"context length {context_len}"
        )
    for batch in args.batch_size:
        per_group = math.ceil(batch / args.dp_size)  # equal requests are spread evenly
        need = per_group * (args.input_len + args.output_len)
        if need > kv_capacity:
            raise SystemExit(
                f"error: batch size {batch} needs {per_group} requests x ({args.input_len} + "
                f"{args.output_len}) = {need} KV tokens per DP group, but a group holds only "
                f"{kv_capacity}; lower the batch size or raise --max-total-tokens"
            )
        if per_group > engine.cfg.running_per_group:
            raise SystemExit(
                f"error: batch size {batch} puts {per_group} requests on a DP group, more than the "
                f"{engine.cfg.running_per_group} it runs at once (--max-running-requests)"
            )


def random_prompts(rng: np.random.Generator, batch: int, length: int, vocab_size: int) -> list[list[int]]:
    return rng.integers(FIRST_PROMPT_ID, vocab_size, size=(batch, length)).tolist()


def run_batch(engine: Engine, args: argparse.Namespace, batch: int) -> dict:
    rng = np.random.default_rng(
        [args.random_seed, batch]
    )  # the prompts of a batch size do not depend on the order
    vocab = engine.model_cfg.vocab_size
    greedy = {"temperature": 0.0, "ignore_eos": True}
    if args.warmup_output_len:
        # Fresh prompts for the warm-up, so that nothing it leaves behind can favour the measured run.
        warmup = random_prompts(rng, batch, args.input_len, vocab)
        engine.generate(
            input_ids=warmup, sampling_params={**greedy, "max_new_tokens": args.warmup_output_len}
        )
    engine.get_step_log()  # drop the warm-up steps
    prompts = random_prompts(rng, batch, args.input_len, vocab)
    start = time.perf_counter()
    engine.generate(input_ids=prompts, sampling_params={**greedy, "max_new_tokens": args.output_len})
    total = time.perf_counter() - start
    logs = engine.get_step_log()
    steps = logs[0]  # all groups step in lockstep, so group 0 logs every step
    sent = [statistics.mean(s.comm_bytes for s in group_steps) for group_steps in zip(*logs, strict=True)]
    prefill = [s for s in steps if s.kind == "extend"]
    decode = [s for s in steps if s.kind == "decode" and sum(s.tokens) == batch]
    prefill_sent = [b for s, b in zip(steps, sent, strict=True) if s.kind == "extend"]
    decode_sent = [b for s, b in zip(steps, sent, strict=True) if s in decode]
    prefill_latency = sum(s.seconds for s in prefill)
    # Empty only if early requests decoded alone for the whole output length while others still waited.
    decode_latency = statistics.median(s.seconds for s in decode) if decode else None
    # Host work: the step minus the model's forward (scheduling, inputs, sampling).
    host_latency = statistics.median(s.seconds - s.forward_seconds for s in decode) if decode else None
    return {
        "batch_size": batch,
        "input_len": args.input_len,
        "output_len": args.output_len,
        "prefill_steps": len(prefill),
        "prefill_latency": prefill_latency,
        "prefill_throughput": batch * args.input_len / prefill_latency,
        "decode_steps": len(decode),
        "median_decode_latency": decode_latency,
        "median_decode_throughput": batch / decode_latency if decode else None,
        "median_decode_host_latency": host_latency,
        "median_decode_mlp_rows": statistics.median(s.mlp_rows for s in decode) if decode else None,
        "decode_padded_steps": sum(s.padded for s in decode),
        # MoE: the busiest expert-parallel rank's rows over the mean rank's (1.0 without MoE or EP)
        "mean_prefill_expert_imbalance": statistics.mean(s.expert_imbalance for s in prefill)
        if prefill
        else None,
        "mean_decode_expert_imbalance": statistics.mean(s.expert_imbalance for s in decode)
        if decode
        else None,
        # --enable-eplb: the rebalances that ended during the measured batch
        "rebalances": [asdict(s.rebalance) for s in steps if s.rebalance is not None],
        # bytes a rank sends per step (mean over the groups' leaders): median prefill step, decode step
        "median_prefill_comm_bytes": statistics.median(prefill_sent) if prefill else None,
        "median_decode_comm_bytes": statistics.median(decode_sent) if decode else None,
        # every step as group 0 logged it, with the bytes each group's leader sent
        "steps": [
            {**asdict(s), "comm_bytes_by_group": [g.comm_bytes for g in group_steps]}
            for s, group_steps in zip(steps, zip(*logs, strict=True), strict=True)
        ],
        "total_latency": total,
        "overall_throughput": (args.input_len + args.output_len) * batch / total,
    }


def fmt(value: float | None, spec: str, scale: float = 1.0) -> str:
    return "n/a" if value is None else format(value * scale, spec)


def report(r: dict) -> str:
    return "\n".join(
        [
            f"Batch size: {r['batch_size']}, input_len: {r['input_len']}, output_len: {r['output_len']}",
            f"Prefill. latency: {r['prefill_latency']:6.5f} s, "
            f"throughput: {r['prefill_throughput']:9.2f} token/s ({r['prefill_steps']} steps)",
            f"Decode.  median latency: {fmt(r['median_decode_latency'], '6.5f')} s, "
            f"median throughput: {fmt(r['median_decode_throughput'], '9.2f')} token/s "
            f"({r['decode_steps']} full-batch steps, {r['decode_padded_steps']} padded), "
            f"host work {fmt(r['median_decode_host_latency'], '6.5f')} s",
            f"Floor. {fmt(r.get('floor_latency'), '6.5f')} s measured on this machine "
            f"(dpserve.bench.roofline): the decode step is {fmt(step_over_floor(r), '.2f')}x the floor",
            f"Bytes sent per rank. prefill step: {fmt(r['median_prefill_comm_bytes'], '.0f')}, "
            f"decode step: {fmt(r['median_decode_comm_bytes'], '.0f')} (medians)",
            f"Expert load. busiest rank over the mean rank, prefill steps: "
            f"{fmt(r['mean_prefill_expert_imbalance'], '.3f')}, decode steps: "
            f"{fmt(r['mean_decode_expert_imbalance'], '.3f')} (means)",
            *rebalance_report(r["rebalances"]),
            f"Total. latency: {r['total_latency']:6.3f} s, "
            f"throughput: {r['overall_throughput']:9.2f} token/s",
        ]
    )


def rebalance_report(rebalances: list[dict]) -> list[str]:
    """A line on the batch's expert rebalances (--enable-eplb), if any ended during it."""
    if not rebalances:
        return []
    n = len(rebalances)
    moved = sum(r["bytes_moved"] for r in rebalances)
    before = statistics.mean(r["imbalance_before"] for r in rebalances)
    after = statistics.mean(r["imbalance_after"] for r in rebalances)
    return [
        f"Expert rebalances. {n} in the batch: {moved / n / 2**20:.2f} MiB between ranks and "
        f"{statistics.mean(r['seconds'] for r in rebalances) * 1e3:.1f} ms each, their windows' imbalance "
        f"{before:.3f} -> {after:.3f} (means)"
    ]


def step_over_floor(r: dict) -> float | None:
    if r.get("floor_latency") and r["median_decode_latency"]:
        return r["median_decode_latency"] / r["floor_latency"]
    return None


def table(results: list[dict]) -> str:
    header = (
        "| tp | dp | attn_tp | batch | prefill (ms) | prefill tok/s | decode step (ms) | decode host (ms) "
        "| floor (ms) | step / floor | decode tok/s | MoE rows/step | prefill KiB/rank | decode KiB/rank "
        "| KV capacity |"
    )
    rows = [header, "|" + "---:|" * 15]
    for r in results:
        cells = [
            r["tp_size"],
            r["dp_size"],
            r["attn_tp_size"],
            r["batch_size"],
            fmt(r["prefill_latency"], ".2f", 1e3),
            fmt(r["prefill_throughput"], ".1f"),
            fmt(r["median_decode_latency"], ".2f", 1e3),
            fmt(r["median_decode_host_latency"], ".2f", 1e3),
            fmt(r.get("floor_latency"), ".2f", 1e3),
            fmt(step_over_floor(r), ".2f"),
            fmt(r["median_decode_throughput"], ".1f"),
            fmt(r["median_decode_mlp_rows"], "g"),
            fmt(r["median_prefill_comm_bytes"], ".1f", 1 / 1024),
            fmt(r["median_decode_comm_bytes"], ".1f", 1 / 1024),
            r["kv_capacity"],
        ]
        rows.append("| " + " | ".join(map(str, cells)) + " |")
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(message)s")
    results = []
    floors = {}
    if args.floor:  # measured before the engine starts, so that its ranks do not share the cores
        model, model_cfg, cfg = engine_model(args.model_path, args.dtype, args.device)
        machine = Machine(cfg.torch_dtype, cfg.device)
        context = args.input_len + args.output_len / 2  # the mean KV length over the decode steps
        kv_dtype = KV_CACHE_DTYPES.get(args.kv_cache_dtype)  # None: the model's
        floors = {b: decode_floor(model, model_cfg, machine, b, context, kv_dtype) for b in args.batch_size}
    with Engine(**engine_kwargs(args)) as engine:
        info = engine.get_server_info()
        capacities = [r["max_total_num_tokens"] for r in info["dp_ranks"]]
        check_fits(args, engine, min(capacities))
        setup = {
            "tp_size": info["tp_size"],
            "dp_size": info["dp_size"],
            "attn_tp_size": info["attn_tp_size"],
            "dp_padding_mode": args.dp_padding_mode,
            "dtype": engine.cfg.dtype,
            "kv_capacity": sum(capacities),
        }
        for batch in tqdm(args.batch_size, desc="batch sizes", unit="batch"):
            r = {**setup, **run_batch(engine, args, batch)}
            if batch in floors:
                r["floor_latency"] = floors[batch].seconds
            tqdm.write(report(r))
            results.append(r)
            if args.expert_load:
                with open(args.expert_load, "a") as f:
                    f.write(
                        json.dumps({"batch_size": batch, "rows_per_expert": engine.get_expert_load()}) + "\n"
                    )
            if args.result_file:
                with open(args.result_file, "a") as f:
                    f.write(json.dumps({**r, "args": vars(args)}) + "\n")
    print(
        f"\nmodel: {args.model_path}, input_len: {args.input_len}, output_len: {args.output_len}, "
        f"dp_padding_mode: {args.dp_padding_mode}, device: {engine.cfg.device}, dtype: {engine.cfg.dtype}"
    )
    print(table(results))


if __name__ == "__main__":
    main()
