"""A decode step's linears with 8-bit weights beside bfloat16 and float32, measured side by side.

    python -m dpserve.bench.quant_linears --model-path smollm2-135m-instruct --batch-size 1 16

Every Linear of the engine's model (tp=1, the LM head aside: it stays unquantized) at the step's
rows, each distinct shape timed once and counted as often as the model has it: bfloat16 and float32
with the fastest kernel the machine offers (ATen, oneDNN on a prepacked weight, MKL's packed GEMM:
`dpserve.bench.floor.gemm_kernels`), and the kernels the engine runs for 8-bit weights on the CPU:
W8A8-INT8 (`int8_linear`: per-token int8 activations, int32 dots) and block-FP8 weight-only
(`fp8_linear`: 128 x 128 blocks widened to float32 inside the kernel), fed float32 activations.
"""

from __future__ import annotations

import argparse
from collections import Counter

import torch

from dpserve import cpu_ops
from dpserve.bench.floor import _best_seconds, engine_model, gemm_candidates
from dpserve.layers.linear import Linear
from dpserve.layers.quant import QuantSpec, block_tables, quantize
from dpserve.models.config import INT8_PER_ROW, ONLINE_FP8_BLOCK

KERNELS = ("bfloat16", "float32", "w8a8_int8", "fp8")


def quantized_kernels(rows: int, in_f: int, out_f: int) -> dict[str, object]:
    """The engine's 8-bit CPU kernels on random weights of this shape, as callables."""
    x, w = torch.randn(rows, in_f), torch.randn(out_f, in_f)
    q8, s8 = quantize(w, QuantSpec("w8a8_int8", INT8_PER_ROW))
    row_scale = s8[:, 0].contiguous()
    spec = QuantSpec("fp8", ONLINE_FP8_BLOCK)
    f8, sf = quantize(w, spec)
    _, row_block, col_block = block_tables((out_f, in_f), spec.block)
    ops = torch.ops.dpserve_cpu
    return {
        "w8a8_int8": lambda: ops.int8_linear(x, q8, row_scale, None),
        "fp8": lambda: ops.fp8_linear(x, f8, sf, row_block, col_block, None),
    }


def step_seconds(shapes: Counter, batch: int, reps: int) -> dict[str, float]:
    """Seconds of every linear of a step at `batch` rows, per kernel (the fastest of `reps` calls)."""
    total = dict.fromkeys(KERNELS, 0.0)
    for (out_f, in_f), count in shapes.items():
        for name, dtype in (("bfloat16", torch.bfloat16), ("float32", torch.float32)):
            x, w = torch.randn(batch, in_f, dtype=dtype), torch.randn(out_f, in_f, dtype=dtype)
            total[name] += count * min(_best_seconds(fn, reps) for fn in gemm_candidates(x, w).values())
        for name, fn in quantized_kernels(batch, in_f, out_f).items():
            total[name] += count * _best_seconds(fn, reps)
    return total


def main(argv: list[str] | None = None) -> None:
    from dpserve.cli import HelpFormatter, positive_int

    p = argparse.ArgumentParser(
        prog="python -m dpserve.bench.quant_linears",
        description=__doc__.split("\n\n")[0],
        formatter_class=HelpFormatter,
    )
    p.add_argument("--model-path", default="smollm2-135m-instruct", help="the model whose linears are timed")
    p.add_argument("--batch-size", type=positive_int, nargs="+", default=[16], help="rows per step")
    p.add_argument(
        "--reps", type=positive_int, default=7, help="timed calls per shape and kernel (the fastest counts)"
    )
    args = p.parse_args(argv)
    if not cpu_ops.load():
        raise SystemExit("the fused CPU kernels could not be built here: nothing to measure")
    model, _, _ = engine_model(args.model_path, "float32", "cpu")
    shapes = Counter(tuple(m.weight.shape) for m in model.modules() if isinstance(m, Linear))
    print(
        f"{args.model_path}: {sum(shapes.values())} linears, {len(shapes)} shapes; {torch.get_num_threads()} threads"
    )
    print(
        "| batch | "
        + " | ".join(f"{k} (ms)" for k in KERNELS)
        + " | int8 speed-up vs bf16 | fp8 vs bf16 | int8 vs f32 | fp8 vs f32 |"
    )
    print("|---:|" + "---:|" * (len(KERNELS) + 4))
    for batch in args.batch_size:
        t = step_seconds(shapes, batch, args.reps)
        ratios = [
            t["bfloat16"] / t["w8a8_int8"],
            t["bfloat16"] / t["fp8"],
            t["float32"] / t["w8a8_int8"],
            t["float32"] / t["fp8"],
        ]
        print(
            f"| {batch} | "
            + " | ".join(f"{t[k] * 1e3:.2f}" for k in KERNELS)
            + " | "
            + " | ".join(f"{r:.2f}x" for r in ratios)
            + " |"
        )


if __name__ == "__main__":
    main()
