"""What structured output costs a group leader per step: a JSON schema's compile time (cold, and a
cache hit), the time its matcher takes to fill one constrained row's token bitmask (median and p99
over a random walk through the grammar), and applying the mask to a batch of logits.

    python -m dpserve.bench.grammar --model-path smollm2-135m-instruct --json-schema schema.json
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from pathlib import Path

import torch

from dpserve.cli import HelpFormatter, positive_int
from dpserve.grammar import GrammarCache, Matcher, apply_bitmask, token_bitmask
from dpserve.models.config import ModelConfig
from dpserve.models.gguf import resolve_model_path


def measure(model_path: str, schema: str, steps: int, rows: int, seed: int) -> dict[str, float]:
    cfg = ModelConfig.load(model_path)
    cache = GrammarCache(model_path, cfg.vocab_size, cfg.eos_token_ids, capacity=4, max_whitespace=16)
    cache.get(("regex", "x")).result()  # the tokenizer and compiler are built once per leader: not timed
    start = time.perf_counter()
    compiled = cache.get(("json_schema", schema)).result()
    cold = time.perf_counter() - start
    start = time.perf_counter()
    cache.get(("json_schema", schema)).result()
    cached = time.perf_counter() - start
    cache.close()
    rng, fills = random.Random(seed), []
    matcher, bitmask = Matcher(compiled, list(cfg.eos_token_ids)), token_bitmask(1, cfg.vocab_size)
    for _ in range(steps):
        start = time.perf_counter()
        matcher.fill(bitmask, 0, [])
        fills.append(time.perf_counter() - start)
        words = bitmask[0].tolist()
        allowed = [w * 32 + b for w, bits in enumerate(words) if bits for b in range(32) if bits >> b & 1]
        token = rng.choice([t for t in allowed if t < cfg.vocab_size])
        if not matcher.accept(token) or matcher.terminated:
            matcher = Matcher(compiled, list(cfg.eos_token_ids))
    logits, masks = torch.randn(rows, cfg.vocab_size), bitmask.repeat(rows, 1)  # the walk's last mask
    apply_bitmask(logits, masks, list(range(rows)))  # the first call loads the fused CPU kernels
    start = time.perf_counter()
    for _ in range(20):
        apply_bitmask(logits, masks, list(range(rows)))
    fills.sort()
    return {
        "compile_cold_ms": cold * 1e3,
        "compile_cached_ms": cached * 1e3,
        "fill_median_us": statistics.median(fills) * 1e6,
        "fill_p99_us": fills[int(0.99 * (len(fills) - 1))] * 1e6,
        f"apply_{rows}_rows_us": (time.perf_counter() - start) / 20 * 1e6,
    }


def main(argv: list[str] | None = None) -> dict[str, float]:
    p = argparse.ArgumentParser(
        prog="python -m dpserve.bench.grammar", description=__doc__, formatter_class=HelpFormatter
    )
    p.add_argument("--model-path", required=True, help="checkpoint directory or the embedded model's name")
    p.add_argument("--json-schema", required=True, metavar="FILE", help="the JSON schema to compile and walk")
    p.add_argument("--steps", type=positive_int, default=2000, help="constrained tokens walked (fills timed)")
    p.add_argument("--rows", type=positive_int, default=16, help="logits rows the mask is applied to")
    p.add_argument("--seed", type=int, default=0, help="seed of the random walk")
    args = p.parse_args(argv)
    schema = json.dumps(json.loads(Path(args.json_schema).read_text()))
    result = measure(resolve_model_path(args.model_path), schema, args.steps, args.rows, args.seed)
    for key, value in result.items():
        print(f"{key:<24} {value:>12.1f}")
    return result


if __name__ == "__main__":
    main()
