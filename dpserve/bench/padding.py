"""Sweep of DP padding modes: decode step latency of sum_len, max_len and auto across global batch
sizes, (tp, dp) layouts and even / uneven spreads of the batch over the DP groups.

    python -m dpserve.bench.padding --out-dir docs            # writes a mid-size random DeepseekV2 first

For each layout and mode one engine runs every (batch size, spread) point: the batch is prefilled,
then decoded for a few steps; the latency of a point is the median of its full-batch decode steps
(forward + sampling, timed on DP group 0's leader). Prints a table, writes the results as JSON and
a PNG of each mode's latency over the best fixed mode's, with the MoE rows processed per step.
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import tempfile
from pathlib import Path

import numpy as np
from tqdm import tqdm

from dpserve import Engine
from dpserve.bench.one_batch import FIRST_PROMPT_ID
from dpserve.cli import HelpFormatter, positive_int
from dpserve.testing.tiny_models import write_tiny_model

MODES = ("sum_len", "max_len", "auto")
SPREADS = ("even", "uneven")


def parse_layout(text: str) -> tuple[int, int]:
    tp, dp = (int(x) for x in text.split(","))
    return tp, dp


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m dpserve.bench.padding",
        description=__doc__.split("\n\n")[0],
        formatter_class=HelpFormatter,
    )
    p.add_argument(
        "--model-path", default=None, help="checkpoint; default: a random deepseek_v2_mid in a temp dir"
    )
    p.add_argument(
        "--layouts", type=parse_layout, nargs="+", default=[(2, 2), (4, 2), (4, 4)], help="tp,dp pairs"
    )
    p.add_argument(
        "--batch-sizes",
        type=positive_int,
        nargs="+",
        default=[1, 2, 4, 8, 16, 32, 64],
        help="global batch sizes",
    )
    p.add_argument("--modes", choices=MODES, nargs="+", default=list(MODES), help="padding modes to time")
    p.add_argument("--input-len", type=positive_int, default=16, help="prompt tokens per request")
    p.add_argument("--decode-steps", type=positive_int, default=12, help="full-batch decode steps per point")
    p.add_argument("--rounds", type=positive_int, default=2, help="repeats of the whole sweep (median)")
    p.add_argument("--device", choices=("auto", "cpu", "cuda"), default="cpu", help="where the ranks run")
    p.add_argument(
        "--dtype",
        choices=("auto", "float32", "float16", "bfloat16"),
        default="float32",
        help="the engines' dtype (the figures in docs/benchmarks.md are float32)",
    )
    p.add_argument("--seed", type=int, default=0, help="seed of the prompts (and of the random model)")
    p.add_argument("--out-dir", default=".", help="where padding_sweep.json and padding_sweep.png go")
    p.add_argument(
        "--log-level",
        choices=("debug", "info", "warning", "error"),
        default="warning",
        help="log level of the ranks",
    )
    return p.parse_args(argv)


def spread(batch: int, dp: int, how: str) -> list[int]:
    """DP group of each request: round robin (even) or all on group 0 (as uneven as possible)."""
    return [i % dp for i in range(batch)] if how == "even" else [0] * batch


def run_point(engine: Engine, rng: np.random.Generator, args: argparse.Namespace, groups: list[int]) -> dict:
    vocab = engine.model_cfg.vocab_size
    params = {"max_new_tokens": args.decode_steps + 1, "temperature": 0.0, "ignore_eos": True}
    engine.get_step_log()
    prompts = rng.integers(FIRST_PROMPT_ID, vocab, size=(len(groups), args.input_len)).tolist()
    rids = [engine.submit(p, params, dp_rank=g) for p, g in zip(prompts, groups, strict=True)]
    for rid in rids:
        engine.wait(rid)
    steps = [s for s in engine.get_step_log()[0] if s.kind == "decode" and s.real_rows == len(groups)]
    if not steps:
        raise RuntimeError(f"no full-batch decode step for a batch of {len(groups)}")
    return {
        "latency_ms": statistics.median(s.seconds for s in steps) * 1e3,
        "mlp_rows": statistics.median(s.mlp_rows for s in steps),
        "chosen": sorted({s.padding_mode for s in steps}),
        "padded_steps": sum(s.padded for s in steps),
        "steps": len(steps),
    }


def sweep(args: argparse.Namespace, model_path: str) -> list[dict]:
    """Runs every point `--rounds` times; a point's latency is the median over the rounds."""
    rounds: dict[tuple, list[dict]] = {}
    # Each round reverses the mode order, so that a slow spell of the machine spreads over modes.
    runs = [
        (tp, dp, mode)
        for i in range(args.rounds)
        for tp, dp in args.layouts
        for mode in (args.modes if i % 2 == 0 else args.modes[::-1])
    ]
    points = [(b, how) for b in args.batch_sizes for how in SPREADS]
    bar = tqdm(total=len(runs) * len(points), desc="padding sweep", unit="point")
    for tp, dp, mode in runs:
        bar.set_postfix_str(f"tp={tp} dp={dp} {mode}")
        with Engine(
            model_path=model_path,
            tp_size=tp,
            dp_size=dp,
            enable_dp_attention=True,
            device=args.device,
            dp_padding_mode=mode,
            random_seed=args.seed,
            dtype=args.dtype,
            max_total_tokens=max(args.batch_sizes) * (args.input_len + args.decode_steps + 1),
            log_level=args.log_level,
        ) as engine:
            rng = np.random.default_rng(args.seed)
            # One unmeasured point first: the first steps of a fresh engine are slow.
            run_point(engine, rng, args, spread(dp, dp, "even"))
            for batch, how in points:
                r = run_point(engine, rng, args, spread(batch, dp, how))
                rounds.setdefault((tp, dp, mode, batch, how), []).append(r)
                bar.update()
    bar.close()
    results = []
    for (tp, dp, mode, batch, how), rs in rounds.items():
        results.append(
            {
                "tp": tp,
                "dp": dp,
                "mode": mode,
                "batch": batch,
                "spread": how,
                "latency_ms": statistics.median(r["latency_ms"] for r in rs),
                "round_latencies_ms": [r["latency_ms"] for r in rs],
                "mlp_rows": statistics.median(r["mlp_rows"] for r in rs),
                "chosen": sorted({m for r in rs for m in r["chosen"]}),
                "padded_steps": sum(r["padded_steps"] for r in rs),
                "steps": sum(r["steps"] for r in rs),
            }
        )
    return results


