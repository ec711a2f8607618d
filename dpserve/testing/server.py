"""Runs `python -m dpserve.launch_server`, or SGLang's router in front of servers, as child processes
(for tests, examples and benchmarks).

A server's readiness comes from its own log ("Application startup complete"); the router's from
its /readiness answer, polled until every worker is healthy or a deadline passes.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time

import httpx

from dpserve.engine.worker_pool import free_port

READY_LINE = "Application startup complete"
POLL_S = 0.2  # between readiness polls


class ChildProcess:
    """A child process whose output is collected line by line (`output`) as it runs."""

    def __init__(
        self,
        cmd: list[str],
        ready_line: str | None = None,
        cpus: set[int] | None = None,
        own_group: bool = False,
    ):
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        pin = None if cpus is None else (lambda: os.sched_setaffinity(0, cpus))
        self.proc = subprocess.Popen(
            cmd,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env=env,
            preexec_fn=pin,
            process_group=0 if own_group else None,  # a group of its own: signalled as a service manager does
        )
        self.log: list[str] = []
        self._ready_line = ready_line
        self._ready = threading.Event()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.log.append(line)
            if self._ready_line is not None and self._ready_line in line:
                self._ready.set()
        self._ready.set()  # the process ended

    @property
    def output(self) -> str:
        return "".join(self.log)

    def wait(self, timeout: float) -> int:
        code = self.proc.wait(timeout)
        self._reader.join()
        return code

    def stop(self, timeout: float = 60) -> int:
        """SIGTERM, then the exit code."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        return self.wait(timeout)

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.wait(60)

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        if self.proc.poll() is None:
            self.stop()


class ServerProcess(ChildProcess):
    """A server; `cpus`: the cores it and its ranks may run on (all by default)."""

    def __init__(
        self,
        *args: str,
        port: int | None = None,
        wait_ready: bool = True,
        timeout: float = 300,
        cpus: set[int] | None = None,
        own_group: bool = False,
    ):
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        cmd = [sys.executable, "-m", "dpserve.launch_server", *args]
        if wait_ready:
            cmd += ["--port", str(self.port)]
        super().__init__(cmd, READY_LINE, cpus, own_group)
        if wait_ready:
            self._ready.wait(timeout)
            if self.proc.poll() is not None or not self._ready.is_set():
                self.kill()
                raise RuntimeError(f"the server did not start:\n{self.output}")


class RouterProcess(ChildProcess):
    """SGLang's router (`pip install sglang-router`) in front of `worker_urls`, on 127.0.0.1; ready
    once its /readiness counts every worker healthy. `args` are more launch_router flags. In PD
    mode (`prefill`: (URL, bootstrap port) of each prefill instance) `worker_urls` are the decode
    instances'."""

    def __init__(
        self,
        worker_urls: list[str],
        *args: str,
        timeout: float = 120,
        prefill: list[tuple[str, int]] | None = None,
    ):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        cmd = [sys.executable, "-m", "sglang_router.launch_router", "--host", "127.0.0.1"]
        cmd += [
            "--port",
            str(self.port),
            "--prometheus-host",
            "127.0.0.1",
            "--prometheus-port",
            str(free_port()),
        ]
        if prefill is None:
            cmd += ["--worker-urls", *worker_urls]
        else:
            cmd.append("--pd-disaggregation")
            cmd += [a for url, port in prefill for a in ("--prefill", url, str(port))]
            cmd += [a for url in worker_urls for a in ("--decode", url)]
        super().__init__([*cmd, *args])
        workers = len(worker_urls) + len(prefill or [])
        deadline = time.monotonic() + timeout
        while self.healthy_workers() < workers:
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.kill()
                raise RuntimeError(f"the router did not see {workers} healthy workers:\n{self.output}")
            time.sleep(POLL_S)

    def healthy_workers(self) -> int:
        try:
            return httpx.get(f"{self.url}/readiness").json().get("healthy_workers", 0)
        except (httpx.HTTPError, ValueError):
            return 0
