"""python -m dpserve.plan: memory and speed of every layout of a model on some GPUs, before booking them.

python -m dpserve.plan --model deepseek-v3 --device-profile h200 --num-gpus 16 --nnodes 2
python -m dpserve.plan --model-path /models/DeepSeek-V2-Lite --device-profile h100 --num-gpus 8 --json
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import fields
from typing import TYPE_CHECKING

from dpserve.cli import HelpFormatter, add_engine_args, engine_kwargs
from dpserve.config import EngineConfig
from dpserve.plan.model import BUNDLED
from dpserve.plan.profiles import MAX_AGE, PROFILES

if TYPE_CHECKING:
    from dpserve.plan.layouts import Layout
    from dpserve.plan.planner import Plan

# The engine options the planner's figures depend on.
PLANNED_OPTIONS = (
    "dtype",
    "quantization",
    "ep_num_redundant_experts",
    "mem_fraction_static",
    "kv_cache_memory_gb",
    "kv_cache_dtype",
    "max_total_tokens",
    "max_running_requests",
    "chunked_prefill_size",
    "dp_padding_mode",
    "cuda_graph_max_bs",
    "disable_cuda_graph",
    "enable_dp_lm_head",
    "moe_dense_tp_size",
    "swa_full_tokens_ratio",
    "disable_hybrid_swa_memory",
)


def add_plan_args(p: argparse.ArgumentParser, engine_flags: bool = True) -> None:
    hw = p.add_argument_group("hardware")
    hw.add_argument(
        "--device-profile",
        default=None,
        choices=PROFILES,
        help="h100, h200, a100-80g, b200: published figures; cpu: measured on this machine (cached in "
        "~/.cache/dpserve/cpu_profile.json; --remeasure to redo). Default: cpu with --device cpu, else h100",
    )
    hw.add_argument(
        "--gpu-memory-gb", type=float, default=None, help="override the profile's memory per GPU (GiB)"
    )
    hw.add_argument(
        "--remeasure",
        action="store_true",
        help="measure the cpu profile again now (best on a quiet machine: load lengthens the measured "
        f"times); it is measured again without this flag when the cache is older than {MAX_AGE.days} days "
        "or comes from another torch version, CPU model or core count",
    )
    hw.add_argument(
        "--moe-kernel",
        default="engine",
        choices=("engine", "dense"),
        help="how the MoE reads experts: engine: as dpserve runs (only the chosen experts: the fused "
        "grouped GEMM on GPU, eager and in CUDA graphs alike); dense: every expert on every row",
    )
    wl = p.add_argument_group("workload")
    wl.add_argument("--input-len", type=int, default=1024, help="prompt tokens per request")
    wl.add_argument("--output-len", type=int, default=256, help="output tokens per request")
    wl.add_argument("--concurrency", type=int, default=None, help="requests in flight over all GPUs")
    wl.add_argument(
        "--request-rate", type=float, default=None, help="requests/s (concurrency by Little's law)"
    )
    wl.add_argument("--tpot-ms", type=float, default=None, help="target time per output token (ms)")
    wl.add_argument("--batch-size", type=int, nargs="+", default=None, help="decode batches to predict")
    out = p.add_argument_group("output")
    out.add_argument("--json", action="store_true", help="print the plan as JSON (schema dpserve.plan/1)")
    out.add_argument("--markdown", action="store_true", help="a markdown table instead of rich's")
    out.add_argument(
        "--plot", default=None, metavar="FILE.png", help="latency-throughput frontier per layout"
    )


def layout_arg(spec: str) -> Layout:
    """--layout's TP:DP[:attn][:ep|:ep-a2a], e.g. 8:2:attn (tp 8, dp 2, DP attention), 8:1, or
    16:16:attn:ep-a2a (expert parallelism with all_to_all dispatch)."""
    from dpserve.plan.layouts import MOE_PLACEMENTS, Layout

    parts = spec.split(":")
    numbers, rest = parts[:2], parts[2:]
    attn = rest[:1] == ["attn"]
    moe = rest[attn:]
    if (
        len(numbers) < 2
        or not all(n.isdigit() and int(n) > 0 for n in numbers)
        or len(moe) > 1
        or moe[:1] not in ([], ["ep"], ["ep-a2a"])
    ):
        raise argparse.ArgumentTypeError(
            f"{spec!r}: expected TP:DP[:attn][:ep|:ep-a2a], e.g. 8:2:attn, 8:1 or 16:16:attn:ep-a2a"
        )
    return Layout(int(numbers[0]), int(numbers[1]), attn, moe[0] if moe else MOE_PLACEMENTS[0])


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m dpserve.plan",
        description="For every layout (tp, dp, with and without DP attention, replicas) of a model on N GPUs: "
        "weights and KV per rank, KV tokens per group and in all, the concurrency that fits, predicted decode "
        "step time and throughput over batch sizes (with the padding mode auto picks) and prefill time per "
        "chunk; recommendations per objective. Memory figures come from the engine's own code.",
        formatter_class=HelpFormatter,
    )
    m = p.add_argument_group("model")
    src = m.add_mutually_exclusive_group(required=True)
    src.add_argument("--model", choices=BUNDLED, help="a bundled config (published architecture numbers)")
    src.add_argument(
        "--model-path",
        help="a Hugging Face directory, its config.json, what launch_server takes, or a bundled name",
    )
    m.add_argument("--device", default=None, choices=["cpu", "cuda"], help="default: from the profile")
    par = p.add_argument_group("layouts")
    par.add_argument(
        "--num-gpus", type=int, default=None, help="GPUs (CPU: ranks) in all; default 8 (cpu: 4)"
    )
    par.add_argument("--nnodes", type=int, default=1, help="nodes the GPUs are spread over")
    par.add_argument(
        "--layout",
        nargs="+",
        type=layout_arg,
        default=None,
        metavar="TP:DP[:attn][:ep|:ep-a2a]",
        help="only these layouts, e.g. 8:2:attn 8:1 16:16:attn:ep-a2a (ep: --ep-size TP, ep-a2a: also "
        "--moe-a2a-backend all_to_all; default: every layout of --num-gpus, a MoE model's DP attention "
        "ones also with ep and ep-a2a)",
    )
    par.add_argument(
        "--pd",
        nargs=2,
        type=layout_arg,
        default=None,
        metavar=("PREFILL", "DECODE"),
        help="prefill-decode disaggregation: a prefill instance of layout PREFILL and a decode instance "
        "of layout DECODE, each on its own GPUs (--nnodes: each side's nodes): what each side holds and "
        "keeps up with, and the KV one request moves (with --request-rate, the bandwidth it takes)",
    )
    add_engine_args(p, only=PLANNED_OPTIONS)  # as launch_server takes them
    add_plan_args(p)
    return p


def make(args: argparse.Namespace, options: dict, model: str, layouts: list[Layout] | None = None) -> Plan:
    """The plan, after saying where a measured (cpu) profile comes from."""
    from dpserve.plan.planner import Workload, make_plan
    from dpserve.plan.profiles import get_profile, provenance_lines

    name = args.device_profile or ("cpu" if getattr(args, "device", None) == "cpu" else "h100")
    profile = get_profile(name, remeasure=args.remeasure)
    for line in provenance_lines(profile):
        print(line, file=sys.stderr if args.json else sys.stdout)  # --json keeps stdout JSON
    options = {k: v for k, v in options.items() if k != "device"}  # the profile's device
    num_gpus = getattr(args, "num_gpus", None) or (
        layouts[0].num_gpus if layouts else (4 if profile.is_cpu else 8)
    )
    wl = Workload(
        args.input_len, args.output_len, args.concurrency, args.request_rate, args.tpot_ms, args.batch_size
    )
    gpu_mem = int(args.gpu_memory_gb * 2**30) if args.gpu_memory_gb else None
    return make_plan(model, profile, num_gpus, wl, options, args.nnodes, gpu_mem, layouts, args.moe_kernel)


def show(plan: Plan, args: argparse.Namespace) -> None:
    from dpserve.plan import report

    if args.json:
        print(report.dumps(plan))
    else:
        print(report.render_text(plan, use_rich=not args.markdown))


def run(args: argparse.Namespace, options: dict, model: str, layouts: list[Layout] | None = None) -> int:
    if args.plot:
        try:
            import matplotlib  # noqa: F401  (checked before planning, which takes a while)
        except ImportError:
            print(
                'error: --plot needs matplotlib: pip install matplotlib (or pip install -e ".[bench]")',
                file=sys.stderr,
            )
            return 2
    plan = make(args, options, model, layouts)
    show(plan, args)
    if args.plot:
        from dpserve.plan.report import plot

        plot(plan, args.plot)
    return 0


def dry_run(cfg: EngineConfig, device_profile: str | None) -> int:
    """launch_server --dry-run: the plan of that one layout, with its engine options; exit code 2 and
    the reason when that layout cannot run."""
    from dpserve.plan.layouts import Layout, moe_placement
    from dpserve.plan.report import reason, runs

    args = build_parser().parse_args(["--model-path", cfg.model_path, "--nnodes", str(cfg.nnodes)])
    args.device_profile = device_profile or ("cpu" if cfg.device == "cpu" else "h100")
    moe = moe_placement(cfg.ep_size, cfg.moe_a2a_backend)
    layout = Layout(cfg.tp_size, cfg.dp_size, cfg.enable_dp_attention, moe)
    planned = ("model_path", "tp_size", "dp_size", "enable_dp_attention", "ep_size", "moe_a2a_backend")
    options = {f.name: getattr(cfg, f.name) for f in fields(cfg) if f.name not in planned}
    plan = make(args, options, cfg.model_path, [layout])
    lp = plan.layouts[0]
    if not runs(lp):
        print(f"error: {layout.flags} cannot run {cfg.model_path}: {reason(lp)}", file=sys.stderr)
        return 2
    show(plan, args)
    return 0


def run_pd(args: argparse.Namespace, options: dict, model: str) -> int:
    from dpserve.plan import pd

    args.num_gpus = None  # each side's GPUs are its layout's
    try:
        plan = pd.pd_plan(*(make(args, options, model, [layout]) for layout in args.pd))
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(json.dumps(pd.to_json(plan), indent=1) if args.json else pd.render(plan))
    return 0


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    options = engine_kwargs(args, only=PLANNED_OPTIONS)
    if args.pd:
        return run_pd(args, options, args.model or args.model_path)
    return run(args, options, args.model or args.model_path, args.layout)


if __name__ == "__main__":
    sys.exit(main())
