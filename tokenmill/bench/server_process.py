"""A real `tokenmill serve` (or `tokenmill router`) process on a free loopback port, for the
benchmarks and the tests that drive a server from outside."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile

import httpx

from tokenmill.utils.net import free_port, wait_healthy


class ServerProcess:
    """`tokenmill <command> --port P *args`, its output in a log file (`log_path`, a temporary file
    unless given, read into memory and removed by `stop`). Use as a context manager, or call
    `wait_ready` and `stop`."""

    def __init__(self, *args: str, command: str = "serve", env: dict | None = None, port: int | None = None,
                 log_path: str | None = None):
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self._own_log = log_path is None
        self._final_log: str | None = None  # an own log's text once stop() removed the file
        if log_path is None:
            log_path = tempfile.NamedTemporaryFile(prefix=f"tokenmill-{command}-", suffix=".log", delete=False).name
        self.log_path = log_path
        cmd = [sys.executable, "-m", "tokenmill.entrypoints.cli.main", command, "--port", str(self.port), *args]
        with open(log_path, "w") as log:
            self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, **(env or {})})

    @property
    def base_url(self) -> str:
        return self.url + "/v1"

    def log(self) -> str:
        if self._final_log is not None:
            return self._final_log
        with open(self.log_path) as f:
            return f.read()

    def wait_ready(self, timeout: float = 300.0) -> ServerProcess:
        def exited() -> str | None:
            if self.proc.poll() is None:
                return None
            return f"server exited with {self.proc.returncode}:\n{self.log()}"

        try:
            wait_healthy(self.url, exited, timeout)
        except TimeoutError as e:
            self.stop()  # a server that never became ready is not left running
            raise TimeoutError(f"{e}:\n{self.log()}") from None
        except BaseException:
            self.stop()
            raise
        return self

    def stop(self, sig=signal.SIGTERM, timeout: float = 60.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if self._own_log and self._final_log is None:
            self._final_log = self.log()
            os.unlink(self.log_path)
        return self.proc.returncode

    def metrics(self) -> dict[str, float]:
        """Unlabelled view of /metrics: metric name -> value (the last sample of each name)."""
        out = {}
        for line in httpx.get(self.url + "/metrics", timeout=10).text.splitlines():
            if line and not line.startswith("#"):
                name_labels, value = line.rsplit(" ", 1)
                out[name_labels.split("{")[0]] = float(value)
        return out

    def __enter__(self) -> ServerProcess:
        return self.wait_ready()

    def __exit__(self, *exc) -> None:
        self.stop()
