"""Starts the dpserve HTTP server (node 0) or a node's share of the ranks (other nodes).

python -m dpserve.launch_server --model-path PATH --tp 8 --dp 2 --enable-dp-attention
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import socket
import sys

from dpserve.cli import HelpFormatter, add_engine_args, engine_kwargs, positive_int
from dpserve.config import EngineConfig
from dpserve.server.admission import DEFAULT_MAX_REQUEST_BYTES, Admission

logger = logging.getLogger("dpserve")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m dpserve.launch_server",
        description="Serve a model over HTTP (OpenAI-compatible API and SGLang's native /generate) with "
        "tensor parallelism and DP attention.",
        formatter_class=HelpFormatter,
    )
    add_engine_args(p, defaults={"log_level": "info"})
    srv = p.add_argument_group("server")
    srv.add_argument("--host", default="127.0.0.1", help="HTTP host")
    srv.add_argument("--port", type=int, default=30000, help="HTTP port")
    srv.add_argument(
        "--served-model-name", default=None, help="model name in the API (default: --model-path)"
    )
    srv.add_argument(
        "--api-key",
        default=os.environ.get("DPSERVE_API_KEY"),
        help="every endpoint but /health requires 'Authorization: Bearer KEY' (else 401); default: "
        "the environment variable DPSERVE_API_KEY, unset: no key",
    )
    srv.add_argument(
        "--max-request-bytes",
        type=positive_int,
        default=DEFAULT_MAX_REQUEST_BYTES,
        help="a larger request body gets 413, refused before it is read whole (default: 32 MiB)",
    )
    srv.add_argument(
        "--max-queued-requests",
        type=positive_int,
        default=None,
        help="generation requests waiting to run, as SGLang counts them (those in flight beyond "
        "--max-running-requests per DP group, or reported waiting); beyond it a new one gets 503 with "
        "Retry-After and those admitted are untouched (default: unbounded)",
    )
    srv.add_argument(
        "--graceful-shutdown-timeout",
        type=float,
        default=0.0,
        help="on SIGTERM: stop admitting (503, /health fails), let the requests in flight finish for up to "
        "this many seconds, abort the rest, exit 0 (default 0: abort at once)",
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


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    try:
        cfg = EngineConfig(**engine_kwargs(args))
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
            from dpserve.plan.__main__ import dry_run

            return dry_run(cfg, args.device_profile)
        if cfg.node_rank > 0:
            from dpserve.engine.worker_pool import run_node

            return run_node(cfg)
        from dpserve.engine.worker_pool import WorkerFailure
        from dpserve.server.tokenizer_manager import TokenizerManager

        sock = listen(args.host, args.port)  # before any weights load: a taken port fails in seconds
        tm = TokenizerManager(cfg)
    except (ValueError, OSError) as e:
        logger.error("%s", e)
        return 2
    except WorkerFailure as e:
        logger.error("a worker failed at start-up: %s", e)
        return 1
    admission = Admission(args.api_key, args.max_request_bytes, args.max_queued_requests)
    name = args.served_model_name or args.model_path
    return serve(tm, sock, name, args.log_level, admission, args.graceful_shutdown_timeout)


def listen(host: str, port: int) -> socket.socket:
    """The HTTP socket, bound now; raises OSError naming the address when it is taken."""
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        raise OSError(f"cannot listen on {host}:{port} ({e.strerror}); choose another --port") from None
    sock.set_inheritable(True)
    return sock


def serve(
    tm, sock: socket.socket, model_name: str, log_level: str, admission: Admission, grace_s: float = 0.0
) -> int:
    """Runs HTTP on `sock` until SIGTERM/SIGINT (exit 0; with `grace_s` > 0 the requests in flight
    get that long to finish first) or a worker failure (exit 1)."""
    import uvicorn

    from dpserve.server.http import create_app

    class Server(uvicorn.Server):
        def handle_exit(self, sig: int, frame) -> None:
            if grace_s > 0 and not admission.draining:  # a second signal stops at once
                admission.draining = True
                logger.info("draining: up to %g s for %d request(s) in flight", grace_s, admission.in_flight)
                tm.run_soon(drain)
                return
            # End the streams in flight so that the graceful shutdown does not wait on them.
            tm.abort_all_soon("the server is shutting down")
            super().handle_exit(sig, frame)

    async def drain() -> None:
        if not await admission.drained(grace_s):
            logger.warning("%d request(s) still in flight after %g s: aborted", admission.in_flight, grace_s)
        tm.abort_all(f"the server is shutting down (--graceful-shutdown-timeout {grace_s:g} s ran out)")
        server.should_exit = True

    host, port = sock.getsockname()[:2]
    app = create_app(tm, model_name, admission)
    server = Server(uvicorn.Config(app, host=host, port=port, log_level=log_level))
    tm.on_failure = lambda: setattr(server, "should_exit", True)
    # uvicorn re-raises a caught SIGTERM/SIGINT after shutting down; with these handlers in place
    # that re-raise is a no-op and the process exits with our code instead of dying by the signal.
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: None)
    logger.info("serving %s on http://%s:%d", model_name, host, port)
    # Listening from now on (the engine is ready): uvicorn logs "Application startup complete"
    # before it starts accepting, and a request sent in between must queue, not be refused.
    sock.listen(server.config.backlog)
    try:
        server.run(sockets=[sock])
    finally:
        tm.shutdown()
    if tm.failure is not None:
        logger.error("exiting: a worker failed: %s", tm.failure)
        return 1
    logger.info("shut down cleanly")
    return 0


if __name__ == "__main__":
    sys.exit(main())
