"""A rank's process: its entry point, its signals, and its last word to the front end when it
fails. The step loop itself (worker/loop.py, the model stack) is imported in the rank, where the
fork server has preloaded it, never in the front end that starts the rank."""

from __future__ import annotations

import faulthandler
import logging
import multiprocessing as mp
import multiprocessing.connection
import os
import signal
import threading
import traceback

import torch
import zmq
from tqdm import tqdm

from dpserve.config import EngineConfig
from dpserve.messages import WorkerError
from dpserve.worker.channels import SEND_LINGER_MS, Heartbeat, WorkerAddresses

logger = logging.getLogger("dpserve.worker")

# The watchdog's signal to a live rank: write every thread's Python stack to stderr (the log).
STACK_DUMP_SIGNAL = signal.SIGUSR1


def run_worker(rank: int, cfg: EngineConfig, addrs: WorkerAddresses) -> None:
    """Process entry point for global rank `rank`; reports failures to the front end before exiting."""
    logging.basicConfig(level=cfg.log_level.upper(), format=f"[rank {rank}] %(levelname)s %(message)s")
    _leave_signals_to_front_end()
    # tqdm's default lock is a multiprocessing semaphore: a rank killed or exiting at once would leak it.
    tqdm.set_lock(threading.RLock())
    if cfg.device == "cpu":
        # The cores this instance may use (all, or those it was pinned to) shared out between its
        # ranks: more threads than cores only thrash.
        torch.set_num_threads(max(1, len(os.sched_getaffinity(0)) // cfg.ranks_per_node))
    ctx = zmq.Context()
    out = ctx.socket(zmq.PUSH)
    out.connect(addrs.outputs)
    heartbeat = Heartbeat(rank, cfg.watchdog_timeout, ctx, addrs.outputs)
    try:
        from dpserve.worker.loop import Worker  # the model stack: in the rank only (preloaded)

        Worker(rank, cfg, addrs, ctx, out, heartbeat).serve()
    except BaseException as e:  # the front end must learn of every failure, never hang
        logger.exception("failed")
        heartbeat.stop()
        error = WorkerError(rank, f"{type(e).__name__}: {e}", traceback.format_exc())
        # A PUSH without a peer blocks: a front end that is gone (another node's, stopped) is not
        # waited for beyond the linger.
        if out.poll(SEND_LINGER_MS, zmq.POLLOUT):
            out.send_pyobj(error, flags=zmq.NOBLOCK)
        # The message is only queued: destroying the context waits (up to the linger) until it is sent.
        ctx.destroy(linger=SEND_LINGER_MS)
        os._exit(1)
    heartbeat.stop()
    ctx.destroy(linger=SEND_LINGER_MS)  # every socket, the request socket of a leader's too


def _leave_signals_to_front_end() -> None:
    """Ctrl-C or a SIGTERM sent to the whole process group must reach the front end only, which
    then stops every rank in order; a rank dies with the process that started it (the front end,
    through the fork server) so it is never left orphaned."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    faulthandler.register(STACK_DUMP_SIGNAL, all_threads=True)
    # Not PR_SET_PDEATHSIG: a rank's parent is the fork server, which outlives a killed front end.
    starter = mp.parent_process()
    if starter is not None:

        def die_with_starter() -> None:
            mp.connection.wait([starter.sentinel])
            os.kill(os.getpid(), signal.SIGKILL)

        threading.Thread(target=die_with_starter, daemon=True, name="die-with-front-end").start()
