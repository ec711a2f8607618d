"""Engine start-up and shutdown: the same layout started, asked one request and shut down
`--repeats` times in one process (a test session, a notebook or a benchmark starts engine after
engine; the first start also pays the imports).

    python -m dpserve.bench.startup --model-path PATH --tp 2 --dp 2 --repeats 3

Uses only the public `Engine` API, so the file also runs against another checkout
(`PYTHONPATH=OTHER python dpserve/bench/startup.py ...`) for a before/after in one run.
"""

from __future__ import annotations

import argparse
import time

from tqdm import tqdm


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m dpserve.bench.startup", description=__doc__.split("\n\n")[0])
    p.add_argument("--model-path", required=True, help="model directory, .gguf or smollm2-135m-instruct")
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel size")
    p.add_argument("--dp", type=int, default=1, help="DP attention groups (DP attention when > 1)")
    p.add_argument("--repeats", type=int, default=3, help="engines started one after another")
    p.add_argument("--dtype", default="float32", help="weights and activations dtype")
    p.add_argument("--kv-cache-memory-gb", type=float, default=0.01, help="KV pool per rank (GiB)")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    from dpserve import Engine  # after the flags: --help stays cheap

    rows = []
    for _ in tqdm(range(args.repeats), desc="engines", unit="start"):
        t0 = time.perf_counter()
        engine = Engine(
            model_path=args.model_path,
            tp_size=args.tp,
            dp_size=args.dp,
            enable_dp_attention=args.dp > 1,
            device="cpu",
            dtype=args.dtype,
            kv_cache_memory_gb=args.kv_cache_memory_gb,
            log_level="warning",
        )
        t1 = time.perf_counter()
        engine.generate(input_ids=[5, 6, 7], sampling_params={"max_new_tokens": 4, "temperature": 0})
        t2 = time.perf_counter()
        engine.shutdown()
        rows.append((t1 - t0, t2 - t1, time.perf_counter() - t2))
    print(f"tp={args.tp} dp={args.dp} {args.model_path}")
    print("| start | start (s) | first request (s) | shutdown (s) |")
    print("|---:|---:|---:|---:|")
    for i, (start, request, stop) in enumerate(rows, 1):
        print(f"| {i} | {start:.1f} | {request:.2f} | {stop:.1f} |")


if __name__ == "__main__":
    main()
