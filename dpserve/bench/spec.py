"""Speculative decoding benchmark: decode throughput with speculation against without, through dpserve's
Engine, on the trained MTP model of :mod:`dpserve.testing.trained_mtp` unless --model-path is given.

Measured in pairs: for each (tp, dp) layout an engine without speculation stays up while each engine with
`--steps k` runs beside it, and for every batch size the two take turns on the same batch of held-out
synthetic sequences (greedy, --output-len tokens) --repeats times, so that a slow spell of a shared
machine hits both alike. Decode time is the summed time of the steps that were not prefill (extend)
steps, timed on DP group 0's leader; the speed-up is the ratio of the median decode times. Accept length
is completion tokens over verify steps. Greedy outputs with speculation must equal those without.

    python -m dpserve.bench.spec --layouts 1,1 2,2 --steps 1 2 3 --batch-size 1 8 32
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import platform
import shlex
import statistics
import sys
from typing import Any

import torch
from tqdm import tqdm

from dpserve import Engine
from dpserve.bench.padding import parse_layout
from dpserve.cli import add_engine_args, bench_parser, engine_kwargs, positive_int
from dpserve.config import SPECULATIVE_ALGORITHMS
from dpserve.testing.trained_mtp import synthetic_sequences, trained_mtp_model

# Engine flags that --layouts, --steps and --algorithm set here.
SWEPT = ("tp_size", "dp_size", "enable_dp_attention", "speculative_algorithm", "speculative_num_steps")


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = bench_parser("dpserve.bench.spec", __doc__)
    # Without --model-path: dpserve.testing.trained_mtp's model with --trained-layers layers.
    add_engine_args(p, defaults={"log_level": "warning", "model_path": None, "dtype": "float32"})
    p.add_argument(
        "--trained-layers",
        type=positive_int,
        default=2,
        help="decoder layers of the trained model (its MTP layer is one more: 6 makes it 1/7 of the model)",
    )
    p.add_argument(
        "--layouts",
        type=parse_layout,
        nargs="+",
        default=[(1, 1), (2, 2)],
        help="tp,dp pairs (dp > 1: DP attention)",
    )
    p.add_argument(
        "--steps", type=positive_int, nargs="+", default=[1, 2, 3], help="speculative steps to compare"
    )
    p.add_argument("--algorithm", type=str.upper, default="NEXTN", choices=SPECULATIVE_ALGORITHMS)
    p.add_argument("--batch-size", type=positive_int, nargs="+", default=[1, 8, 32], help="batch sizes")
    p.add_argument("--input-len", type=positive_int, default=32, help="prompt length in tokens")
    p.add_argument("--output-len", type=positive_int, default=64, help="new tokens per request (>= 2)")
    p.add_argument(
        "--warmup-output-len", type=positive_int, default=8, help="new tokens of the warm-up batch"
    )
    p.add_argument("--repeats", type=positive_int, default=5, help="measured turns per engine and batch")
    p.add_argument("--seed", type=int, default=1, help="seed of the prompts (seed 0 is the training data)")
    p.add_argument("--result-file", default=None, help="append one JSON line per measured pair")
    args = p.parse_args(argv)
    swept = [f"--{d.replace('_', '-')}" for d in SWEPT if getattr(args, d) != p.get_default(d)]
    if swept:
        p.error(f"{', '.join(swept)}: set by --layouts, --steps and --algorithm here")
    if args.output_len < 2:
        p.error("--output-len must be >= 2 so that there is at least one decode step")
    return args


def decode_run(engine: Engine, prompts: list[list[int]], max_new_tokens: int) -> tuple[float, list[dict]]:
    """One greedy batch: its decode seconds (the non-extend steps) and outputs."""
    engine.get_step_log()  # drop earlier steps
    params = {"temperature": 0.0, "ignore_eos": True, "max_new_tokens": max_new_tokens}
    outputs = engine.generate(input_ids=prompts, sampling_params=params)
    seconds = sum(s.seconds for s in engine.get_step_log()[0] if s.kind != "extend")  # groups in lockstep
    return seconds, outputs


def run_pair(off: Engine, spec: Engine, args: argparse.Namespace, batch: int) -> dict[str, Any]:
    """Both engines take turns on the same batch; figures from the median decode times."""
    warmup = synthetic_sequences(batch, args.input_len, args.seed + 1)
    prompts = synthetic_sequences(batch, args.input_len, args.seed)
    times: dict[str, list[float]] = {"off": [], "spec": []}
    for engine in (off, spec):
        decode_run(engine, warmup, args.warmup_output_len)
    outputs: dict[str, list[dict]] = {}
    for _ in range(args.repeats):
        for name, engine in (("off", off), ("spec", spec)):
            seconds, outputs[name] = decode_run(engine, prompts, args.output_len)
            times[name].append(seconds)
    meta = [o["meta_info"] for o in outputs["spec"]]
    pairs = zip(outputs["spec"], outputs["off"], strict=True)
    mismatch = next((i for i, (a, b) in enumerate(pairs) if a["output_ids"] != b["output_ids"]), None)
    off_s, spec_s = statistics.median(times["off"]), statistics.median(times["spec"])
    tokens = batch * (args.output_len - 1)
    return {
        "batch_size": batch,
        "off_tok_s": tokens / off_s,
        "spec_tok_s": tokens / spec_s,
        "speedup": off_s / spec_s,
        "accept_length": sum(m["completion_tokens"] for m in meta)
        / max(sum(m["spec_verify_ct"] for m in meta), 1),
        "identical": mismatch is None,
        "first_mismatch": mismatch,
        "seconds": times,
    }


def table(results: list[dict[str, Any]]) -> str:
    rows = [
        "| tp | dp | batch | steps | off tok/s | spec tok/s | speed-up | accept length | identical |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|:---:|",
    ]
    for r in results:
        cells = [
            r["tp"],
            r["dp"],
            r["batch_size"],
            r["steps"],
            f"{r['off_tok_s']:.1f}",
            f"{r['spec_tok_s']:.1f}",
        ]
        cells += [f"{r['speedup']:.2f}x", f"{r['accept_length']:.2f}", "yes" if r["identical"] else "**NO**"]
        rows.append("| " + " | ".join(map(str, cells)) + " |")
    return "\n".join(rows)


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        return platform.processor() or "unknown"


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(message)s")
    if args.model_path is None:
        args.model_path = str(trained_mtp_model(num_layers=args.trained_layers))
    command = shlex.join(["python", "-m", "dpserve.bench.spec", *argv])
    machine = f"{cpu_model()}, {os.cpu_count()} cores, torch {torch.__version__}"
    print(f"command: {command}\nmachine: {machine}")
    results, mismatches = [], []
    runs = [(layout, k) for layout in args.layouts for k in args.steps]
    bar = tqdm(total=len(runs) * len(args.batch_size), desc="pairs", unit="pair")
    for tp, dp in args.layouts:
        layout = {"tp_size": tp, "dp_size": dp, "enable_dp_attention": dp > 1}
        with Engine(**(engine_kwargs(args) | layout)) as off:
            for k in args.steps:
                spec_kwargs = {"speculative_algorithm": args.algorithm, "speculative_num_steps": k}
                with Engine(**(engine_kwargs(args) | layout | spec_kwargs)) as spec:
                    for batch in args.batch_size:
                        r = {"tp": tp, "dp": dp, "steps": k, **run_pair(off, spec, args, batch)}
                        if not r["identical"]:
                            mismatches.append(
                                f"!!! tp={tp} dp={dp} steps={k} batch={batch}: greedy outputs "
                                f"differ from speculation off (request {r['first_mismatch']}) !!!"
                            )
                            tqdm.write(mismatches[-1], file=sys.stderr)
                        tqdm.write(table([r]).splitlines()[-1])
                        results.append(r)
                        if args.result_file:
                            with open(args.result_file, "a") as f:
                                f.write(json.dumps({**r, "command": command, "machine": machine}) + "\n")
                        bar.update()
    bar.close()
    print(
        f"\nmodel: {args.model_path}, {args.algorithm}, input_len {args.input_len}, output_len {args.output_len}, "
        f"dtype {off.cfg.dtype}, device {off.cfg.device}, median of {args.repeats} alternating runs"
    )
    print(table(results))
    for line in mismatches:
        print(line, file=sys.stderr)


if __name__ == "__main__":
    main()
