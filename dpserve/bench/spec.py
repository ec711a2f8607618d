"""Speculative decoding benchmark: decode throughput with speculation on against off, through dpserve's
Engine, on the trained MTP model of :mod:`dpserve.testing.trained_mtp` unless --model-path is given.

For each (tp, dp) layout and number of speculative steps (0: speculation off) one engine runs every batch
size: an unmeasured warm-up batch, then one batch of held-out synthetic sequences decoded greedily to
--output-len tokens. Decode throughput is the tokens after the first (which the prefill makes) over the
summed time of the steps that were not prefill (extend) steps, timed on DP group 0's leader; accept length
is completion tokens over verify steps. Greedy decoding with speculation must give exactly the tokens it
gives without, so each speculative batch is compared with the off batch of the same layout and size.

    python -m dpserve.bench.spec --layouts 1,1 2,2 --steps 0 1 2 3 --batch-size 1 8 32
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import platform
import shlex
import sys
from typing import Any

import torch
from tqdm import tqdm

from dpserve import Engine
from dpserve.bench.padding import parse_layout
from dpserve.cli import add_engine_args, engine_kwargs, positive_int
from dpserve.config import SPECULATIVE_ALGORITHMS
from dpserve.testing.trained_mtp import synthetic_sequences, trained_mtp_model

# Engine flags that --layouts, --steps and --algorithm set here.
SWEPT = (
    "tp",
    "dp",
    "enable_dp_attention",
    "speculative_algorithm",
    "speculative_num_steps",
    "speculative_num_draft_tokens",
)


def non_negative_int(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {value}")
    return value


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m dpserve.bench.spec",
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    add_engine_args(
        p,
        log_level="warning",
        default_model="dpserve.testing.trained_mtp's model with --trained-layers layers (trained once, cached)",
    )
    p.set_defaults(dtype="float32")
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
        help="tp,dp pairs; dp > 1 runs DP attention",
    )
    p.add_argument(
        "--steps",
        type=non_negative_int,
        nargs="+",
        default=[0, 1, 2, 3],
        help="speculative steps (draft tokens per request and step), 0: speculation off; run in ascending "
        "order, so that each speculative run is compared with the off run of this invocation",
    )
    p.add_argument(
        "--algorithm",
        type=str.upper,
        default="NEXTN",
        help=f"speculative algorithm of the steps > 0 (this build has {', '.join(SPECULATIVE_ALGORITHMS)})",
    )
    p.add_argument(
        "--batch-size", type=positive_int, nargs="+", default=[1, 8, 32], help="batch sizes, in order"
    )
    p.add_argument("--input-len", type=positive_int, default=32, help="prompt length in tokens")
    p.add_argument("--output-len", type=positive_int, default=64, help="new tokens per request (>= 2)")
    p.add_argument(
        "--warmup-output-len",
        type=non_negative_int,
        default=8,
        help="new tokens per request of the unmeasured warm-up batch before each batch; 0 skips it",
    )
    p.add_argument(
        "--seed",
        type=int,
        default=1,
        help="seed of the measured prompts' synthetic_sequences (seed 0 is the training data); the "
        "warm-up uses seed + 1",
    )
    p.add_argument(
        "--repeats",
        type=positive_int,
        default=3,
        help="measured runs per batch; the median decode time counts",
    )
    p.add_argument("--result-file", default=None, help="append one JSON line per measured batch")
    args = p.parse_args(argv)
    swept = [f"--{d.replace('_', '-')}" for d in SWEPT if getattr(args, d) != p.get_default(d)]
    if swept:
        p.error(f"{', '.join(swept)}: set by --layouts, --steps and --algorithm here")
    if args.output_len < 2:
        p.error("--output-len must be >= 2 so that there is at least one decode step")
    if any(args.steps) and args.algorithm not in SPECULATIVE_ALGORITHMS:
        p.error(f"--algorithm {args.algorithm} is not in this build's {SPECULATIVE_ALGORITHMS}")
    args.steps = sorted(set(args.steps))
    return args


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def run_batch(engine: Engine, args: argparse.Namespace, batch: int) -> tuple[dict[str, Any], list[list[int]]]:
    """Warm-up, then the measured batch --repeats times (the same prompts): its figures, with the median
    decode time, and every request's output ids."""
    greedy = {"temperature": 0.0, "ignore_eos": True}
    if args.warmup_output_len:
        warmup = synthetic_sequences(batch, args.input_len, args.seed + 1)
        engine.generate(
            input_ids=warmup, sampling_params={**greedy, "max_new_tokens": args.warmup_output_len}
        )
    prompts = synthetic_sequences(batch, args.input_len, args.seed)
    runs = []
    for _ in range(args.repeats):
        engine.get_step_log()  # drop the steps before this run
        outs = engine.generate(
            input_ids=prompts, sampling_params={**greedy, "max_new_tokens": args.output_len}
        )
        steps = [s for s in engine.get_step_log()[0] if s.kind != "extend"]  # groups step in lockstep
        runs.append((sum(s.seconds for s in steps), steps))
    seconds, steps = sorted(runs, key=lambda run: run[0])[len(runs) // 2]
    completion = sum(o["meta_info"]["completion_tokens"] for o in outs)
    verify_ct = sum(o["meta_info"]["spec_verify_ct"] for o in outs)
    speculative = engine.cfg.speculative_algorithm is not None
    return {
        "batch_size": batch,
        "decode_steps": len(steps),
        "verify_steps": sum(s.kind == "verify" for s in steps),
        "decode_seconds": seconds,
        "decode_throughput": batch * (args.output_len - 1) / seconds if seconds else None,
        "completion_tokens": completion,
        "spec_verify_ct": verify_ct,
        "accept_length": completion / verify_ct if speculative and verify_ct else None,
    }, [o["output_ids"] for o in outs]


def first_mismatch(a: list[list[int]], b: list[list[int]]) -> tuple[int, int] | None:
    """(request, output token) of the first difference between two batches' outputs; None if identical."""
    for i, (x, y) in enumerate(zip(a, b, strict=True)):
        if x != y:
            return i, next(
                (j for j, (u, v) in enumerate(zip(x, y, strict=False)) if u != v), min(len(x), len(y))
            )
    return None


def compare(
    r: dict[str, Any], outputs: list[list[int]], off: tuple[float | None, list[list[int]]] | None, steps: int
) -> dict[str, Any]:
    """Speedup and output identity of a batch against the off batch (throughput, outputs) of its layout."""
    if steps == 0:
        return {"speedup": 1.0 if r["decode_throughput"] else None, "identical": None, "first_mismatch": None}
    if off is None:
        return {"speedup": None, "identical": None, "first_mismatch": None}
    off_throughput, off_outputs = off
    mismatch = first_mismatch(outputs, off_outputs)
    return {
        "speedup": r["decode_throughput"] / off_throughput
        if off_throughput and r["decode_throughput"]
        else None,
        "identical": mismatch is None,
        "first_mismatch": mismatch,
    }


def fmt(value: float | None, spec: str) -> str:
    return "n/a" if value is None else format(value, spec)


def table(results: list[dict[str, Any]]) -> str:
    rows = [
        "| tp | dp | batch | steps | decode tok/s | speedup vs off | accept length | identical outputs |",
        "|---:|---:|---:|---:|---:|---:|---:|:---:|",
    ]
    for r in results:
        identical = "ref" if r["steps"] == 0 else {True: "yes", False: "**NO**", None: "n/a"}[r["identical"]]
        cells = [
            r["tp"],
            r["dp"],
            r["batch_size"],
            r["steps"],
            fmt(r["decode_throughput"], ".1f"),
            fmt(r["speedup"], ".2f"),
            fmt(r["accept_length"], ".2f"),
            identical,
        ]
        rows.append("| " + " | ".join(map(str, cells)) + " |")
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(message)s")
    if args.model_path is None:
        args.model_path = str(trained_mtp_model(num_layers=args.trained_layers))
    command = shlex.join(["python", "-m", "dpserve.bench.spec", *argv])
    cpu, cores = cpu_model(), os.cpu_count() or 1
    on_cpu = args.device == "cpu" or (
        args.device == "auto" and not torch.cuda.is_available()
    )  # as the Engine
    per_rank = ", ".join(f"tp={tp}: {max(1, cores // tp)}" for tp in sorted({tp for tp, _ in args.layouts}))
    print(f"command: {command}")
    print(f"cpu: {cpu} ({cores} cores)")
    print(
        f"torch threads: {torch.get_num_threads()} in this process"
        + (f"; per rank (cores // ranks): {per_rank}" if on_cpu else "")
    )
    off: dict[tuple[int, int, int], tuple[float | None, list[list[int]]]] = {}
    results: list[dict[str, Any]] = []
    mismatches: list[str] = []
    runs = [(tp, dp, k) for tp, dp in args.layouts for k in args.steps]
    for tp, dp, k in tqdm(runs, desc="engines", unit="engine"):
        kwargs = {**engine_kwargs(args), "tp_size": tp, "dp_size": dp, "enable_dp_attention": dp > 1}
        if k:
            kwargs |= {"speculative_algorithm": args.algorithm, "speculative_num_steps": k}
        with Engine(**kwargs) as engine:
            setup = {
                "tp": tp,
                "dp": dp,
                "steps": k,
                "algorithm": args.algorithm if k else None,
                "input_len": args.input_len,
                "output_len": args.output_len,
                "device": engine.cfg.device,
                "dtype": engine.cfg.dtype,
                "rank_threads": max(1, cores // engine.cfg.ranks_per_node) if on_cpu else None,
            }
            for batch in args.batch_size:
                r, outputs = run_batch(engine, args, batch)
                r = {**setup, **r, **compare(r, outputs, off.get((tp, dp, batch)), k)}
                if k == 0:
                    off[tp, dp, batch] = r["decode_throughput"], outputs
                elif r["identical"] is False:
                    req, tok = r["first_mismatch"]
                    mismatches.append(
                        f"!!! MISMATCH: tp={tp} dp={dp} batch={batch} steps={k} ({args.algorithm}): greedy "
                        f"outputs differ from speculation off, first at request {req}, output token {tok} !!!"
                    )
                    tqdm.write(mismatches[-1], file=sys.stderr)
                tqdm.write(
                    f"tp={tp} dp={dp} steps={k} batch={batch}: {fmt(r['decode_throughput'], '.1f')} tok/s over "
                    f"{r['decode_steps']} steps ({r['decode_seconds']:.3f} s), speedup {fmt(r['speedup'], '.2f')}, "
                    f"accept length {fmt(r['accept_length'], '.2f')}, identical {'ref' if k == 0 else r['identical']}"
                )
                results.append(r)
                if args.result_file:
                    with open(args.result_file, "a") as f:
                        f.write(json.dumps({**r, "command": command, "cpu": cpu, "args": vars(args)}) + "\n")
    print(
        f"\nmodel: {args.model_path}, input_len: {args.input_len}, output_len: {args.output_len}, "
        f"algorithm: {args.algorithm}, device: {results[0]['device']}, dtype: {results[0]['dtype']}"
    )
    print(table(results))
    for line in mismatches:
        print(line, file=sys.stderr)


if __name__ == "__main__":
    main()
