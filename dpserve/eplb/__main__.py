"""What redundant experts would do for a recorded expert load, and the placement to start with.

    python -m dpserve.bench.one_batch --model-path PATH --tp 4 --dp 4 --enable-dp-attention \\
        --ep-size 4 --expert-load load.jsonl ...
    python -m dpserve.eplb --expert-load load.jsonl --ep-size 4 --ep-num-redundant-experts 4 \\
        --output placement.json

Reads the rows each expert of each MoE layer took (bench.one_batch's --expert-load lines, summed),
places `experts + R` slots over the expert-parallel ranks (dpserve/eplb/placement.py) and prints,
per MoE layer, the busiest rank's rows over the mean rank's with whole experts per rank (no EPLB)
and with the placement; `--output` writes the placement.
"""

from __future__ import annotations

import argparse
import json

from dpserve.cli import HelpFormatter, positive_int
from dpserve.eplb.placement import identity, imbalance, place, read_load


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(
        prog="python -m dpserve.eplb", description=__doc__, formatter_class=HelpFormatter
    )
    p.add_argument(
        "--expert-load", required=True, metavar="FILE", help="rows per expert, as bench.one_batch writes"
    )
    p.add_argument("--ep-size", type=positive_int, required=True, help="expert-parallel ranks (--ep-size tp)")
    p.add_argument(
        "--ep-num-redundant-experts", type=int, default=0, help="slots beyond one per expert (SGLang's name)"
    )
    p.add_argument("--nnodes", type=positive_int, default=1, help="nodes the ranks are spread over")
    p.add_argument(
        "--expert-groups",
        type=positive_int,
        default=1,
        help="the model's expert groups (DeepSeek-V3's n_group): with --nnodes > 1, groups stay whole on a node",
    )
    p.add_argument("--output", default=None, metavar="FILE", help="write the placement here (JSON)")
    p.add_argument("--json", action="store_true", help="print the figures as JSON")
    args = p.parse_args(argv)
    try:
        load = read_load(args.expert_load)
        slots = load.shape[1] + args.ep_num_redundant_experts
        placement = place(load, slots, args.ep_size, args.nnodes, args.expert_groups)
    except (OSError, ValueError) as e:
        p.error(str(e))
    before = imbalance(load, identity(*load.shape), args.ep_size).tolist()
    after = imbalance(load, placement, args.ep_size).tolist()
    saved = {
        "num_experts": load.shape[1],
        "ep_size": args.ep_size,
        "nnodes": args.nnodes,
        "num_slots": slots,
        "phy_to_log": placement.phy_to_log.tolist(),
    }
    if args.output:
        with open(args.output, "w") as f:
            json.dump(saved, f)
    if args.json:
        print(
            json.dumps({**saved, "load": load.tolist(), "imbalance_without": before, "imbalance_with": after})
        )
        return
    print(
        f"{load.shape[0]} MoE layers x {load.shape[1]} experts, {int(load.sum())} rows; {slots} slots over "
        f"{args.ep_size} ranks ({slots // args.ep_size} per rank) on {args.nnodes} node(s)"
    )
    print("busiest rank's rows over the mean rank's, per MoE layer:")
    print(f"{'layer':>6} {'whole experts':>14} {'placed':>8}")
    for layer, (b, a) in enumerate(zip(before, after, strict=True)):
        print(f"{layer:>6} {b:14.3f} {a:8.3f}")
    print(f"{'worst':>6} {max(before):14.3f} {max(after):8.3f}")


if __name__ == "__main__":
    main()