def add_ratios(results: list[dict]) -> None:
    """Each point's latency over the faster of sum_len and max_len at the same point."""
    by_point: dict[tuple, dict[str, float]] = {}
    for r in results:
        by_point.setdefault((r["tp"], r["dp"], r["batch"], r["spread"]), {})[r["mode"]] = r["latency_ms"]
    for r in results:
        fixed = by_point[(r["tp"], r["dp"], r["batch"], r["spread"])]
        best = min(fixed.get(m, float("inf")) for m in ("sum_len", "max_len"))
        r["ratio_vs_best_fixed"] = r["latency_ms"] / best if best != float("inf") else None
        # auto's choice judged by the fixed-mode runs alone (free of the auto run's own noise).
        chosen = r["chosen"][0] if len(r["chosen"]) == 1 else None
        r["choice_ratio"] = fixed[chosen] / best if chosen in fixed and best != float("inf") else None


def table(results: list[dict]) -> str:
    lines = [
        "| tp | dp | spread | batch | sum_len ms | max_len ms | auto ms | auto / best fixed | auto chose "
        "| chosen fixed / best | MoE rows sum_len / max_len / auto |",
        "|" + "---:|" * 4 + "---:|" * 4 + "---|---:|---:|",
    ]
    keyed = {(r["tp"], r["dp"], r["spread"], r["batch"], r["mode"]): r for r in results}
    for tp, dp, how, batch in sorted({k[:4] for k in keyed}, key=lambda k: (k[0], k[1], k[2], k[3])):
        row = {m: keyed.get((tp, dp, how, batch, m)) for m in MODES}

        def cell(mode: str, key: str, spec: str, row=row) -> str:
            r = row[mode]
            return "-" if r is None or r[key] is None else format(r[key], spec)

        chose = "+".join(row["auto"]["chosen"]) if row["auto"] else "-"
        rows = " / ".join(cell(m, "mlp_rows", "g") for m in MODES)
        cells = [tp, dp, how, batch, *(cell(m, "latency_ms", ".1f") for m in MODES)]
        cells += [
            cell("auto", "ratio_vs_best_fixed", ".3f"),
            chose,
            cell("auto", "choice_ratio", ".3f"),
            rows,
        ]
        lines.append("| " + " | ".join(map(str, cells)) + " |")
    return "\n".join(lines)


