"""Runs `python -m dpserve.launch_server` as a child process (for tests, examples and benchmarks).

Readiness comes from the server's own log ("Application startup complete"), not from polling.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading

from dpserve.engine.workers import free_port

READY_LINE = "Application startup complete"


class ServerProcess:
    def __init__(self, *args: str, port: int | None = None, wait_ready: bool = True, timeout: float = 300):
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        cmd = [sys.executable, "-m", "dpserve.launch_server", *args]
        if wait_ready:
            cmd += ["--port", str(self.port)]
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        self.proc = subprocess.Popen(
            cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env
        )
        self.log: list[str] = []
        self._ready = threading.Event()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()
        if wait_ready:
            self._ready.wait(timeout)
            if self.proc.poll() is not None or not self._ready.is_set():
                self.kill()
                raise RuntimeError(f"the server did not start:\n{self.output}")

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.log.append(line)
            if READY_LINE in line:
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

    def __enter__(self) -> ServerProcess:
        return self

    def __exit__(self, *exc) -> None:
        if self.proc.poll() is None:
            self.stop()
