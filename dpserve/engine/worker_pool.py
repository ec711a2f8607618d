"""The worker processes (one per rank) of one node and the ZMQ sockets between the front end and
the group leaders.

Node 0 binds the sockets (ipc on one node, tcp next to `dist_init_addr` across nodes), starts its
share of the ranks and waits until every rank of every node reports ready. Other nodes only start
their ranks (`run_node`) and wait for them to exit.

Ports with --dist-init-addr HOST:P: torch.distributed of instance i uses P + i; the front end's
output collector P + instances; DP group g's request socket P + instances + 1 + g.
"""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import logging
import multiprocessing as mp
import multiprocessing.connection
import multiprocessing.forkserver
import os
import shutil
import signal
import socket
import tempfile
import threading
import time
from pathlib import Path

import torch
import zmq

from dpserve import cpu_ops
from dpserve.config import EngineConfig
from dpserve.messages import Beat, Ready, Shutdown, Wake, WorkerError
from dpserve.models.gguf import resolve_model_path
from dpserve.worker.channels import WorkerAddresses, heartbeat_interval
from dpserve.worker.process import STACK_DUMP_SIGNAL, run_worker

logger = logging.getLogger("dpserve")

POLL_MS = 100
STACK_DUMP_GRACE_S = 1.0  # after the watchdog trips: time for the live ranks to write their stacks
FAILED_NODE_GRACE_S = 10.0  # a node whose rank failed: how long the others get to exit


class WorkerFailure(RuntimeError):
    """A rank died, raised or hung (the watchdog); the workers are shut down."""


def prepared(cfg: EngineConfig) -> EngineConfig:
    """What starting ranks needs first: the device exists, the fused CPU kernels are built (once per
    machine), and `cfg` with a GGUF file or the packaged alias converted (once, cached) to a model
    directory."""
    if cfg.nnodes > 1 and not cfg.dist_init_addr:
        raise ValueError("nnodes > 1 needs dist_init_addr=HOST:PORT (node 0's address, reachable by all)")
    if cfg.device == "cuda" and not torch.cuda.is_available():
        build = "a CPU build" if torch.version.cuda is None else f"built for CUDA {torch.version.cuda}"
        raise ValueError(
            f"device=cuda, but this process sees no CUDA device (torch {torch.__version__}, {build}); "
            "use device cpu (or auto)"
        )
    if cfg.device == "cuda" and cfg.ranks_per_node > (gpus := torch.cuda.device_count()):
        # NCCL takes one GPU per rank: two ranks on one GPU would fail later as an NCCL error.
        raise ValueError(
            f"{cfg.ranks_per_node} ranks per node (tp={cfg.tp_size} x {cfg.num_instances} instance(s) over "
            f"nnodes={cfg.nnodes}) need {cfg.ranks_per_node} GPUs per node, but this node sees {gpus} "
            "(CUDA_VISIBLE_DEVICES); lower --tp/--dp or add nodes"
        )
    if cfg.device == "cpu":
        cpu_ops.load()  # built here, once, before any rank starts a step (the watchdog times steps)
    return dataclasses.replace(cfg, model_path=resolve_model_path(cfg.model_path))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def worker_addresses(cfg: EngineConfig, ipc_dir: Path | None) -> tuple[WorkerAddresses, WorkerAddresses]:
    """(addresses node 0 binds, addresses the workers connect to)."""
    n = cfg.num_instances
    if cfg.nnodes == 1:
        host, port = _split(cfg.dist_init_addr) if cfg.dist_init_addr else ("127.0.0.1", None)
        dist = [f"{host}:{port + i if port else free_port()}" for i in range(n)]
        addrs = WorkerAddresses(
            dist_init=dist,
            requests=[f"ipc://{ipc_dir}/req{g}" for g in range(cfg.dp_size)],
            outputs=f"ipc://{ipc_dir}/out",
        )
        return addrs, addrs
    host, port = _split(cfg.dist_init_addr)

    def tcp(h: str, p: int) -> str:
        return f"tcp://{h}:{p}"

    def at(h: str) -> WorkerAddresses:
        return WorkerAddresses(
            dist_init=[f"{host}:{port + i}" for i in range(n)],
            requests=[tcp(h, port + n + 1 + g) for g in range(cfg.dp_size)],
            outputs=tcp(h, port + n),
        )

    return at("*"), at(host)


