"""python -m dpserve.plan: memory and speed of every layout of a model on some GPUs, before booking them.

python -m dpserve.plan --model deepseek-v3 --device-profile h200 --num-gpus 16 --nnodes 2
python -m dpserve.plan --model-path /models/DeepSeek-V2-Lite --device-profile h100 --num-gpus 8 --json
"""

from __future__ import annotations

import argparse
import sys

from dpserve.config import DEFAULT_CUDA_GRAPH_MAX_BS, PADDING_MODES
from dpserve.memory import DEFAULT_MEM_FRACTION_STATIC
from dpserve.plan.model import BUNDLED
from dpserve.plan.profiles import PROFILES


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
    hw.add_argument("--remeasure", action="store_true", help="measure the cpu profile again")
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


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m dpserve.plan",
        description="For every layout (tp, dp, with and without DP attention, replicas) of a model on N GPUs: "
        "weights and KV per rank, KV tokens per group and in all, the concurrency that fits, predicted decode "
        "step time and throughput over batch sizes (with the padding mode auto picks) and prefill time per "
        "chunk; recommendations per objective. Memory figures come from the engine's own code.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    m = p.add_argument_group("model")
    src = m.add_mutually_exclusive_group(required=True)
    src.add_argument("--model", choices=BUNDLED, help="a bundled config (published architecture numbers)")
    src.add_argument(
        "--model-path", help="a Hugging Face directory, its config.json, or what launch_server takes"
    )
    m.add_argument("--dtype", default="auto", choices=["auto", "float32", "float16", "bfloat16"])
    m.add_argument("--device", default=None, choices=["cpu", "cuda"], help="default: from the profile")
    par = p.add_argument_group("layouts")
    par.add_argument(
        "--num-gpus", type=int, default=None, help="GPUs (CPU: ranks) in all; default 8 (cpu: 4)"
    )
    par.add_argument("--nnodes", type=int, default=1, help="nodes the GPUs are spread over")
    par.add_argument(
        "--layout",
        nargs="+",
        default=None,
        metavar="TP:DP[:attn]",
        help="only these layouts, e.g. 8:2:attn 8:1 (default: every layout of --num-gpus)",
    )
    eng = p.add_argument_group("engine settings (as launch_server takes them)")
    eng.add_argument("--mem-fraction-static", type=float, default=DEFAULT_MEM_FRACTION_STATIC)
    eng.add_argument("--kv-cache-memory-gb", type=float, default=None)
    eng.add_argument("--max-total-tokens", type=int, default=None)
    eng.add_argument("--max-running-requests", type=int, default=256)
    eng.add_argument("--chunked-prefill-size", type=int, default=2048)
    eng.add_argument("--dp-padding-mode", default="auto", choices=PADDING_MODES)
    eng.add_argument("--cuda-graph-max-bs", type=int, default=DEFAULT_CUDA_GRAPH_MAX_BS)
    eng.add_argument("--disable-cuda-graph", action="store_true")
    add_plan_args(p)
    return p


def parse_layouts(specs: list[str] | None):
    from dpserve.plan.layouts import Layout

    if not specs:
        return None
    out = []
    for s in specs:
        parts = s.split(":")
        out.append(Layout(int(parts[0]), int(parts[1]), len(parts) > 2 and parts[2] == "attn"))
    return out


def run(args: argparse.Namespace, engine_kwargs: dict, model: str, layouts=None) -> int:
    from dpserve.plan import report
    from dpserve.plan.planner import Workload, make_plan
    from dpserve.plan.profiles import get_profile

    name = args.device_profile or ("cpu" if getattr(args, "device", None) == "cpu" else "h100")
    profile = get_profile(name, remeasure=args.remeasure)
    engine_kwargs = {k: v for k, v in engine_kwargs.items() if k != "device"}  # the profile's device
    num_gpus = getattr(args, "num_gpus", None) or (
        layouts[0].num_gpus if layouts else (4 if profile.is_cpu else 8)
    )
    wl = Workload(
        args.input_len, args.output_len, args.concurrency, args.request_rate, args.tpot_ms, args.batch_size
    )
    gpu_mem = int(args.gpu_memory_gb * 2**30) if args.gpu_memory_gb else None
    plan = make_plan(
        model, profile, num_gpus, wl, engine_kwargs, args.nnodes, gpu_mem, layouts, args.moe_kernel
    )
    if args.json:
        print(report.dumps(plan))
    else:
        print(report.render_text(plan, use_rich=not args.markdown))
    if args.plot:
        report.plot(plan, args.plot)
    return 0


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    engine_kwargs = dict(
        dtype=args.dtype,
        mem_fraction_static=args.mem_fraction_static,
        kv_cache_memory_gb=args.kv_cache_memory_gb,
        max_total_tokens=args.max_total_tokens,
        max_running_requests=args.max_running_requests,
        chunked_prefill_size=args.chunked_prefill_size,
        dp_padding_mode=args.dp_padding_mode,
        cuda_graph_max_bs=args.cuda_graph_max_bs,
        disable_cuda_graph=args.disable_cuda_graph,
    )
    return run(args, engine_kwargs, args.model or args.model_path, parse_layouts(args.layout))


if __name__ == "__main__":
    sys.exit(main())
