"""Predicted vs measured decode step time: reads bench_one_batch --result-file lines and plans the same
layouts and batches on the cpu profile.

    python -m dpserve.bench.one_batch --model-path M --tp 2 --dp 2 --enable-dp-attention \\
        --batch-size 1 8 32 --input-len 128 --output-len 32 --kv-cache-memory-gb 0.01 --result-file R.jsonl
    python -m dpserve.plan.validate --measured R.jsonl --out docs/plan_validation.json
"""

from __future__ import annotations

import argparse
import json
import os

from dpserve.plan.layouts import Layout, moe_placement
from dpserve.plan.planner import Workload, make_plan
from dpserve.plan.profiles import get_profile


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m dpserve.plan.validate", description=__doc__.split("\n")[0])
    p.add_argument("--measured", required=True, help="bench_one_batch --result-file (JSON lines)")
    p.add_argument("--out", default=None, help="write the comparison as JSON here")
    args = p.parse_args(argv)
    with open(args.measured) as f:
        runs = [json.loads(line) for line in f if line.strip()]
    profile = get_profile("cpu")
    rows = []
    for r in runs:
        a = r["args"]
        moe = moe_placement(a.get("ep_size", 1), a.get("moe_a2a_backend", "none"))  # older files: TP MoE
        layout = Layout(r["tp_size"], r["dp_size"], a["enable_dp_attention"], moe)
        wl = Workload(a["input_len"], a["output_len"], batch_sizes=[r["batch_size"]])
        kwargs = {k: a[k] for k in ("kv_cache_memory_gb", "max_total_tokens", "dp_padding_mode")}
        # The dtype the run used; older files lack it and ran float32 (what auto meant then).
        kwargs["dtype"] = r.get("dtype", "float32")
        plan = make_plan(a["model_path"], profile, layout.num_gpus, wl, kwargs, layouts=[layout])
        step = plan.layouts[0].decode[0]
        measured = r["median_decode_latency"]
        rows.append(
            {
                "layout": layout.name,
                "ranks": layout.num_gpus,
                "cores": os.cpu_count(),
                "batch": r["batch_size"],
                "measured_ms": round(measured * 1e3, 3),
                "predicted_ms": round(step.seconds * 1e3, 3),
                "ratio": round(step.seconds / measured, 3),
                "predicted_mode": step.mode,
                "predicted_parts_ms": {k: round(v * 1e3, 3) for k, v in step.parts.items()},
            }
        )
    print("| layout | batch | measured ms | predicted ms | predicted / measured |")
    print("|---|---:|---:|---:|---:|")
    for x in rows:
        print(
            f"| {x['layout']} | {x['batch']} | {x['measured_ms']:.2f} | {x['predicted_ms']:.2f} | {x['ratio']:.2f} |"
        )
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"profile": profile.measured, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