def _split(addr: str) -> tuple[str, int]:
    host, _, port = addr.rpartition(":")
    if not host or not port.isdigit():
        raise ValueError(f"dist_init_addr must be HOST:PORT, got {addr!r}")
    return host, int(port)


# What the fork server imports before forking ranks: nothing on this path may initialise CUDA
# (tests/test_gpu_startup.py checks it), or every forked rank fails with "initialization error".
FORKSERVER_PRELOAD = ["dpserve.worker.loop"]


def start_ranks(cfg: EngineConfig, addrs: WorkerAddresses) -> list[mp.Process]:
    """Starts this node's ranks (global ranks node_rank * ranks_per_node ...)."""
    first = cfg.node_rank * cfg.ranks_per_node
    # A fork server that has imported the worker (torch, transformers: ~3 s of CPU) forks each rank:
    # only the first engine of a process pays for the imports. A rank still dies with the front end: it watches its starter's sentinel (worker/process.py).
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(FORKSERVER_PRELOAD)
    _start_fork_server()
    procs = [
        ctx.Process(target=run_worker, args=(r, cfg, addrs), daemon=True, name=f"dpserve-rank{r}")
        for r in range(first, first + cfg.ranks_per_node)
    ]
    for p in procs:
        p.start()
    return procs


def _start_fork_server() -> None:
    """Starts the fork server (once per process) with SIGTERM ignored, as Python already has it
    ignore SIGINT: a service manager stopping the server signals every process of its group, and
    a fork server dead before its ranks leaves their exit codes unknown (multiprocessing reports
    255 at once, though they still run), which read as failed ranks. It ends when the front end
    does (its socket closes). A signal handler can be set from the main thread only."""
    if threading.current_thread() is not threading.main_thread():
        multiprocessing.forkserver.ensure_running()
        return
    previous = signal.signal(signal.SIGTERM, signal.SIG_IGN)  # inherited across its exec
    try:
        multiprocessing.forkserver.ensure_running()
    finally:
        signal.signal(signal.SIGTERM, previous)


def stop_ranks(procs: list[mp.Process], timeout: float | None = 10) -> None:
    """Waits up to `timeout` seconds in all (None: forever) for the ranks to exit, then kills the rest."""
    deadline = None if timeout is None else time.monotonic() + timeout
    for p in procs:
        p.join(timeout=None if deadline is None else max(0.0, deadline - time.monotonic()))
    for p in procs:
        if p.is_alive():
            p.kill()
            p.join()


class Watchdog:
    """What the ranks' heartbeats say (`Heartbeat` in worker/channels.py): the rule behind
    --watchdog-timeout. A rank heard from before is silent once no heartbeat came for `timeout`
    seconds while the front end was listening; a rank's step stalls once its current step-loop
    iteration has run for `timeout` plus two heartbeats (by then the rank has logged its stacks)."""

    def __init__(self, timeout: float, now: float):
        self.timeout = timeout
        self.interval = heartbeat_interval(timeout)
        self.heard: dict[int, float] = {}  # rank -> when its latest heartbeat arrived
        self.step_age: dict[int, float] = {}  # rank -> its iteration's age in that heartbeat
        self.listening_since = now
        self._left = now  # when the front end last stopped listening

    def beat(self, rank: int, step_age: float, now: float) -> None:
        self.heard[rank] = now
        self.step_age[rank] = step_age

    def listen(self, now: float) -> None:
        """The front end starts reading: heartbeats sent while it was away (an idle Engine) may have
        been dropped, so silence counts from now."""
        if now - self._left > self.interval:
            self.listening_since = now

    def leave(self, now: float) -> None:
        self._left = now

    def silent(self, now: float) -> list[tuple[int, float]]:
        """(rank, seconds unheard) of the ranks silent for `timeout` seconds."""
        return [
            (r, now - t)
            for r, t in sorted(self.heard.items())
            if now - max(t, self.listening_since) >= self.timeout
        ]

    def stalled(self) -> list[tuple[int, float]]:
        """(rank, seconds in its current iteration, as its latest heartbeat said) of the ranks stuck
        in a step."""
        return [(r, a) for r, a in sorted(self.step_age.items()) if a >= self.timeout + 2 * self.interval]


