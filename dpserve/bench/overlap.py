"""Overlap scheduling against the sequential loop (--disable-overlap-schedule), through dpserve's
Engine: two engines of the same model stay up and take turns on the same batch (greedy,
--output-len tokens each, ignore_eos) --repeats times, so that a slow spell of a shared machine hits
both alike. From DP group 0's step log, per decode step: the whole step, the forward, the host's
part on the rank's thread (step minus forward) and the processing of the samples (beside the next
forward under overlap); the throughput is completion tokens over the batch's wall time. The two
loops' outputs must be equal.

    python -m dpserve.bench.overlap --model-path smollm2-135m-instruct --batch-size 16 --repeats 3
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

from dpserve import Engine
from dpserve.cli import add_engine_args, bench_parser, engine_kwargs, positive_int
from dpserve.testing.reference import random_prompts

FIGURES = ("tok/s", "step ms", "forward ms", "host ms", "processing ms")


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = bench_parser("dpserve.bench.overlap", __doc__)
    add_engine_args(p, defaults={"log_level": "warning"})
    p.add_argument("--batch-size", type=positive_int, default=16, help="prompts generated together")
    p.add_argument(
        "--input-len", type=positive_int, default=128, help="the longest prompt (random, distinct lengths)"
    )
    p.add_argument("--output-len", type=positive_int, default=64, help="greedy tokens per prompt")
    p.add_argument("--repeats", type=positive_int, default=3, help="turns of each loop")
    return p.parse_args(argv)


def run_once(engine: Engine, prompts: list[list[int]], output_len: int) -> tuple[list, dict[str, float]]:
    """One batch: its outputs and the figures of its decode steps (means over the steps)."""
    engine.get_step_log()
    start = time.perf_counter()
    outs = engine.generate(
        input_ids=prompts,
        sampling_params={"max_new_tokens": output_len, "temperature": 0.0, "ignore_eos": True},
    )
    wall = time.perf_counter() - start
    decode = [r for r in engine.get_step_log()[0] if r.kind == "decode"]
    if not decode:
        raise SystemExit("no decode step was logged: raise --output-len")
    figures = {
        "tok/s": sum(o["meta_info"]["completion_tokens"] for o in outs) / wall,
        "step ms": 1e3 * statistics.mean(r.seconds for r in decode),
        "forward ms": 1e3 * statistics.mean(r.forward_seconds for r in decode),
        "host ms": 1e3 * statistics.mean(r.seconds - r.forward_seconds for r in decode),
        "processing ms": 1e3 * statistics.mean(r.process_seconds for r in decode),
    }
    return [o["output_ids"] for o in outs], figures


def main(argv: list[str] | None = None) -> None:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    kwargs = {k: v for k, v in engine_kwargs(args).items() if k != "disable_overlap_schedule"}
    engines: dict[str, Engine] = {}
    try:
        for name in ("overlap", "sequential"):
            engines[name] = Engine(**kwargs, disable_overlap_schedule=name == "sequential")
        vocab = engines["overlap"].model_cfg.vocab_size
        prompts = random_prompts(
            vocab, args.batch_size, seed=0, min_len=max(3, args.input_len // 2), max_len=args.input_len
        )
        runs: dict[str, list[dict[str, float]]] = {name: [] for name in engines}
        outputs = {}
        for _ in range(args.repeats):
            for name, engine in engines.items():
                outputs[name], figures = run_once(engine, prompts, args.output_len)
                runs[name].append(figures)
        if outputs["overlap"] != outputs["sequential"]:
            raise SystemExit("the two loops' greedy outputs differ")
    finally:
        for engine in engines.values():
            engine.shutdown()
    print(
        f"batch {args.batch_size}, prompts up to {args.input_len} tokens, {args.output_len} greedy tokens each; "
        f"medians of {args.repeats} turns (each turn's figures: means over its decode steps)"
    )
    print("| loop | " + " | ".join(FIGURES) + " |")
    print("|---|" + "---:|" * len(FIGURES))
    for name, figures in runs.items():
        print(
            f"| {name} | "
            + " | ".join(f"{statistics.median(f[k] for f in figures):.2f}" for k in FIGURES)
            + " |"
        )
    print("outputs: equal")


if __name__ == "__main__":
    main()
