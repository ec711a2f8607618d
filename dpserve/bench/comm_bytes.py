"""Bytes per rank counted by a started engine beside the planner's, per kind of step, from the
`--result-file` of `python -m dpserve.bench.one_batch` (its first line: one batch size):

    python -m dpserve.bench.comm_bytes tp.jsonl ep.jsonl ep_a2a.jsonl

Steps where every DP group ran the same tokens are grouped by (kind, tokens per group); counted:
`StepRecord.comm_bytes` of each group's leader; planned: `dpserve.plan.comm.forward_bytes` of the
same layout (all_to_all's unpadded steps with a uniform routing, as the planner assumes).
"""

from __future__ import annotations

import argparse
import json
import statistics
from types import SimpleNamespace

from dpserve.cli import engine_kwargs
from dpserve.config import EngineConfig
from dpserve.models.config import ModelConfig
from dpserve.plan.comm import forward_bytes, logged_layout
from dpserve.plan.layouts import meta_model


def rows(path: str) -> list[str]:
    with open(path) as f:
        r = json.loads(f.readline())
    cfg = EngineConfig(**engine_kwargs(argparse.Namespace(**r["args"])))
    model = meta_model(ModelConfig.load(cfg.model_path, cfg.quantization), cfg)
    kinds: dict[tuple, list] = {}
    for s in r["steps"]:
        step = SimpleNamespace(**{**s, "tokens": tuple(s["tokens"]), "logit_rows": tuple(s["logit_rows"])})
        if len(set(step.tokens)) == 1:
            counted = step.comm_bytes_by_group
            planned = [
                forward_bytes(model, logged_layout(step, g, cfg.attn_tp_size)) for g in range(len(counted))
            ]
            kinds.setdefault((step.kind, step.tokens), []).append((counted, planned, step.seconds))
    out = []
    for (kind, tokens), steps in kinds.items():
        counted = [c for step in steps for c in step[0]]
        planned = sorted({p for step in steps for p in step[1]})
        out.append(
            f"| {path} | {kind} {tokens} | {len(steps)} | {statistics.mean(counted):,.0f} "
            f"({min(counted):,}-{max(counted):,}) | {', '.join(f'{p:,}' for p in planned)} "
            f"| {statistics.median(step[2] for step in steps) * 1e3:.0f} |"
        )
    return out


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(
        prog="python -m dpserve.bench.comm_bytes", description=__doc__.split("\n\n")[0]
    )
    p.add_argument("result_files", nargs="+", help="one_batch --result-file outputs")
    args = p.parse_args(argv)
    print(
        "| run | step (tokens per group) | steps | bytes sent per rank: mean over the leaders (min-max) "
        "| planned | step ms (median) |"
    )
    print("|---|---|---:|---:|---:|---:|")
    for path in args.result_files:
        print("\n".join(rows(path)))


if __name__ == "__main__":
    main()
