"""Starts the dpserve HTTP server (node 0) or a node's share of the ranks (other nodes).

python -m dpserve.launch_server --model-path PATH --tp 8 --dp 2 --enable-dp-attention
"""

from __future__ import annotations

import argparse
import logging
import signal
import sys

from dpserve.cli import add_engine_args, engine_kwargs, positive_int
from dpserve.config import EngineConfig
from dpserve.server.router import LOAD_BALANCE_METHODS, CacheAwarePolicy

logger = logging.getLogger("dpserve")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m dpserve.launch_server",
        description="Serve a model over HTTP (OpenAI-compatible API and SGLang's native /generate) with "
        "tensor parallelism and DP attention.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    add_engine_args(p)
    srv = p.add_argument_group("server")
    srv.add_argument("--host", default="127.0.0.1", help="HTTP host")
    srv.add_argument("--port", type=int, default=30000, help="HTTP port")
    srv.add_argument(
        "--served-model-name", default=None, help="model name in the API (default: --model-path)"
    )
    srv.add_argument(
        "--load-balance-method",
        default="cache_aware",
        choices=LOAD_BALANCE_METHODS,
        help="how requests are spread over DP groups (or replicas): cache_aware sends a request to the "
        "group whose prefix cache most likely holds its prompt's beginning unless the groups' loads "
        "drift apart (then as minimum_tokens); minimum_tokens: fewest outstanding tokens (queued "
        "prompt tokens + remaining decode budgets); shortest_queue: fewest requests in flight; "
        "round_robin: in turn. A request can pin a group with the data_parallel_rank field",
    )
    defaults = CacheAwarePolicy()
    srv.add_argument(
        "--cache-threshold",
        type=float,
        default=defaults.cache_threshold,
        help="cache_aware: share of the prompt a group must hold (in the router's prefix tree) for "
        "the cache to decide; below it the least-loaded group takes the request",
    )
    srv.add_argument(
        "--balance-abs-threshold",
        type=int,
        default=defaults.balance_abs_threshold,
        help="cache_aware: load wins over the cache when the busiest and the least busy group differ "
        "by more than this many outstanding tokens...",
    )
    srv.add_argument(
        "--balance-rel-threshold",
        type=float,
        default=defaults.balance_rel_threshold,
        help="...and the busiest has more than this many times the outstanding tokens of the least",
    )
    srv.add_argument(
        "--max-tree-size",
        type=positive_int,
        default=defaults.max_tree_tokens,
        help="cache_aware: tokens the router remembers per group (least recently used forgotten first)",
    )
    nodes = p.add_argument_group("multi-node")
    nodes.add_argument(
        "--nnodes", type=positive_int, default=1, help="number of nodes the ranks are spread over"
    )
    nodes.add_argument(
        "--node-rank",
        type=int,
        default=0,
        help="this node's index; node 0 serves HTTP, others only run their ranks",
    )
    nodes.add_argument(
        "--dist-init-addr",
        default=None,
        help="HOST:PORT of node 0 for torch.distributed (required with --nnodes > 1); ports "
        "PORT..PORT+instances+dp are used",
    )
    plan = p.add_argument_group("planning")
    plan.add_argument(
        "--dry-run",
        action="store_true",
        help="print the planner's figures for these flags (weights and KV per rank, KV tokens per group, "
        "predicted decode step and prefill time; python -m dpserve.plan) and exit without starting anything",
    )
    plan.add_argument(
        "--device-profile",
        default=None,
        help="with --dry-run: h100, h200, a100-80g, b200 or cpu (default: cpu on the CPU, else h100)",
    )
    return p


def dry_run(args: argparse.Namespace, cfg: EngineConfig) -> int:
    """The plan of this one layout (python -m dpserve.plan with these flags)."""
    from dpserve.plan.__main__ import build_parser as plan_parser
    from dpserve.plan.__main__ import run
    from dpserve.plan.layouts import Layout

    plan_args = plan_parser().parse_args(["--model-path", cfg.model_path, "--nnodes", str(cfg.nnodes)])
    plan_args.device_profile = args.device_profile or ("cpu" if cfg.device == "cpu" else "h100")
    kwargs = engine_kwargs(args)
    for key in ("model_path", "tp_size", "dp_size", "enable_dp_attention", "random_seed", "log_level"):
        kwargs.pop(key)
    layout = Layout(cfg.tp_size, cfg.dp_size, cfg.enable_dp_attention)
    return run(plan_args, kwargs, cfg.model_path, [layout])


def engine_config(args: argparse.Namespace) -> EngineConfig:
    return EngineConfig(
        **engine_kwargs(args),
        dist_init_addr=args.dist_init_addr,
        nnodes=args.nnodes,
        node_rank=args.node_rank,
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
        if args.dry_run:
            return dry_run(args, cfg)
        if cfg.node_rank > 0:
            from dpserve.engine.workers import run_node

            return run_node(cfg)
        from dpserve.server.tokenizer_manager import TokenizerManager

        policy = CacheAwarePolicy(
            args.cache_threshold, args.balance_abs_threshold, args.balance_rel_threshold, args.max_tree_size
        )
        tm = TokenizerManager(cfg, args.load_balance_method, policy)
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
            tm.abort_all_soon("the server is shutting down")
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