class WorkerPool:
    """Node 0's view of the workers: starts them, a request socket per DP group, one output
    collector; `recv` raises WorkerFailure when a rank failed, died or hung (`Watchdog`)."""

    def __init__(self, cfg: EngineConfig):
        self.cfg = cfg
        self.closed = True
        self.watchdog = Watchdog(cfg.watchdog_timeout, time.monotonic())
        self._dir = Path(tempfile.mkdtemp(prefix="dpserve-"))
        bind, connect = worker_addresses(cfg, self._dir)
        self._zmq = zmq.Context()
        self._outputs = self._zmq.socket(zmq.PULL)
        self._outputs.bind(bind.outputs)
        self._requests = []
        for addr in bind.requests:
            sock = self._zmq.socket(zmq.PUSH)
            sock.bind(addr)
            self._requests.append(sock)
        self.collector = connect.outputs  # where others may report to the front end too
        self.procs = start_ranks(cfg, connect)
        self.closed = False
        # The ranks ignore SIGTERM (`_leave_signals_to_front_end`), so multiprocessing's own exit
        # handler, which terminates and joins them, would wait forever for a pool nobody shut down
        # (a script that raised, or forgot Engine.shutdown): ours runs first (atexit is LIFO).
        atexit.register(self.shutdown)
        ready: dict[int, Ready] = {}
        try:
            while len(ready) < cfg.world_size:
                msg = self.recv()
                if isinstance(msg, Ready):
                    ready[msg.rank] = msg
        except BaseException:
            self.shutdown()
            raise
        # One per DP group, from its leader.
        self.ready = [ready[g * cfg.attn_tp_size] for g in range(cfg.dp_size)]

    def send(self, dp_rank: int, msg: object, wake_all: bool = False) -> None:
        """`msg` to group `dp_rank`'s leader; `wake_all`: the other groups of its instance (DP
        attention), idle, must step with it."""
        if self.closed:
            raise RuntimeError("the engine is shut down")
        self._push(self._requests[dp_rank], msg)
        if wake_all and self.cfg.enable_dp_attention:
            for g, sock in enumerate(self._requests):
                if g != dp_rank:
                    self._push(sock, Wake())

    def _push(self, sock: zmq.Socket, msg: object) -> None:
        # A PUSH whose leader is gone blocks forever: once a rank died the message is dropped
        # instead, and the next `recv` raises WorkerFailure naming it.
        while True:
            try:
                sock.send_pyobj(msg, flags=zmq.NOBLOCK)
                return
            except zmq.Again:
                if self.dead_ranks():
                    return
                sock.poll(POLL_MS, zmq.POLLOUT)

    def recv(self, timeout_ms: int | None = None) -> object | None:
        """The next message from a worker, or None after `timeout_ms` (None: wait for one).
        Raises WorkerFailure when a rank reported an error, a local rank died or the watchdog tripped."""
        if self.closed:
            raise RuntimeError("the engine is shut down")
        self.watchdog.listen(time.monotonic())
        try:
            return self._recv(timeout_ms)
        finally:
            self.watchdog.leave(time.monotonic())

    def _recv(self, timeout_ms: int | None) -> object | None:
        deadline = None if timeout_ms is None else time.monotonic() + timeout_ms / 1000
        while True:
            if not self._outputs.poll(POLL_MS):
                if self.dead_ranks() and not self._outputs.poll(POLL_MS):
                    self._fail("")
                self._check_watchdog()
                if deadline is not None and time.monotonic() >= deadline:
                    return None
                continue
            msg = self._outputs.recv_pyobj()
            if isinstance(msg, WorkerError):
                self._fail(f"worker rank {msg.rank} failed: {msg.error}\n{msg.traceback}")
            if not isinstance(msg, Beat):
                return msg
            self.watchdog.beat(msg.rank, msg.step_age, time.monotonic())
            self._check_watchdog()

    def _check_watchdog(self) -> None:
        now, timeout = time.monotonic(), self.cfg.watchdog_timeout
        silent = self.watchdog.silent(now)
        if silent:
            # A stopped process cannot write its stack: the live ones are asked for theirs.
            quiet = {str(r) for r, _ in silent}
            for p in self.procs:
                if p.is_alive() and p.name.removeprefix("dpserve-rank") not in quiet:
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(p.pid, STACK_DUMP_SIGNAL)
            ranks = ", ".join(f"worker rank {r} is silent (no heartbeat for {t:.1f} s)" for r, t in silent)
            self._fail(f"watchdog: {ranks}; --watchdog-timeout {timeout:g} s", grace=STACK_DUMP_GRACE_S)
        stalled = self.watchdog.stalled()
        if stalled:
            # Each stalled rank has written its own stack by now.
            ranks = ", ".join(f"worker rank {r} is stuck in a step for {t:.1f} s" for r, t in stalled)
            self._fail(f"watchdog: {ranks}; --watchdog-timeout {timeout:g} s", grace=STACK_DUMP_GRACE_S)

    def dead_ranks(self) -> list[str]:
        return [
            f"worker rank {p.name.removeprefix('dpserve-rank')} exited with code {p.exitcode}"
            for p in self.procs
            if p.exitcode
        ]

    def shutdown(self, timeout: float = 10) -> None:
        """Asks the ranks to stop; kills those still running after `timeout` seconds."""
        if self.closed:
            return
        self.closed = True
        atexit.unregister(self.shutdown)
        for sock in self._requests:
            with contextlib.suppress(zmq.Again):  # a leader that is gone is killed below
                sock.send_pyobj(Shutdown(), flags=zmq.NOBLOCK)
        stop_ranks(self.procs, timeout)
        self._zmq.destroy(linger=0)
        shutil.rmtree(self._dir, ignore_errors=True)

    def _fail(self, reported: str, grace: float = 10) -> None:
        # A rank killed from outside reports nothing; its peers then fail in a collective.
        # Name the dead ranks first: they are the cause. `grace`: seconds the ranks get to exit
        # (a hung one never does).
        cause = "; ".join(filter(None, [*self.dead_ranks(), reported]))
        self.shutdown(grace)
        logger.error("shutting down: %s", cause)
        raise WorkerFailure(cause)


def run_node(cfg: EngineConfig) -> int:
    """A node other than 0: runs its ranks until they exit. Returns the exit code (0: clean)."""
    cfg = prepared(cfg)
    _, connect = worker_addresses(cfg, None)
    procs = start_ranks(cfg, connect)
    logger.info(
        "node %d/%d: started ranks %s, front end at %s",
        cfg.node_rank,
        cfg.nnodes,
        [p.name for p in procs],
        connect.outputs,
    )

    def terminate(signum, frame) -> None:
        for p in procs:
            p.terminate()

    signal.signal(signal.SIGTERM, terminate)
    # Once a rank failed its peers fail in their collectives; one that hangs (stopped) is killed.
    while any(p.exitcode is None for p in procs) and not any(p.exitcode for p in procs):
        mp.connection.wait([p.sentinel for p in procs if p.exitcode is None])
    stop_ranks(procs, timeout=None if not any(p.exitcode for p in procs) else FAILED_NODE_GRACE_S)
    codes = [p.exitcode for p in procs]
    if any(codes):
        logger.error("node %d: ranks exited with codes %s", cfg.node_rank, codes)
        return 1
    return 0
