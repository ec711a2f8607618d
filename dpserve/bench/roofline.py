"""The floor of one decode step, measured on the machine it runs on, beside dpserve's own step.

    python -m dpserve.bench.roofline --model-path smollm2-135m-instruct --batch-size 16 --context 256

How the floor is measured and what it counts: dpserve/bench/floor.py.
"""

from __future__ import annotations

import argparse
import logging

import torch

from dpserve.bench.floor import Floor, Machine, MiB, decode_floor, engine_linears, engine_model
from dpserve.bench.one_batch import run_batch


def floor_line(floor: Floor, step_s: float | None) -> str:
    ratio = f"{step_s / floor.seconds:.2f}x the floor" if step_s else "n/a"
    measured = f"{step_s * 1e3:.2f} ms" if step_s else "n/a"
    return (
        f"batch {floor.batch}, context {floor.context:g}: floor {floor.seconds * 1e3:.2f} ms ({floor.bound}-bound: "
        f"compute {floor.compute_s * 1e3:.2f} ms, memory {floor.memory_s * 1e3:.2f} ms = "
        f"{floor.bytes / MiB:.1f} MiB at {floor.bandwidth / 1e9:.1f} GB/s); dpserve decode step {measured}: {ratio}"
    )


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    from dpserve.cli import HelpFormatter, add_engine_args, positive_int

    p = argparse.ArgumentParser(
        prog="python -m dpserve.bench.roofline",
        description=__doc__.split("\n\n")[0] + " Prints the floor, its parts, dpserve's measured decode "
        "step (median of the full-batch steps, through the Engine) and their ratio.",
        formatter_class=HelpFormatter,
    )
    add_engine_args(p, defaults={"log_level": "warning"})
    p.add_argument("--batch-size", type=positive_int, nargs="+", default=[16], help="decode batch sizes")
    p.add_argument(
        "--context", type=positive_int, default=256, help="prompt tokens per request (the KV context)"
    )
    p.add_argument("--output-len", type=positive_int, default=16, help="tokens decoded per request (>= 2)")
    p.add_argument(
        "--reps",
        type=positive_int,
        default=7,
        help="timed repetitions per measured shape (the fastest counts)",
    )
    p.add_argument("--floor-only", action="store_true", help="print the floor without starting the engine")
    args = p.parse_args(argv)
    if args.output_len < 2:
        p.error("--output-len must be >= 2 so that there is at least one decode step")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(message)s")
    model, model_cfg, cfg = engine_model(args.model_path, args.dtype, args.device)
    dtype, device = cfg.torch_dtype, cfg.device
    machine = Machine(dtype, device, args.reps)
    print(
        f"machine: {device}, {torch.get_num_threads()} threads, copy bandwidth {machine.bandwidth / 1e9:.1f} GB/s, "
        f"peak matmul {machine.peak_flops / 1e9:.0f} GFLOP/s ({dtype})"
    )
    context = args.context + args.output_len / 2  # the mean KV length over the decode steps
    floors = [decode_floor(model, model_cfg, machine, b, context) for b in args.batch_size]
    steps: dict[int, float | None] = {}
    if not args.floor_only:
        from dpserve import Engine
        from dpserve.cli import engine_kwargs

        bench_args = argparse.Namespace(**{**vars(args), "input_len": args.context, "warmup_output_len": 4})
        with Engine(**engine_kwargs(args)) as engine:
            for b in args.batch_size:
                steps[b] = run_batch(engine, bench_args, b)["median_decode_latency"]
    for floor in floors:
        print(floor_line(floor, steps.get(floor.batch)))
        print(
            "  linears by part: " + ", ".join(f"{k} {v * 1e3:.2f} ms" for k, v in sorted(floor.parts.items()))
        )
        step = steps.get(floor.batch)
        for kind, (kernel, used_s, best_s) in sorted(engine_linears(model, machine, floor.batch).items()):
            share = f", {used_s / step:.0%} of the step" if step else ""
            print(
                f"  {kind}: the engine runs {kernel}, {used_s * 1e3:.2f} ms (best kernel {best_s * 1e3:.2f} ms){share}"
            )


if __name__ == "__main__":
    main()