def plot(results: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    layouts = sorted({(r["tp"], r["dp"]) for r in results})
    fig, axes = plt.subplots(2, len(layouts), figsize=(5 * len(layouts), 8), squeeze=False)
    colors = {"sum_len": "tab:blue", "max_len": "tab:orange", "auto": "tab:green"}
    for col, (tp, dp) in enumerate(layouts):
        top, bottom = axes[0][col], axes[1][col]
        for mode in MODES:
            for how, style in (("even", "-"), ("uneven", "--")):
                pts = sorted(
                    (r["batch"], r["ratio_vs_best_fixed"], r["mlp_rows"])
                    for r in results
                    if (r["tp"], r["dp"], r["mode"], r["spread"]) == (tp, dp, mode, how)
                )
                if not pts:
                    continue
                xs = [p[0] for p in pts]
                label = f"{mode} ({how})"
                top.plot(xs, [p[1] for p in pts], style, marker="o", color=colors[mode], label=label)
                bottom.plot(xs, [p[2] for p in pts], style, marker="o", color=colors[mode], label=label)
        top.axhline(1.05, color="gray", linewidth=0.8, linestyle=":")
        top.set_title(f"tp={tp}, dp={dp}: decode step latency / best fixed mode")
        bottom.set_title(f"tp={tp}, dp={dp}: MoE rows per decode step")
        for ax in (top, bottom):
            ax.set_xscale("log", base=2)
            ax.set_xlabel("global batch size")
            ax.grid(True, alpha=0.3)
        bottom.set_yscale("log", base=2)
        top.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(message)s")
    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="dpserve-sweep-") as tmp:
        model_path = args.model_path or str(write_tiny_model("deepseek_v2_mid", Path(tmp) / "model"))
        results = sweep(args, model_path)
    add_ratios(results)
    (out_dir / "padding_sweep.json").write_text(
        json.dumps({"args": vars(args), "results": results}, indent=1)
    )
    plot(results, out_dir / "padding_sweep.png")
    print(table(results))
    auto = [r for r in results if r["mode"] == "auto" and r["ratio_vs_best_fixed"] is not None]
    if auto:
        worst = max(auto, key=lambda r: r["ratio_vs_best_fixed"])
        print(
            f"\nauto's worst ratio vs the best fixed mode: {worst['ratio_vs_best_fixed']:.3f} at tp={worst['tp']} "
            f"dp={worst['dp']} batch={worst['batch']} ({worst['spread']}); "
            f"median {statistics.median(r['ratio_vs_best_fixed'] for r in auto):.3f}"
        )
        choices = [r["choice_ratio"] for r in auto if r["choice_ratio"] is not None]
        if choices:
            print(
                f"auto's choice (that fixed mode's latency / the best fixed mode's): worst {max(choices):.3f}, "
                f"median {statistics.median(choices):.3f}, best mode picked at "
                f"{sum(c == 1.0 for c in choices)} of {len(choices)} points"
            )
    print(f"wrote {out_dir / 'padding_sweep.json'} and {out_dir / 'padding_sweep.png'}")


if __name__ == "__main__":
    main()
