"""How a rank reaches the front end: the addresses of its sockets, and the heartbeat thread the
watchdog listens to (engine/worker_pool.py)."""

from __future__ import annotations

import contextlib
import faulthandler
import logging
import os
import threading
import time
from dataclasses import dataclass

import zmq

from dpserve.messages import Beat

logger = logging.getLogger("dpserve.worker")

SEND_LINGER_MS = 5000  # how long an exiting rank tries to deliver its last messages


@dataclass(frozen=True)
class WorkerAddresses:
    dist_init: list[str]  # host:port for torch.distributed, per instance
    requests: list[str]  # ZMQ address per DP group (front end -> group leader)
    outputs: str  # ZMQ address of the front end's collector (every rank -> front end)


def heartbeat_interval(watchdog_timeout: float) -> float:
    """Seconds between a rank's heartbeats: a tenth of the watchdog's timeout, at most 1 s."""
    return min(1.0, watchdog_timeout / 10)


class Heartbeat:
    """A thread of the rank's own that tells the front end every `heartbeat_interval` seconds that
    the rank is alive and how long its current step-loop iteration has run (the watchdog's two
    signals). Torch ops and collectives release the GIL, so a rank busy computing keeps beating; a
    stopped or frozen process falls silent. An iteration past the timeout writes this rank's stacks
    to the log once (a rank on another node than the front end can only do it itself); past twice
    the timeout the rank exits."""

    def __init__(self, rank: int, timeout: float, ctx: zmq.Context, address: str):
        self.rank, self.timeout, self.interval = rank, timeout, heartbeat_interval(timeout)
        self.step_start: float | None = None  # monotonic start of the iteration running now
        self._stopped = threading.Event()
        self._thread = threading.Thread(
            target=self._run, args=(ctx, address), name="dpserve-heartbeat", daemon=True
        )
        self._thread.start()

    def stop(self) -> None:
        self._stopped.set()
        self._thread.join()

    def _run(self, ctx: zmq.Context, address: str) -> None:
        sock = ctx.socket(zmq.PUSH)  # a socket of its own: zmq sockets are not thread-safe
        sock.connect(address)
        dumped_for = None
        while not self._stopped.wait(self.interval):
            start = self.step_start
            age = 0.0 if start is None else time.monotonic() - start
            if age >= self.timeout and dumped_for != start:
                dumped_for = start
                logger.error("a step has run for %.1f s (watchdog timeout %g s); stacks:", age, self.timeout)
                faulthandler.dump_traceback(all_threads=True)
            if age >= 2 * self.timeout:
                # The front end gave the instance up a timeout ago; on another node nobody else would
                # stop this rank (its peers may be stopped, not dead, so its collective never fails).
                logger.error("a step has run for %.1f s, twice the watchdog timeout: exiting", age)
                os._exit(1)
            # Never block: a front end that is not reading (an idle Engine) lets the queue fill.
            with contextlib.suppress(zmq.Again):
                sock.send_pyobj(Beat(self.rank, age), flags=zmq.NOBLOCK)
        sock.close(linger=0)
